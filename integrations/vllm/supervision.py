"""Starting a rank's kvflow engine, and starting its process again after it died.

Why: an engine process can die on its own (an OOM kill, a crash in a native library).  The
host must not keep the blocks kvflow held for it for ever, must not raise out of vLLM's step,
and must not serve the rank's later requests with nothing.  The worker (worker.py) sees the
death at its next hook, ends every transfer the process held (D: a failed load; P: the blocks
freed once vLLM says the request finished) and starts a new process, under a new incarnation
(its control channel's), on the same memory and the same control address; peers meet it as a
new association.

Why the blocks may go back at once: the worker learns of the death by reaping the process, and
by then the kernel has torn down whatever the process had registered (its NIXL agent's memory
registrations and endpoints, RDMA queue pairs, CUDA IPC mappings).  No peer can write into D's
blocks or read P's through it any more: the fencing rule holds without waiting for a peer.

How often: `RestartPolicy` (pure, time as input) allows `limit` starts within `window`
seconds; past that the rank stays without an engine (every command fails, each request's
transfer fails as above) and says so in the log, rather than spinning on a process that dies
at start.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvflow.control.channel import ControlChannel
from kvflow.control.sockets import is_loopback
from kvflow.control.zeromq import ZmqControl
from kvflow.errors import KVFlowError
from kvflow.integrations.vllm.device import Device
from kvflow.integrations.vllm.gpu_export import GpuExport, export_gpu_memory
from kvflow.integrations.vllm.links import ProcessLink, ThreadLink
from kvflow.integrations.vllm.settings import Settings
from kvflow.layout import KVLayout, MemoryType
from kvflow.runtime import host_memory
from kvflow.runtime.bell import Bell
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.runtime.process import EngineProcess, ProcessSpec
from kvflow.runtime.threaded import EngineThread
from kvflow.transports.base import Transport

__all__ = ("ProcessStart", "RestartPolicy", "start_process", "start_thread")

log = logging.getLogger("kvflow.vllm")

INLINE_OP_BYTES = 1 << 20  # in an engine process, ops of up to 1 MiB are posted from its loop


@dataclass
class RestartPolicy:
    """At most `limit` restarts of a rank's engine process within any `window` seconds."""

    limit: int = 5
    window: float = 60.0
    _starts: deque[float] = field(default_factory=deque)

    def allow(self, now: float) -> bool:
        """Whether a restart may be made at `now` (it is then counted).  Never raises."""
        while self._starts and self._starts[0] <= now - self.window:
            self._starts.popleft()
        if len(self._starts) >= self.limit:
            return False
        self._starts.append(now)
        return True


@dataclass(frozen=True)
class ProcessStart:
    """What a rank's engine process is started from, kept to start it again."""

    engine_id: str
    layout: KVLayout
    config: EngineConfig
    bind: str
    settings: Settings
    device: Device
    bell: str = ""  # where the engine process rings its engine core's bell (`kvflow.runtime.bell`)


def start_process(start: ProcessStart) -> tuple[ProcessLink, GpuExport, str]:
    """The rank's engine in a process of its own: its link, how its GPU memory reached it, and
    where it runs (for the log).

    :raises KVFlowError: the memory could not be shared or exported, or the process failed or
        did not say ready in time.
    """
    settings = start.settings
    # the engine process's loop is kvflow's alone: a small op is posted there (see EngineConfig)
    config = dataclasses.replace(start.config, inline_op_bytes=INLINE_OP_BYTES)
    layout = start.layout
    spans = host_memory.share_in_place([r for r in layout.regions if r.memory is MemoryType.DRAM])
    try:
        gpu = export_gpu_memory(layout.regions, settings.gpu_export)
    except KVFlowError:
        for span in spans:
            os.close(span.fd)
        raise
    spec = ProcessSpec(
        start.engine_id,
        layout,
        transport="nixl",
        transport_options={
            "backends": list(settings.nixl_backends),
            "granule": layout.block_len,
            "cuda": bool(gpu.regions),
            "loopback_only": is_loopback(start.bind),  # no data-plane socket beyond what the control binds
        },
        bind=start.bind,
        config=config,
        agent="kvflow.integrations.vllm.rank_agent:RankAgent",
        agent_options={"transfer_timeout": settings.transfer_timeout},
        log_level=log.getEffectiveLevel(),
        cpus=settings.engine_cpus,
        scheduling=settings.engine_scheduling,
        bell=start.bell,
    )
    try:
        process = EngineProcess(spec, spans, cuda_shares=gpu.shares, cuda_chunks=gpu.chunks)
    finally:
        for span in spans:  # the child has its own; this process's mapping keeps the memory
            os.close(span.fd)
        gpu.close_fds()
    return ProcessLink(process, start.device), gpu, _where(process, gpu)


def _where(process: EngineProcess, gpu: GpuExport) -> str:
    return f"engine process pid {process.pid}" + (f" ({gpu.what})" if gpu.what else "")


def start_thread(
    engine_id: str,
    layout: KVLayout,
    config: EngineConfig,
    bind: str,
    settings: Settings,
    device: Device,
    make_transport: Callable[[str], Transport] | None,
    bell: str = "",
) -> tuple[EngineThread, ThreadLink, str]:
    """The rank's engine on a thread of this process (`make_transport`: the host's transport
    in place of NIXL's, `bell`: its engine core's bell, rung when blocks come back); the
    thread, its link, and where it runs.

    :raises KVFlowError: the engine did not start.
    """
    config = dataclasses.replace(config, thread_setup=device.bind_thread)

    def factory() -> Engine:
        transport: Transport
        if make_transport is not None:
            transport = make_transport(engine_id)
        else:
            from kvflow.transports.nixl import NixlTransport

            transport = NixlTransport(
                engine_id,
                backends=settings.nixl_backends,
                granule=layout.block_len,
                thread_setup=device.bind_thread,
                loopback_only=is_loopback(bind),
            )
        control: ControlChannel = ZmqControl(engine_id, bind=bind, thread_setup=device.bind_thread)
        return Engine(
            engine_id, layout, transport, control, config=config, on_release=lambda _: released(), on_end=ended
        )

    def ended(_: object) -> None:  # a failure, and the gauges it moves, reach vLLM at its next step
        if ringer is not None:
            ringer.ring()

    def released() -> None:
        news.set()
        if ringer is not None:
            ringer.ring()

    news = threading.Event()  # the engine gave blocks back: a step waiting for it goes on
    ringer = Bell(bell) if bell else None
    thread = EngineThread(factory, name=f"kvflow-{engine_id}", thread_setup=device.bind_thread)
    link = ThreadLink(thread, settings.transfer_timeout, device, news, ringer)
    return thread, link, f"engine thread, pid {os.getpid()}"
