"""vLLM's engine core asleep while every request it holds waits for KV, woken by kvflow.

Why: with push, D holds each request from the moment P does, so a request waits on D for as
long as it queues and prefills on P.  vLLM's engine core steps without pause while any request
waits for remote KV (a step that schedules nothing still goes to the workers, then 1 ms of
sleep), and where its workers are processes it talks to them through shared-memory queues whose
readers poll with `sched_yield` for one second after their last read.  A sleep shorter than that
in a worker's hook or here only moves the poll to the other process: measured on the CPU build,
four requests waiting for a frozen P cost D about a core (docs/benchmarks.md).

What: when a step schedules nothing, sends the workers nothing new, and every request vLLM's
scheduler holds is waiting for remote KV (or finished, its blocks held for a transfer), the
scheduler-side hook (`build_connector_meta`) sleeps until one of:
- kvflow has news: a rank's engine rings this process's bell (`kvflow.runtime.bell`) when it
  gives blocks back, a transfer ends or a call fails: what the workers report at their next
  step;
- vLLM has new input (a request, an abort, a utility call): the engine core's input queue
  (`queue.Queue`) is waited on by its own condition, which a `put` notifies;
- `limit` seconds pass: the bound on what none of these tells, a rank's engine process that
  died (found by its worker at the next step; a thread here watching its pid would run while
  the host's KV memory moves in place at an engine process's start, see `host_memory`), or
  `FOLLOW_UP` after a sleep kvflow's news ended (the worker's step asked its engine for the
  gauges that news moved; the next step reports them to vLLM's metrics).
After a sleep longer than the readers' one second both sides of vLLM's queues wait on sockets.
It never sleeps before the bell has rung once: each worker rings it at its first step, which
shows that the ranks' rings reach this process.

How the engine core is found: its input queue and scheduler are not handed to a connector, so
the first sleep looks up the calling frames for the object whose ``scheduler.connector`` is this
connector and which has an ``input_queue`` (vLLM 0.32 to 0.34's ``EngineCoreProc``).  Nothing of
vLLM's is changed; where no such object is found (another executor, another vLLM) the hook never
sleeps and says so once in the log.
"""

from __future__ import annotations

import inspect
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from kvflow.errors import KVFlowError
from kvflow.runtime.bell import BellListener, bell_path

__all__ = ("EngineLoop", "IdleSleep", "StepView", "engine_core_pid", "find_engine_loop", "listen", "may_sleep")

log = logging.getLogger("kvflow.vllm")

SEARCH_DEPTH = 16  # calling frames looked at for the engine core
# After a sleep kvflow's news ended, the next sleep lasts at most this long: the step the news
# started asked the rank's engine for its gauges (quarantined blocks, a peer's teardown), and
# the step after it reports them.  Within a second of a step the worker polls anyway.
FOLLOW_UP = 0.5


@dataclass(frozen=True)
class StepView:
    """What a scheduler step does, as far as sleeping after it goes."""

    scheduled_tokens: int  # tokens the step runs
    finishing: int  # finished requests the step tells the workers of
    orders: bool  # the step carries kvflow orders to the workers
    outstanding: bool  # transfers whose end the workers have not reported yet


def may_sleep(step: StepView, holds: Iterable[str]) -> bool:
    """Whether the engine core may sleep after `step`: it runs and orders nothing, transfers are
    outstanding, and each request the scheduler `holds` is "waiting" (for remote KV) or
    "finished" (blocks held for a transfer).  Never raises."""
    if step.scheduled_tokens or step.finishing or step.orders or not step.outstanding:
        return False
    return all(hold in ("waiting", "finished") for hold in holds)


@dataclass(frozen=True)
class EngineLoop:
    """vLLM's engine core as the sleep needs it: its input queue and its scheduler."""

    inputs: queue.Queue[Any]
    scheduler: Any


def find_engine_loop(connector: object, depth: int = SEARCH_DEPTH) -> EngineLoop | None:
    """The engine core running the calling step: the object, `depth` frames up at most, whose
    ``scheduler.connector`` is `connector` and whose ``input_queue`` is a queue.  Never raises."""
    here = inspect.currentframe()
    frame: FrameType | None = here.f_back if here is not None else None
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        inputs = getattr(owner, "input_queue", None)
        scheduler = getattr(owner, "scheduler", None)
        if isinstance(inputs, queue.Queue) and getattr(scheduler, "connector", None) is connector:
            return EngineLoop(inputs, scheduler)
        frame = frame.f_back
    return None


