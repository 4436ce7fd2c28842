"""What a caller of the engine awaits: one side of one transfer, and how it ended.

Why apart from the engine: these are the values an embedder holds on to (a vLLM connector, a
thread driving the engine from outside the loop); they carry no engine state, only a future
the engine resolves.  `Outcomes` is the engine's side of them: it executes the endpoint's
`Resolve` and `ReleaseBlocks` effects into futures, bounded queues, metrics and a callback.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvflow.errors import EngineClosed, TransferFailed, TransferTimeout
from kvflow.protocol.actions import ReleaseBlocks, Resolve
from kvflow.protocol.machine import Machine
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Outcome, Role
from kvflow.runtime.first_tokens import FirstTokens
from kvflow.runtime.meter import TransferMeter

__all__ = ("EngineCounters", "Outcomes", "TransferHandle", "TransferResult", "keep", "open_handle")

# a transfer's end is the engine's line (what operators filter on, and what the connector points to)
log = logging.getLogger("kvflow.runtime.engine")


@dataclass(slots=True)
class EngineCounters:
    """An engine's own counters (`Engine.counters`, in its stats), each named where it counts."""

    messages_from_unknown_peers: int = 0
    sends_failed: int = 0
    notifications_from_unknown: int = 0
    peers_refused: int = 0
    peer_removals_failed: int = 0  # a transport's remove_peer raised (retried: see `kvflow.protocol.teardown`)
    released_dropped: int = 0  # records `Engine.released` let go of, nobody having polled them
    finished_dropped: int = 0  # ... and `Engine.finished`
    bytes_written: int = 0  # by the WRITEs this engine submitted (push P)
    bytes_read: int = 0  # by the READs this engine submitted (pull D)
    integrity_mismatches: int = 0  # WRITEs D's integrity check failed (`kvflow.runtime.integrity`)
    integrity_checks: int = 0  # WRITEs D's integrity check hashed (one transfer in integrity_sample)

    def posted(self, write: bool, nbytes: int) -> None:
        """An op this engine submitted moves `nbytes`: a WRITE (push P) or a READ (pull D)."""
        if write:
            self.bytes_written += nbytes
        else:
            self.bytes_read += nbytes


@dataclass(frozen=True, slots=True)
class TransferResult:
    key: TransferKey
    role: Role
    outcome: Outcome
    reason: str

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.SUCCEEDED

    def raise_for_outcome(self) -> None:
        """:raises TransferFailed: the transfer did not succeed."""
        if not self.ok:
            raise TransferFailed(str(self.key), self.outcome.value, self.reason)


class TransferHandle:
    """One side of one transfer; await it (or `wait`) for its `TransferResult`."""

    def __init__(self, key: TransferKey, role: Role, future: asyncio.Future[TransferResult]) -> None:
        self.key = key
        self.role = role
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    async def wait(self, timeout: float | None = None) -> TransferResult:
        """The outcome, whether success or not (see `TransferResult.raise_for_outcome`).

        :raises TransferTimeout: no outcome within `timeout` seconds (the transfer goes on).
        :raises EngineClosed: the engine closed before the transfer had an outcome.
        """
        try:
            return await asyncio.wait_for(asyncio.shield(self._future), timeout)
        except TimeoutError:
            raise TransferTimeout(f"{self.role.value} transfer {self.key} undecided after {timeout}s") from None

    def __await__(self) -> Any:
        return self.wait().__await__()


def open_handle(
    handles: dict[tuple[TransferKey, Role], asyncio.Future[TransferResult]],
    key: TransferKey,
    role: Role,
    loop: asyncio.AbstractEventLoop,
    outcome: Outcome | None,
    reason: str,
) -> TransferHandle:
    """The handle of one side of a transfer, its future kept in `handles` until the engine
    resolves it (already resolved when the transfer has its `outcome`).  Never raises."""
    future = handles.get((key, role))
    if future is None:
        future = loop.create_future()
        if outcome is not None:
            future.set_result(TransferResult(key, role, outcome, reason))
        else:
            handles[(key, role)] = future
    return TransferHandle(key, role, future)


def keep(records: deque[Any], record: Any) -> bool:
    """Append `record` to the bounded `records`; whether that dropped the oldest one.  Never raises."""
    full = len(records) == records.maxlen
    records.append(record)
    return full


class Outcomes:
    """How an engine's transfers end, as its callers see it: each side's future, the bounded
    queues any thread may poll (`released`, `finished`: the newest `kept`, the oldest dropped
    and counted), the meter, and the `on_release` and `on_end` callbacks (run through `guard`)."""

    def __init__(
        self,
        engine_id: str,
        kept: int,
        meter: TransferMeter,
        counters: EngineCounters,
        on_release: Callable[[ReleaseBlocks], None] | None,
        guard: Callable[..., None],
        on_end: Callable[[TransferResult], None] | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.released: deque[ReleaseBlocks] = deque(maxlen=kept)  # thread-safe to popleft from anywhere
        self.finished: deque[TransferResult] = deque(maxlen=kept)
        self.meter, self.counters = meter, counters
        self.on_release, self.on_end, self._guard = on_release, on_end, guard
        self._futures: dict[tuple[TransferKey, Role], asyncio.Future[TransferResult]] = {}
        self.tokens = FirstTokens(kept)  # first tokens peers sent, until the host takes them

    def handle(self, machine: Machine, loop: asyncio.AbstractEventLoop) -> TransferHandle:
        """The handle of `machine`'s side of its transfer (resolved already if it has ended)."""
        return open_handle(self._futures, machine.key, machine.role, loop, machine.outcome, machine.reason)

    def release(self, action: ReleaseBlocks, now: float) -> None:
        self.meter.released(action.key, action.role, action.outcome, now)
        self.counters.released_dropped += keep(self.released, action)
        if self.on_release is not None:
            self._guard(self.on_release, action)

    def resolve(self, action: Resolve, now: float) -> None:
        result = TransferResult(action.key, action.role, action.outcome, action.reason)
        if action.outcome is Outcome.FAILED or action.outcome is Outcome.EXPIRED:  # an abort is the caller's
            what = (action.role.value, action.key, action.outcome.value, action.reason)
            log.warning("%s: %s transfer %s %s: %s", self.engine_id, *what)
        self.meter.resolved(action.key, action.role, action.outcome, now)
        self.counters.finished_dropped += keep(self.finished, result)
        future = self._futures.pop((action.key, action.role), None)
        if future is not None and not future.done():
            future.set_result(result)
        if self.on_end is not None:
            self._guard(self.on_end, result)

    def closed(self) -> None:
        """The engine closed: every handle (and first token) still waited for raises `EngineClosed`."""
        self.tokens.closed()
        for future in self._futures.values():
            if not future.done():
                future.set_exception(EngineClosed(f"engine {self.engine_id!r} closed"))
