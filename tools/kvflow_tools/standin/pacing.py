"""The stand-in engine paced by the step-time model.

What each step's batch is, how long the model says it takes, and what the engine's KV cache
and queues look like after it; and the host's own work in a step (`HostLoad`).

Why apart from `timing`: the model is pure arithmetic over rows; this module reads vLLM's
scheduler output and scheduler (the batch of a step, its block pool, its queues) to feed it and
to report each step, and `StandInEngine` only asks it for a step's duration and hands it the
step's measured time.

Why `HostLoad`: what a connector costs the engine it runs in shows in the engine's own Python
work.  A host engine's step holds the interpreter for a share of the step (scheduling, input
preparation, the forward's kernel launches, layer by layer) and releases it for the rest (the
GPU computing, the sampler's wait); `HostLoad` plays that with a fixed amount of pure-Python
work spread over the forward's layers and a GIL-free wait at the step's end, so that any time
a connector's threads take the interpreter from it shows as a longer step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvflow_tools.standin.timing import Row, StepModel

__all__ = ("HookClock", "HostLoad", "Pacer", "burn", "rows_of", "thread_times")


def burn(iterations: int) -> int:
    """Pure-Python work holding the interpreter (released only at its switch interval): the
    host engine's own Python, in units a caller calibrates to milliseconds."""
    total = 0
    for i in range(iterations):
        total += i & 7
    return total


class HookClock:
    """A worker connector as the model runner calls it: every call timed, the time summed, in
    all and per hook name, with the calling thread's CPU time in them (the difference is time
    the thread lost inside a hook: to a core another process took, or to the GIL)."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self.seconds = 0.0
        self.cpu = 0.0
        self.by_name: dict[str, float] = {}

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._worker, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                spent = time.perf_counter() - started
                self.cpu += time.thread_time() - cpu
                self.seconds += spent
                self.by_name[name] = self.by_name.get(name, 0.0) + spent

        return timed

    def take(self) -> tuple[float, dict[str, float], float]:
        """The time spent in hooks since the last call: in all, per hook name, and as CPU."""
        seconds, self.seconds = self.seconds, 0.0
        by_name, self.by_name = self.by_name, {}
        cpu, self.cpu = self.cpu, 0.0
        return seconds, by_name, cpu


def thread_times() -> tuple[float, float, float]:
    """The calling thread's (CPU seconds, seconds it waited for a core): what tells a step that
    took long because the thread waited for the GIL (neither running nor runnable) from one
    that waited for a core (runnable, in the kernel's run queue: /proc's schedstat; 0 where
    the kernel does not keep it)."""
    cpu = time.thread_time()
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            waited = int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        waited = 0.0
    return cpu, waited, time.perf_counter()


@dataclass(frozen=True)
class HostLoad:
    """The host's work in every step: `iterations` of `burn` spread over the forward's layers,
    then `wait_ms` with the interpreter released (the device computing)."""

    iterations: int
    wait_ms: float

    def layer(self, layers: int) -> float:
        """One of `layers` layers' share of the Python work; the seconds it took."""
        began = time.perf_counter()
        burn(self.iterations // layers)
        return time.perf_counter() - began

    def finish(self, since: tuple[float, float, float]) -> dict[str, float]:
        """The step's work since `since` (`thread_times`): its wall time (``busy``), the thread's
        CPU in it and its waits for a core (the rest it waited for the GIL or was blocked); then
        the wait with the interpreter released (the device computing)."""
        cpu, queued, busy = (b - a for a, b in zip(since, thread_times(), strict=True))
        time.sleep(self.wait_ms / 1e3)
        return {"busy": busy, "cpu": cpu, "queued": queued}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HostLoad:
        return cls(int(data["iterations"]), float(data["wait_ms"]))


def rows_of(so: Any, requests: dict[str, Any]) -> list[Row]:
    """The step's rows: each scheduled request's cached and new tokens (the scheduler has already
    advanced ``num_computed_tokens`` by the scheduled count)."""
    rows = []
    for request_id, count in so.num_scheduled_tokens.items():
        request = requests[request_id]
        cached = request.num_computed_tokens - count
        rows.append(Row(cached, count, decode=cached >= request.num_prompt_tokens))
    return rows


class Pacer:
    """One engine's pacing: the modelled duration of each step and a report of it."""

    def __init__(self, model: StepModel, budget_tokens: int, block_size: int) -> None:
        self.model = model
        self.budget_tokens = budget_tokens
        self.block_size = block_size
        self.firsts: list[str] = []

    def plan(self, so: Any, scheduler: Any) -> float:
        """The modelled milliseconds of the step that runs `so`; `firsts` becomes the requests
        whose first token it samples (the chunk that ends their prompt)."""
        rows = rows_of(so, scheduler.requests)
        self.firsts = [
            request_id
            for request_id, row in zip(so.num_scheduled_tokens, rows, strict=True)
            if not row.decode and row.cached + row.new >= scheduler.requests[request_id].num_prompt_tokens
        ]
        return self.model.step_ms(rows)

    def report(self, scheduler: Any, modelled_ms: float, real_ms: float) -> dict[str, Any]:
        """The step as the benchmark records it: blocks used of the total, queue lengths, the
        modelled and real (work, not waiting) milliseconds, whether the real work overran the
        model, and whether admission is stalled (a request waits and the head of the queue needs
        more free blocks than there are)."""
        pool = scheduler.kv_cache_manager.block_pool
        free = int(pool.get_num_free_blocks())
        running, waiting = scheduler.get_request_counts()
        stalled = False
        if scheduler.waiting:
            head = scheduler.waiting.peek_request()
            tokens = min(head.num_tokens - head.num_computed_tokens, self.budget_tokens)
            stalled = free < -(-tokens // self.block_size)
        total = int(pool.num_gpu_blocks) - 1  # vLLM's null block is never free, nor anyone's
        return {
            "used": total - free,
            "total": total,
            "waiting": waiting,
            "running": running,
            "model_ms": round(modelled_ms, 4),
            "real_ms": round(real_ms, 4),
            "over": real_ms > modelled_ms > 0,
            "stall": stalled,
        }