def engine_core_pid(executor_backend: object, own_pid: int, parent_pid: int) -> int | None:
    """The pid of the process whose engine core schedules for a worker: the worker's parent
    under vLLM's multiprocess executor, its own under the uniprocessor one; None for others
    (Ray, an external launcher).  Never raises."""
    return {"mp": parent_pid, "uni": own_pid}.get(executor_backend if isinstance(executor_backend, str) else "")


class IdleSleep:
    """The engine core's sleeps, and the bell that ends them (see the module's header)."""

    def __init__(self, engine_id: str, limit: float) -> None:
        """:raises KVFlowError: the bell cannot be listened for."""
        self.limit = limit
        self.counters: Counter[str] = Counter()  # sleeps by how they ended, and the time asleep
        self._rung = False
        self._heard = False  # a ring came: the ranks ring this bell (until then it never sleeps)
        self._lock = threading.Lock()  # guards `_cond` and `_rung` until the engine core is found
        self._cond: threading.Condition | None = None
        self._loop: EngineLoop | None = None
        self._searched = False
        self._follow_up = False  # the last sleep ended by kvflow's news: the next one is short
        self._listener = BellListener(bell_path(os.getpid(), engine_id), self._ring)

    @property
    def path(self) -> str:
        return self._listener.path

    @property
    def heard(self) -> bool:
        """Whether the bell has rung since this began (until then it never sleeps)."""
        return self._heard

    def _ring(self) -> None:
        with self._lock:
            self._heard = True
            cond = self._cond
            if cond is None:
                self._rung = True
                return
        with cond:
            self._rung = True
            cond.notify_all()

    def after_step(self, connector: object, step: StepView, holds_of: Any) -> bool:
        """Sleep after `step` when `may_sleep` allows it (`holds_of(scheduler)`: the scheduler's
        requests, each "waiting", "finished" or "running"); whether it slept.

        It never sleeps before the bell has rung once (each worker rings it at its first step):
        ranks that ring elsewhere (a worker that is not the engine core's child) must not leave
        requests asleep until `limit`; it then steps as vLLM does.  Never raises."""
        if not self._heard:
            return False
        loop = self._engine_loop(connector)  # found once; `holds_of` is read only if the step is quiet
        if loop is None or not may_sleep(step, holds_of(loop.scheduler)):
            return False
        self._sleep(loop)
        return True

    def _engine_loop(self, connector: object) -> EngineLoop | None:
        if not self._searched:
            self._searched = True
            self._loop = find_engine_loop(connector, SEARCH_DEPTH + 2)
            if self._loop is None:
                log.warning("kvflow: vLLM's engine core was not found from its scheduler's hook; it steps without "
                            "pause while requests wait for KV (idle_sleep has no effect)")  # fmt: skip
                return None
            with self._lock:
                self._cond = self._loop.inputs.not_empty
        return self._loop

    def _sleep(self, loop: EngineLoop) -> None:
        cond, pending = loop.inputs.not_empty, loop.inputs.queue  # read under the queue's own lock
        start = time.monotonic()
        short, self._follow_up = self._follow_up, False
        deadline = start + (min(self.limit, FOLLOW_UP) if short else self.limit)
        with cond:
            while True:
                if self._rung:
                    ended = "kvflow"
                    break
                if pending:
                    ended = "request"
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    ended = "follow_up" if short else "limit"
                    break
                cond.wait(left)
            self._rung = False  # news before this point is seen by the step that follows
        self._follow_up = ended == "kvflow"
        self.counters[f"idle_sleeps_ended_by_{ended}"] += 1
        self.counters["idle_sleep_ms"] += round((time.monotonic() - start) * 1000)

    def close(self) -> None:
        """Never raises."""
        self._listener.close()


def listen(engine_id: str, limit: float) -> IdleSleep | None:
    """The engine core's sleep for `engine_id` (None when `limit` is 0, or the bell cannot be
    listened for: then it steps as vLLM would, which the log says).  Never raises."""
    if limit <= 0:
        return None
    try:
        return IdleSleep(engine_id, limit)
    except KVFlowError as exc:
        log.warning("kvflow: %s; vLLM's engine core steps without pause while requests wait for KV", exc)
        return None
