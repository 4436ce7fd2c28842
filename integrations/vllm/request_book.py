"""One worker rank's record of each request it moves KV for, and a table of how a record moves.

Why a table: what a rank reports to vLLM (``finished_recving``, ``failed_recving``,
``finished_sending``, the blocks of a failed load) depends on what happened to the request's
pair transfers, in whatever order the engine's answers, its releases, vLLM's abort orders and
vLLM's finished ids arrive.  Kept as a set per condition (aborted, released, finished, ...),
each path tested its own combination of them; as rows over (stage, event) every combination has
one answer, a row left out is an error at import (`kvflow.protocol.tables.complete`), and a
request is reported once: the row that reports it ends it, and an ended request is forgotten.

This is one rank's view of a request; the scheduler side's book (`stages`) is the engine's view,
which these reports feed (its RECEIVED, RECEIVE_FAILED and SENT events).  Pure: no vLLM, no I/O;
the engine's answers are futures it only looks at, and ending a pair is a callable it is given.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvflow.protocol.actions import ReleaseBlocks
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Outcome, Role
from kvflow.protocol.tables import complete, pairs

__all__ = ("TABLE", "Do", "Event", "RequestBook", "RequestRecord", "Stage")

log = logging.getLogger("kvflow.vllm")


class Stage(Enum):
    # D: this rank receives the request's KV
    REFUSED = "refused"  # nothing registered (params it cannot use, blocks it cannot tell)
    LOADING = "loading"  # its registrations handed to the engine; its KV has not all landed
    ABORTING = "aborting"  # vLLM ended it meanwhile: its pairs aborted, their end no load failure
    # P: this rank sends it
    SENDING = "sending"  # parts handed to the engine; a pair has not ended
    SENDING_FINISHED = "sending-finished"  # ... and vLLM said the request finished
    RELEASED = "released"  # kvflow holds none of its blocks; vLLM has not said it finished
    # both
    ENDED = "ended"  # reported to vLLM, and forgotten


class Event(Enum):
    PAIR_FAILED = "pair-failed"  # a pair failed or never started; others are still open
    ALL_ENDED = "all-ended"  # its last open pair ended, none failed
    ALL_ENDED_FAILED = "all-ended-failed"  # ... one failed (D: failed, expired or aborted)
    NEVER_STARTED = "never-started"  # ... one never started (refused, or its engine died)
    ABORTED = "aborted"  # D: vLLM ended the request (an abort order)
    FINISHED = "finished"  # vLLM said the request finished
    REOPENED = "reopened"  # P: a part handed over after every earlier pair had ended


class Do(Enum):
    IGNORE = "ignore"  # not an event for this stage: nothing changes
    ABORT_OPEN = "abort-open"  # abort the pairs still open (each peer is told)
    REPORT_RECEIVED = "report-received"  # in finished_recving
    REPORT_FAILED = "report-failed"  # in failed_recving, its blocks as load errors
    REPORT_SENT = "report-sent"  # in finished_sending: vLLM frees its blocks


Row = tuple[Stage, tuple[Do, ...]]

_RECEIVED = (Do.REPORT_RECEIVED,)
_FAILED = (Do.REPORT_RECEIVED, Do.REPORT_FAILED)

_ROWS: dict[tuple[Stage, Event], Row] = {
    # D: every rank reports the request once, in finished_recving, when all its pairs have
    # ended, whether its KV landed or failed or the request ended meanwhile: vLLM's aggregator
    # counts the ranks per set, and frees a finished request's blocks on finished_recving.
    (Stage.REFUSED, Event.NEVER_STARTED): (Stage.ENDED, _FAILED),
    (Stage.LOADING, Event.PAIR_FAILED): (Stage.LOADING, (Do.ABORT_OPEN,)),  # the request fails: end the rest now
    (Stage.LOADING, Event.ALL_ENDED): (Stage.ENDED, _RECEIVED),
    (Stage.LOADING, Event.ALL_ENDED_FAILED): (Stage.ENDED, _FAILED),
    (Stage.LOADING, Event.NEVER_STARTED): (Stage.ENDED, _FAILED),
    (Stage.LOADING, Event.ABORTED): (Stage.ABORTING, (Do.ABORT_OPEN,)),
    (Stage.ABORTING, Event.PAIR_FAILED): (Stage.ABORTING, (Do.ABORT_OPEN,)),
    (Stage.ABORTING, Event.ALL_ENDED): (Stage.ENDED, _RECEIVED),
    (Stage.ABORTING, Event.ALL_ENDED_FAILED): (Stage.ENDED, _RECEIVED),  # ended on purpose: no load failure
    (Stage.ABORTING, Event.NEVER_STARTED): (Stage.ENDED, _FAILED),  # a failure even if aborted
    (Stage.ABORTING, Event.ABORTED): (Stage.ABORTING, (Do.ABORT_OPEN,)),
    # P: reported once kvflow released its blocks and vLLM said the request finished (vLLM's
    # rule for delayed frees), in either order
    (Stage.SENDING, Event.ALL_ENDED): (Stage.RELEASED, ()),
    (Stage.SENDING, Event.ALL_ENDED_FAILED): (Stage.RELEASED, ()),
    (Stage.SENDING, Event.NEVER_STARTED): (Stage.RELEASED, ()),  # kvflow never took them: vLLM frees them
    (Stage.SENDING, Event.FINISHED): (Stage.SENDING_FINISHED, ()),
    (Stage.SENDING_FINISHED, Event.ALL_ENDED): (Stage.ENDED, (Do.REPORT_SENT,)),
    (Stage.SENDING_FINISHED, Event.ALL_ENDED_FAILED): (Stage.ENDED, (Do.REPORT_SENT,)),
    (Stage.SENDING_FINISHED, Event.NEVER_STARTED): (Stage.ENDED, (Do.REPORT_SENT,)),
    (Stage.RELEASED, Event.FINISHED): (Stage.ENDED, (Do.REPORT_SENT,)),
    (Stage.RELEASED, Event.REOPENED): (Stage.SENDING, ()),  # kvflow holds its blocks again
}

_PAIR_ENDS = (Event.ALL_ENDED, Event.ALL_ENDED_FAILED, Event.NEVER_STARTED)

# Ignored: what the other role's requests go through, what a stage cannot see again, and
# anything once reported.
_IGNORED = {
    *pairs([Stage.ENDED], Event),
    *pairs([Stage.REFUSED], [e for e in Event if e is not Event.NEVER_STARTED]),  # nothing of it is open
    *pairs([Stage.LOADING, Stage.ABORTING], [Event.FINISHED, Event.REOPENED]),  # vLLM's finish tells D nothing
    # P: a failed pair ends alone (D fails the request); P's aborts end every part by its params
    *pairs([Stage.SENDING, Stage.SENDING_FINISHED], [Event.PAIR_FAILED, Event.ABORTED, Event.REOPENED]),
    (Stage.SENDING_FINISHED, Event.FINISHED),
    *pairs([Stage.RELEASED], [Event.PAIR_FAILED, *_PAIR_ENDS, Event.ABORTED]),  # no pair open
}

TABLE: Mapping[tuple[Stage, Event], Row] = complete(
    "worker requests", Stage, Event, _ROWS, _IGNORED, lambda stage: (stage, (Do.IGNORE,))
)

Answer = concurrent.futures.Future[Any]


@dataclass(slots=True)
class RequestRecord:
    """What one rank knows of one request: its pair transfers (one per rank of the other side
    it pairs with and KV cache group), how they went, and what the engine has yet to answer."""

    request_id: str
    role: Role
    stage: Stage
    blocks: tuple[int, ...] = ()  # D: every block its load fills (its load errors, should it fail)
    keys: list[TransferKey] = field(default_factory=list)  # its pairs, in the order they opened
    open: set[TransferKey] = field(default_factory=set)  # those not ended yet
    failed: bool = False  # a pair failed (D: failed, expired or aborted)
    hard: bool = False  # a pair never started: a failure even if the request was aborted
    # registrations (D) and hand-overs (P) the engine has not answered; None: nothing to open
    starts: list[tuple[Answer, TransferKey | None]] = field(default_factory=list)
    lost: set[TransferKey] = field(default_factory=set)  # pairs a dead engine process held

    def still_open(self) -> list[TransferKey]:
        """The pairs not ended yet, in the order they opened.  Never raises."""
        return [key for key in self.keys if key in self.open]


class RequestBook:
    """One rank's requests by id, each moved by `TABLE`, and what is to be reported to vLLM."""

    def __init__(self, name: str, abort: Callable[[TransferKey, Role, str], None]) -> None:
        """`name`: the rank's engine id, for its log lines; `abort`: ends one pair transfer,
        telling its peer (called for `Do.ABORT_OPEN`; what it raises goes through)."""
        self.name = name
        self._abort = abort
        self.block_errors = True  # a failed load's blocks are reported (one KV cache group only)
        self._records: dict[str, RequestRecord] = {}
        self._by_pair: dict[tuple[TransferKey, Role], str] = {}  # an open pair -> its request
        self._sending: set[str] = set()
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        self._load_errors: set[int] = set()

    # ------------------------------------------------------------------ D

    def refused(self, request_id: str, blocks: Sequence[int], answer: Answer) -> None:
        """D: nothing was registered (`answer` holds why): reported failed once it is done."""
        self._records[request_id] = RequestRecord(request_id, Role.DECODE, Stage.REFUSED, tuple(blocks))
        self._records[request_id].starts.append((answer, None))

    def expecting(self, request_id: str, keys: Sequence[TransferKey], blocks: Sequence[int]) -> None:
        """D: the request's pairs are registered with the engine, filling `blocks`."""
        record = RequestRecord(request_id, Role.DECODE, Stage.LOADING, tuple(blocks), list(keys), set(keys))
        self._records[request_id] = record
        for key in keys:
            self._by_pair[(key, Role.DECODE)] = request_id

    def abort(self, request_id: str, reason: str) -> None:
        """D: vLLM ended the request: its pairs still open are aborted (`reason` to the peer).
        :raises: what the `abort` callable raises."""
        record = self._records.get(request_id)
        if record is not None:
            self._apply(record, Event.ABORTED, reason)

    # ------------------------------------------------------------------ P

    def hand_over(self, request_id: str, key: TransferKey) -> bool:
        """P: pair `key` gets its first blocks now (kvflow holds the request's blocks from its
        first pair on); False if the request had that pair already.  Never raises."""
        record = self._records.get(request_id)
        if record is None:
            record = self._records[request_id] = RequestRecord(request_id, Role.PREFILL, Stage.SENDING)
        elif not record.open:  # every earlier pair ended (or none was taken): it starts again
            self._apply(record, Event.REOPENED)
            record.keys, record.failed, record.hard = [], False, False
        elif key in record.keys:
            return False
        record.keys.append(key)
        record.open.add(key)
        self._by_pair[(key, Role.PREFILL)] = request_id
        return True

    def nothing_taken(self, request_id: str) -> None:
        """P: kvflow takes none of the request's blocks (none now, if it held some before): it is
        reported sent once vLLM says it finished.  Never raises."""
        if request_id not in self._records:
            self._records[request_id] = RequestRecord(request_id, Role.PREFILL, Stage.RELEASED)

    # ------------------------------------------------------------------ both

    def awaiting(self, request_id: str, answer: Answer, key: TransferKey) -> None:
        """The engine's answer to pair `key`'s registration (D) or first hand-over (P): a
        failure ends the pair, at the next `results`.  Never raises."""
        record = self._records.get(request_id)
        if record is not None:
            record.starts.append((answer, key))

    def engine_lost(self) -> int:
        """The engine process died: every open pair fails at the next `results`.  How many
        pairs are lost so far.  Never raises."""
        for record in self._records.values():
            record.lost |= record.open
        return sum(len(record.lost) for record in self._records.values())

    def lost_pending(self) -> bool:
        """Whether pairs lost with an engine process wait for `results`.  Never raises."""
        return any(record.lost for record in self._records.values())

    def answered(self) -> bool:
        """Whether a registration or hand-over has an answer to act on.  Never raises."""
        return any(answer.done() for record in self._records.values() for answer, _ in record.starts)

    def waiting_for_finish(self) -> bool:
        """Whether a released request waits for vLLM to say it finished.  Never raises."""
        return any(record.stage is Stage.RELEASED for record in self._records.values())

    def results(
        self, released: Iterable[ReleaseBlocks], finished: Iterable[str]
    ) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) after the engine's answers, the
        pairs a dead engine held, the engine's `released` blocks, then vLLM's `finished` ids.
        A finished id the book holds no request for (every decode request's, every one kvflow
        never sent) is dropped, not kept for the life of the process.
        :raises: what the `abort` callable raises."""
        for record in list(self._records.values()):
            self._settle(record)
        for record in list(self._records.values()):  # what a dead engine process held
            for key in [key for key in record.still_open() if key in record.lost]:
                self._pair_ended(record, key, hard=True)
            record.lost.clear()
        for release in released:
            self._released(release)
        for request_id in finished:
            finishing = self._records.get(request_id)
            if finishing is not None:
                self._apply(finishing, Event.FINISHED)
        reports = self._sending, self._recving, self._failed
        self._sending, self._recving, self._failed = set(), set(), set()
        return reports

    def take_load_errors(self) -> set[int]:
        """The blocks of the loads that failed since the last call.  Never raises."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def stage(self, request_id: str) -> Stage | None:
        """The request's stage (None: not known, or reported).  Never raises."""
        record = self._records.get(request_id)
        return None if record is None else record.stage

    @property
    def finished_waiting(self) -> int:
        """How many requests vLLM said finished whose KV kvflow has still to give back."""
        return sum(1 for record in self._records.values() if record.stage is Stage.SENDING_FINISHED)

    def describe(self) -> str:
        """How many requests have a pair open, and how many answers D's and P's wait for."""
        records = self._records.values()
        starts = {role: sum(len(r.starts) for r in records if r.role is role) for role in Role}
        opened = sum(1 for record in records if record.open)
        return f"open pairs {opened}, starts {starts[Role.DECODE]}/{starts[Role.PREFILL]}"

    # ------------------------------------------------------------------ moves

    def _settle(self, record: RequestRecord) -> None:
        """The engine's answers that came: a failed registration or hand-over ends its pair
        (nothing of it is held)."""
        done = [start for start in record.starts if start[0].done()]
        if not done:
            return
        record.starts = [start for start in record.starts if not start[0].done()]
        for answer, key in done:
            error = answer.exception()
            if error is None:
                continue
            if record.role is Role.DECODE:
                log.error("%s: could not start receiving %s: %s", self.name, record.request_id, error)
            else:
                log.error("%s: could not hand over the KV of %s: %s", self.name, record.request_id, error)
            if key is None:
                self._apply(record, Event.NEVER_STARTED)
            else:
                self._pair_ended(record, key, hard=True)

    def _released(self, release: ReleaseBlocks) -> None:
        request_id = self._by_pair.get((release.key, release.role))
        record = None if request_id is None else self._records.get(request_id)
        if record is None:
            return
        failed = release.role is Role.DECODE and release.outcome is not Outcome.SUCCEEDED
        if failed and record.stage is not Stage.ABORTING:  # vLLM answers it with a bare HTTP 500
            # a failed or expired transfer has the engine's line giving the cause; an aborted one
            # was ended on purpose, here after another of the request's transfers failed, or by P
            aborted = release.outcome is Outcome.ABORTED
            why = "ended on purpose" if aborted else "the kvflow engine's line for it says why"
            log.error("%s: the KV of %s did not load: transfer %s %s (%s)", self.name, record.request_id,
                      release.key, release.outcome.value, why)  # fmt: skip
        self._pair_ended(record, release.key, failed=failed)

    def _pair_ended(self, record: RequestRecord, key: TransferKey, *, failed: bool = False, hard: bool = False) -> None:
        """One pair of the request ended: released (`failed`: D's transfer did not succeed), or
        never started (`hard`)."""
        if self._by_pair.get((key, record.role)) == record.request_id:
            del self._by_pair[(key, record.role)]
        if key in record.open:
            record.open.discard(key)
            record.failed |= failed or hard
            record.hard |= hard
            if not record.open:
                last = Event.ALL_ENDED_FAILED if record.failed else Event.ALL_ENDED
                self._apply(record, Event.NEVER_STARTED if record.hard else last)
                return
        if failed or hard:
            self._apply(record, Event.PAIR_FAILED, f"another rank's transfer of {record.request_id} failed")

    def _apply(self, record: RequestRecord, event: Event, reason: str = "") -> None:
        record.stage, dos = TABLE[(record.stage, event)]
        for do in dos:
            if do is Do.ABORT_OPEN:
                for key in record.still_open():
                    self._abort(key, record.role, reason)
            elif do is Do.REPORT_RECEIVED:
                self._recving.add(record.request_id)
            elif do is Do.REPORT_FAILED:
                self._failed.add(record.request_id)
                if self.block_errors:
                    self._load_errors.update(record.blocks)
            elif do is Do.REPORT_SENT:
                self._sending.add(record.request_id)
        if record.stage is Stage.ENDED and self._records.get(record.request_id) is record:
            del self._records[record.request_id]
