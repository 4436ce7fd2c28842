"""One stand-in vLLM engine with any KV connector, in its own process.

P or D, driven over JSON lines: what `kvflow bench vllm` runs.

Why a process per engine: a fair comparison of KV connectors runs each one inside vLLM's real
Scheduler and worker hooks, P and D apart, as in a deployment.  The engine itself is the
stand-in the tests use (`kvflow_tools.standin`), made with vLLM's own worker set-up
(a one-rank gloo group, the worker connector from ``ensure_kv_transfer_initialized``, the
handshake-metadata hand-off).  It steps like vLLM's engine core: back to back while the
scheduler has requests (``has_pending_push_work`` included).

Run as ``python -m kvflow_tools.bench.runner``: the first stdin line is the `EngineSpec`,
later lines are commands (``add``, ``pace``, ``model``, ``host``, ``cpu``, ``describe``, ``stop``); events
go out on stdout, one JSON object per line, timestamped with ``time.perf_counter``
(CLOCK_MONOTONIC, comparable across processes).  With ``host`` (`HostLoad`) the engine also does
a host engine's own work in every step and, while ``spin`` is on, steps back to back even with
nothing scheduled, as an engine core serving other requests does; ``cpu`` reports the CPU time
this process and its children (an engine kvflow runs in its own process) have used.
Everything else the process prints goes to stderr.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import IO, Any

from kvflow_tools.standin.model import EngineOptions, ModelShape
from kvflow_tools.standin.pacing import HostLoad, Pacer
from kvflow_tools.standin.timing import StepModel

__all__ = ("EngineSpec", "main", "spec_line")


@dataclass(frozen=True)
class EngineSpec:
    """What one engine process runs: the stand-in engine's options, NIXL tuning, and the CPUs
    it runs on (empty: any)."""

    options: EngineOptions
    nixl_progress_delay_us: int | None = None  # NIXL progress-thread delay (stock: 0, busy poll)
    cpus: tuple[int, ...] = ()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineSpec:
        options = dict(data["options"])
        model = options.pop("model", {})
        shared = tuple(tuple(pair) for pair in model.pop("shared", ()))
        return cls(
            EngineOptions(**options, model=ModelShape(**model, shared=shared)),
            data.get("nixl_progress_delay_us"),
            tuple(data.get("cpus", ())),
        )


def _slow_nixl_progress_thread(delay_us: int) -> None:
    """Make NIXL agents created from now on sleep `delay_us` between progress polls (stock
    agents busy-poll a core).  Only the agent config's constructor is wrapped."""
    api = importlib.import_module("nixl._api")  # the module vLLM's NIXL connectors use
    base = api.nixlBind.nixlAgentConfig

    class DelayedProgress(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, delay_us if name == "pthrDelay" else value)

    api.nixlBind.nixlAgentConfig = DelayedProgress


def _read_commands(stream: Iterable[str], commands: queue.Queue[dict[str, Any] | None]) -> None:
    for line in stream:
        if line.strip():
            commands.put(json.loads(line))
    commands.put(None)  # stdin closed: the driver is gone


def serve(spec: EngineSpec, commands: queue.Queue[dict[str, Any] | None], events: IO[str]) -> None:
    """Step the engine and obey commands until told to stop (or stdin closes)."""
    lock = threading.Lock()

    def emit(**event: Any) -> None:
        with lock:
            events.write(json.dumps(event) + "\n")
            events.flush()

    import torch

    from kvflow_tools.standin.engine import StandInEngine

    torch.set_num_threads(1)
    if spec.nixl_progress_delay_us is not None:
        _slow_nixl_progress_thread(spec.nixl_progress_delay_us)
    engine = StandInEngine(spec.options, emit)
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()  # as vLLM's engine core and GPU worker do once started: the GC skips their heap
    from vllm import __version__ as vllm_version

    emit(
        ev="ready",
        vllm=vllm_version,
        engine_id=spec.options.engine_id or spec.options.name,
        control_address=getattr(engine.worker, "control_address", ""),
        page_bytes=engine.ranks[0].pages.page_bytes,
        pid=os.getpid(),
    )
    try:
        while True:
            if not obey(engine, pending_commands(commands, wait=not engine.busy() and not engine.spin), emit):
                break
            if engine.busy() or engine.spin:
                engine.step()
    finally:
        engine.close()
        emit(ev="closed")


def pending_commands(commands: queue.Queue[dict[str, Any] | None], wait: bool) -> list[dict[str, Any] | None]:
    """Every command waiting, as vLLM's engine core drains its input queue before a step (an
    idle engine waits a little for the first)."""
    pending: list[dict[str, Any] | None] = []
    try:
        pending.append(commands.get(timeout=0.05) if wait else commands.get_nowait())
        while True:
            pending.append(commands.get_nowait())
    except queue.Empty:
        return pending


def obey(engine: Any, pending: list[dict[str, Any] | None], emit: Callable[..., None] | None = None) -> bool:
    """Apply the commands; False once told to stop (or stdin closed).  `emit`: where a
    ``describe`` command's answer (what the engine still waits on) goes."""
    for command in pending:
        if command is None or command["op"] == "stop":
            return False
        if command["op"] == "add":
            c = command
            engine.add(c["id"], c["prompt_len"], c["max_tokens"], c["params"], c["tag"])
        elif command["op"] == "describe" and emit is not None:
            emit(ev="describe", text=engine.describe())
        elif command["op"] == "pace":
            engine.step_ms = float(command["step_ms"])
        elif command["op"] == "host":  # the host's own work per step; spin: step with nothing scheduled
            engine.host = HostLoad.from_json(command["load"]) if command.get("load") else None
            engine.spin = bool(command.get("spin", False))
        elif command["op"] == "cpu" and emit is not None:
            emit(ev="cpu", t=time.perf_counter(), own=time.process_time(), children=children_cpu(os.getpid()))
        elif command["op"] == "model":  # pace every step by the step-time model
            o = engine.options
            model = StepModel.from_json(command["model"])
            engine.pacer = Pacer(model, o.max_num_batched_tokens, engine.config.cache_config.block_size)
    return True


def children_cpu(pid: int) -> float:
    """CPU seconds (user + system) the live child processes of `pid` have used, read from
    /proc (0 where /proc is not there)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0.0
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid:  # fields after the name: state, ppid, ..., utime (12th), stime
            total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def main() -> None:
    """Entry point of an engine process (see the module docstring)."""
    events = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever vLLM, NIXL or UCX print goes to stderr
    spec = EngineSpec.from_json(json.loads(sys.stdin.readline()))
    if spec.cpus:  # before vLLM, torch or NIXL start a thread
        os.sched_setaffinity(0, spec.cpus)
    commands: queue.Queue[dict[str, Any] | None] = queue.Queue()
    threading.Thread(target=_read_commands, args=(sys.stdin, commands), daemon=True).start()
    serve(spec, commands, events)


def spec_line(spec: EngineSpec) -> str:
    return json.dumps(asdict(spec))


if __name__ == "__main__":
    main()
