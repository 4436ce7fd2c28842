"""What an engine process says back to its host, kept until the host reads it.

Why a module of its own: `process.EngineProcess` reads the child's records in three places (the
ring of answers on each step, the socket when it looks at it, its blocking waits for the
child's ready and goodbye), and a record means the same wherever it came from.  What each one
means is here: a call's answer settles its future, released blocks and the engine's figures
wait for the host's reading methods, the failures the child reports are logged and kept.
When and where records are read, and under which deadlines, stays in `process`.

The records, each a msgpack array of plain types: ``["done", seq, error, result]`` for each
call, ``["released", transfer_id, epoch, role, outcome, block_ids]`` whenever the engine gives
blocks back, ``["meter", samples, outcomes, dropped]`` with the engine's per-transfer figures,
``["crashed", texts]``, and on the socket at the end ``["closed", crashes]``.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

import msgpack

from kvflow.protocol.actions import ReleaseBlocks
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Outcome, Role
from kvflow.runtime.frames import decode_record, error_from_record
from kvflow.runtime.meter import MeterReading, TransferSample

__all__ = ("Answers",)

# the engine process's line, wherever its records are read (what operators filter on)
log = logging.getLogger("kvflow.runtime.process")


class Answers:
    """The child's records as its host keeps them.  Not thread-safe: its owner holds its own
    lock around every use."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.released: deque[ReleaseBlocks] = deque()  # blocks given back, until `take_released`
        self._samples: list[TransferSample] = []
        self._outcomes: Counter[str] = Counter()
        self._dropped = 0
        self.crashes: list[str] = []  # what the child reported as bugs in it

    def take_payloads(self, payloads: Iterable[bytes], futures: dict[int, concurrent.futures.Future[Any]]) -> None:
        """Take each packed record (a ring's); one that is not a record is logged and skipped."""
        for payload in payloads:
            try:
                self.take(decode_record(payload), futures)
            except (ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException) as exc:
                log.error(
                    "%s: engine process sent a record that is not one: %r (%s)", self.engine_id, payload[:64], exc
                )

    def take(self, record: list[Any], futures: dict[int, concurrent.futures.Future[Any]]) -> None:
        """Take one record; a call's answer settles (and leaves) its future in `futures`, the
        calls that wait for their answers by sequence number."""
        kind = record[0]
        if kind == "done":
            _, seq, error, result = record
            future = futures.pop(seq, None)
            if future is None or not future.set_running_or_notify_cancel():
                return
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error_from_record(error))
        elif kind == "released":
            _, tid, epoch, role, outcome, blocks = record
            self.released.append(ReleaseBlocks(TransferKey(tid, epoch), Role(role), tuple(blocks), Outcome(outcome)))
        elif kind == "meter":
            _, samples, outcomes, dropped = record
            self._samples.extend(TransferSample(*sample) for sample in samples)
            self._outcomes.update(outcomes)
            self._dropped += dropped
        elif kind in ("crashed", "closed"):
            self.crashes.extend(record[1])
            for text in record[1]:
                log.error("%s: engine process failure: %s", self.engine_id, text)

    def take_released(self) -> list[ReleaseBlocks]:
        """The blocks given back since the last call."""
        released = list(self.released)
        self.released.clear()
        return released

    def meter_take(self) -> MeterReading:
        """The engine's per-transfer figures gathered since the last call."""
        if not (self._samples or self._outcomes or self._dropped):  # most steps
            return MeterReading()
        reading = MeterReading(self._samples, dict(self._outcomes), self._dropped)
        self._samples, self._outcomes, self._dropped = [], Counter(), 0
        return reading
