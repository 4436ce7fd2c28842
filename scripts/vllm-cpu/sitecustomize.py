"""Installed into the vLLM CPU environment: what every interpreter there does at its start.

vLLM spawns its engine and worker processes, so anything that must hold in all of a server's
processes has to happen at each interpreter's start.  Two things:

* **AMX tile state.**  Linux lets a process use AMX only after it asks
  (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); vLLM's CPU attention kernel uses
  AMX for bf16 without asking, and the process dies of SIGILL when its first forward is small.
  Elsewhere (no AMX, not x86-64 Linux) the call fails or is skipped, and nothing changes.
* **A NIXL progress thread that sleeps** (only with ``KVFLOW_NIXL_PROGRESS_DELAY_US`` set, to a
  whole number of microseconds).  A stock NIXL agent's progress thread polls without pause, a
  core per agent; with vLLM's NixlConnector on a host with fewer cores than its engines, that
  starves every other process there for seconds at a time (measured on 2 cores: 10-26 s, the
  router and the servers' HTTP front ends included).  The agents' config then sleeps that long
  between polls; NIXL's other progress (each transfer's status check) is unchanged.
* **A worker that stays on its own CPUs** (only with ``KVFLOW_NIXL_KEEP_WORKER_CPUS=1``).  On a
  CPU platform vLLM's NIXL worker (pull and push alike, ``nixl/base_worker.py``) pins the
  thread that builds it, the model runner's own, to the last core of each NUMA node, "reserved
  for KV transfer".  On a host that gives each engine one core (``VLLM_CPU_OMP_THREADS_BIND``)
  that moves P's and D's forwards onto the same last core, beside D's worker spinning in vLLM's
  shared-memory queue reader: measured on 2 cores, P's first forward with NixlPushConnector did
  not finish in 300 s and its engine core died.  With the variable set, that one call is
  skipped and the worker keeps the CPUs it was bound to.
"""

import contextlib
import ctypes
import os
import platform
import sys

SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
PROGRESS_DELAY = "KVFLOW_NIXL_PROGRESS_DELAY_US"
KEEP_WORKER_CPUS = "KVFLOW_NIXL_KEEP_WORKER_CPUS"
NIXL_WORKER = os.path.join("kv_connector", "v1", "nixl", "base_worker.py")
MAX_PROGRESS_DELAY_US = 1_000_000  # a second between polls already stalls every transfer

if sys.platform == "linux" and platform.machine() == "x86_64":
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)


def _sleeping_progress_thread(value: str) -> None:
    """NIXL agents configured from now on sleep `value` µs between progress polls."""
    if not (value.isascii() and value.isdigit() and int(value) <= MAX_PROGRESS_DELAY_US):
        raise SystemExit(
            f"{PROGRESS_DELAY} must be a whole number of microseconds up to {MAX_PROGRESS_DELAY_US}, not {value!r}"
        )
    import nixl._api as api  # type: ignore[import-untyped]  # what vLLM's NixlConnector builds its agents' config from

    class SleepingProgress(api.nixlBind.nixlAgentConfig):  # type: ignore[misc]
        def __setattr__(self, name: str, value: object) -> None:
            super().__setattr__(name, delay if name == "pthrDelay" else value)

    delay = int(value)
    api.nixlBind.nixlAgentConfig = SleepingProgress


def _keep_worker_cpus() -> None:
    """vLLM's NIXL worker's pinning of its own thread is skipped; every other call goes through."""
    pin = os.sched_setaffinity

    def sched_setaffinity(pid: int, mask: object) -> None:
        if pid == 0 and sys._getframe(1).f_code.co_filename.endswith(NIXL_WORKER):
            return
        pin(pid, mask)  # type: ignore[arg-type]

    os.sched_setaffinity = sched_setaffinity


if os.environ.get(KEEP_WORKER_CPUS) == "1" and hasattr(os, "sched_setaffinity"):
    _keep_worker_cpus()

if os.environ.get(PROGRESS_DELAY):
    _sleeping_progress_thread(os.environ[PROGRESS_DELAY])
