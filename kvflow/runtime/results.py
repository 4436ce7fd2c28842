"""What a caller of the engine awaits: one side of one transfer, and how it ended.

Why apart from the engine: these are the values an embedder holds on to (a vLLM connector, a
thread driving the engine from outside the loop); they carry no engine state, only a future
the engine resolves.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from kvflow.errors import TransferFailed, TransferTimeout
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Outcome, Role

__all__ = ("TransferHandle", "TransferResult")


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
