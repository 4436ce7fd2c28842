"""What a caller of the engine awaits: one side of one transfer, and how it ended.

Why apart from the engine: these are the values an embedder holds on to (a vLLM connector, a
thread driving the engine from outside the loop); they carry no engine state, only a future
the engine resolves.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvflow.errors import TransferFailed, TransferTimeout
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Outcome, Role

__all__ = ("EngineCounters", "TransferHandle", "TransferResult", "keep", "open_handle")


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
