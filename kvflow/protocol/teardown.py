"""Torn-down peers, decided without I/O: the removal, its retries, the grace and the late-ops hold.

Why a machine of its own: ending an association is quick, but when the blocks of a lost peer's
transfers may go back is the safety-critical part of the design ("no stale write is ever read").
Each teardown walks a small table, with a deadline per phase:

- REMOVING: the transport removes the peer (off the loop).  Once it returned, nothing new of the
  peer is posted; a removal that fails (the transport could not fence the peer's copies into our
  memory, as a stopped process's) is no crash: BACKING_OFF, retried after `RETRY_FIRST` seconds,
  doubling up to `RETRY_MAX`, for as long as the engine runs.
- GRACE: the peer's own WRITEs (or READs) may still be in flight towards us: they get `grace`
  seconds to land before the peer's transfers fail (PEER_LOST).  No grace when the transport
  fences inbound ops itself, or once the engine is closing.
- HOLDING (a peer that fell *silent* only): over UCX-TCP a WRITE posted before a link went down
  sits in a TCP connection the teardown cannot close, and lands when the link is back, however
  long that takes.  So the blocks it may write (push) or read (pull) stay quarantined until the
  peer associated again and a segment retransmitted from before the teardown has had its chance
  (TCP retries within about as long as it already waited: at most the lease plus the time since
  the teardown, plus the grace), or `hold` seconds at most; then FENCE releases them (no hold
  when the transfer core quarantined nothing of the peer's: NOTHING_HELD).  A peer
  torn down because it answered (a goodbye, a new Hello, its connection closed) had packets
  flowing, so nothing of it can be stuck: it has no hold.

While a teardown is removing or in its grace (or once its removal failed) the peer *cools*: no
new association with it.  Its transfers fail only once its removal returned.

Why pure, like the transfer core: rows are data (`TABLES`), checked for totality by the tests
and drawn by `kvflow diagrams`; time is an input (`tick(now)`, `next_deadline()`), so a manual
clock drives all of it.  The runtime only executes the actions, in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from kvflow.errors import KVFlowError
from kvflow.protocol.tables import complete, pairs

__all__ = (
    "RETRY_FIRST",
    "RETRY_MAX",
    "START",
    "TABLES",
    "Do",
    "Event",
    "HoldReport",
    "Kind",
    "Phase",
    "PeerFenced",
    "PeerGone",
    "RemovalFailed",
    "RemovePeer",
    "Teardown",
    "TeardownAction",
    "Teardowns",
    "backoff",
)

RETRY_FIRST = 0.05  # seconds before a failed removal is retried; doubling each time
RETRY_MAX = 5.0


def backoff(failures: int) -> float:
    """Seconds before a removal that failed `failures` times before is retried."""
    return min(RETRY_FIRST * 2.0 ** min(failures, 16), RETRY_MAX)


class Kind(Enum):
    """Whether a lost peer's ops may be stuck behind a dead link (decided at the teardown)."""

    ANSWERED = "answered"  # packets were flowing, or the transport fences inbound ops, or no grace
    SILENT = "silent"  # it only fell silent, and there is a grace: a late WRITE may still come


class Phase(Enum):
    REMOVING = "removing"
    BACKING_OFF = "backing-off"
    GRACE = "grace"
    HOLDING = "holding"
    ENDED = "ended"


class Event(Enum):
    REMOVED = "removed"  # the transport's removal returned
    REMOVAL_FAILED = "removal-failed"
    DEADLINE = "deadline"  # the phase's deadline passed
    HEARD_AGAIN = "heard-again"  # the peer associated again: the link carries packets
    SUPERSEDED = "superseded"  # a newer teardown of the same peer holds its blocks now
    NOTHING_HELD = "nothing-held"  # the transfer core quarantined nothing of the peer's: no hold needed


class Do(Enum):
    """What a row asks for; `Teardowns` turns each into an action or a deadline."""

    REMOVE = "remove"  # RemovePeer
    REPORT_FAILURE = "report-failure"  # RemovalFailed (counted and logged)
    LOSE = "lose"  # PeerGone: the peer's transfers fail, their blocks go back
    LOSE_UNFENCED = "lose-unfenced"  # PeerGone(unfenced): target blocks stay quarantined
    SUPERSEDE = "supersede"  # an older hold on the same peer ends: this one covers its blocks
    SHORTEN_HOLD = "shorten-hold"  # the hold ends once a late op has had its chance to land
    FENCE = "fence"  # PeerFenced: the quarantined blocks go back


Row = tuple[Phase, tuple[Do, ...]]

START: Row = (Phase.REMOVING, (Do.REMOVE,))  # every teardown begins here

_REMOVAL: dict[tuple[Phase, Event], Row] = {
    (Phase.REMOVING, Event.REMOVED): (Phase.GRACE, ()),
    (Phase.REMOVING, Event.REMOVAL_FAILED): (Phase.BACKING_OFF, (Do.REPORT_FAILURE,)),
    (Phase.BACKING_OFF, Event.DEADLINE): (Phase.REMOVING, (Do.REMOVE,)),
    # swallowed: a peer that associates again (possible when it does not cool) changes nothing
    # here, and events that cannot come in a phase change nothing either
    **{(phase, Event.HEARD_AGAIN): (phase, ()) for phase in (Phase.REMOVING, Phase.BACKING_OFF, Phase.GRACE)},
    **{
        (phase, event): (phase, ())
        for phase in (Phase.REMOVING, Phase.BACKING_OFF, Phase.GRACE)
        for event in (Event.SUPERSEDED, Event.NOTHING_HELD)
    },
    (Phase.REMOVING, Event.DEADLINE): (Phase.REMOVING, ()),
    (Phase.BACKING_OFF, Event.REMOVED): (Phase.BACKING_OFF, ()),
    (Phase.BACKING_OFF, Event.REMOVAL_FAILED): (Phase.BACKING_OFF, ()),
    (Phase.GRACE, Event.REMOVED): (Phase.GRACE, ()),
    (Phase.GRACE, Event.REMOVAL_FAILED): (Phase.GRACE, ()),
}

# Ignored: an ended teardown is forgotten (no event reaches it), and an answered one never holds.
_ENDED = pairs([Phase.ENDED], Event)


def _stays(phase: Phase) -> Row:
    return (phase, ())


TABLES: Mapping[Kind, Mapping[tuple[Phase, Event], Row]] = {
    Kind.ANSWERED: complete(
        "answered teardown",
        Phase,
        Event,
        {**_REMOVAL, (Phase.GRACE, Event.DEADLINE): (Phase.ENDED, (Do.LOSE,))},
        _ENDED | pairs([Phase.HOLDING], Event),
        _stays,
    ),
    Kind.SILENT: complete(
        "silent teardown",
        Phase,
        Event,
        {
            **_REMOVAL,
            (Phase.GRACE, Event.DEADLINE): (Phase.HOLDING, (Do.SUPERSEDE, Do.LOSE_UNFENCED)),
            (Phase.HOLDING, Event.HEARD_AGAIN): (Phase.HOLDING, (Do.SHORTEN_HOLD,)),
            (Phase.HOLDING, Event.DEADLINE): (Phase.ENDED, (Do.FENCE,)),
            (Phase.HOLDING, Event.SUPERSEDED): (Phase.ENDED, ()),
            (Phase.HOLDING, Event.NOTHING_HELD): (Phase.ENDED, ()),
            (Phase.HOLDING, Event.REMOVED): (Phase.HOLDING, ()),
            (Phase.HOLDING, Event.REMOVAL_FAILED): (Phase.HOLDING, ()),
        },
        _ENDED,
        _stays,
    ),
}


@dataclass(frozen=True, slots=True)
class RemovePeer:
    """Remove `peer` from the transport, off the loop; the outcome is an input: `removed` or
    `removal_failed`, with `number`."""

    peer: str
    number: int


@dataclass(frozen=True, slots=True)
class RemovalFailed:
    """A removal failed (counted and logged); it is retried in `retry_in` seconds."""

    peer: str
    attempt: int
    retry_in: float
    error: KVFlowError


@dataclass(frozen=True, slots=True)
class PeerGone:
    """The peer's transfers fail (`TransferCore.peer_lost`).  With `unfenced`, the blocks it may
    still write or read stay quarantined until `PeerFenced`.  `failed_attempts`: how many
    removals failed before one succeeded (for the log)."""

    peer: str
    reason: str
    unfenced: bool
    failed_attempts: int = 0


@dataclass(frozen=True, slots=True)
class PeerFenced:
    """Nothing the peer issued before its teardown can land any more (`TransferCore.peer_fenced`)."""

    peer: str


TeardownAction = RemovePeer | RemovalFailed | PeerGone | PeerFenced


@dataclass(frozen=True, slots=True)
class HoldReport:
    """Where the teardowns under way stand, for metrics: how many are in each phase, and in how
    many seconds the last of their blocks goes back by the rule as it stands now (a hold that the
    peer's return shortens counts with its shortened end).  `release_in` leaves out teardowns
    whose removal has not returned (no deadline is known for them: `by_phase` counts them) and
    is 0.0 when none has a deadline."""

    by_phase: Mapping[str, int]
    release_in: float


@dataclass(slots=True)
class Teardown:
    """One teardown of a peer, as it walks its table."""

    number: int
    peer: str
    reason: str
    kind: Kind
    torn_down: float  # when
    grace: float
    phase: Phase = Phase.REMOVING
    failures: int = 0  # removals that failed so far
    deadline: float | None = field(default=None)


class Teardowns:
    """Every teardown under way in one engine."""

    def __init__(self, grace: float, hold: float, lease: float) -> None:
        self.grace = grace  # 0: the transport fences inbound ops itself
        self.hold = hold
        self._closing = False
        self.lease = lease
        self._under_way: dict[int, Teardown] = {}
        self._numbered = 0

    # ---------------------------------------------------------------- inputs

    def torn_down(self, peer: str, reason: str, now: float, *, answered: bool) -> list[TeardownAction]:
        """The association with `peer` ended: remove it.  A teardown of a peer whose removal is
        being retried is that one's (it ends in PEER_LOST once the removal succeeds).  Never raises."""
        if peer in self.unremoved():
            return []
        self._numbered += 1
        grace = 0.0 if self._closing else self.grace
        kind = Kind.SILENT if not answered and grace > 0 else Kind.ANSWERED
        record = Teardown(self._numbered, peer, reason, kind, now, grace)
        self._under_way[record.number] = record
        out: list[TeardownAction] = []
        record.phase = START[0]
        for do in START[1]:
            self._apply(record, do, now, None, out)
        return out

    def removed(self, number: int, now: float) -> list[TeardownAction]:
        """The removal `RemovePeer.number` asked for returned.  Unknown numbers are ignored."""
        return self._event(number, Event.REMOVED, now)

    def removal_failed(self, number: int, now: float, error: KVFlowError) -> list[TeardownAction]:
        """The removal `RemovePeer.number` asked for failed.  Unknown numbers are ignored."""
        return self._event(number, Event.REMOVAL_FAILED, now, error)

    def heard_again(self, peer: str, now: float) -> list[TeardownAction]:
        """`peer` associated again.  Never raises."""
        out: list[TeardownAction] = []
        for record in self._of(peer):
            out += self._feed(record, Event.HEARD_AGAIN, now, None)
        return out

    def nothing_held(self, peer: str, now: float) -> list[TeardownAction]:
        """The transfer core keeps nothing quarantined for `peer` (`PeerGone(unfenced)` found no
        transfer whose blocks it may touch): its hold ends.  Never raises."""
        out: list[TeardownAction] = []
        for record in self._of(peer):
            out += self._feed(record, Event.NOTHING_HELD, now, None)
        return out

    def closing(self) -> None:
        """The engine is closing: no grace for teardowns from now on, nor for those whose removal
        has not returned yet (nobody is left to use what the grace protects)."""
        self._closing = True
        for record in self._under_way.values():
            if record.phase in (Phase.REMOVING, Phase.BACKING_OFF):
                record.grace = 0.0

    def tick(self, now: float) -> list[TeardownAction]:
        """Feed DEADLINE to every teardown whose deadline passed."""
        out: list[TeardownAction] = []
        for record in sorted(self._under_way.values(), key=lambda r: r.number):
            if record.deadline is not None and record.deadline <= now and record.number in self._under_way:
                out += self._feed(record, Event.DEADLINE, now, None)
        return out

    # ---------------------------------------------------------------- queries

    def next_deadline(self) -> float | None:
        return min((r.deadline for r in self._under_way.values() if r.deadline is not None), default=None)

    def cooling_until(self, peer: str) -> float | None:
        """When `peer` may associate again, at the earliest, or None when it may now."""
        ends = [
            r.deadline if r.deadline is not None else r.torn_down + r.grace
            for r in self._of(peer)
            if r.phase in (Phase.REMOVING, Phase.BACKING_OFF, Phase.GRACE) and (r.grace > 0 or r.failures)
        ]
        return max(ends, default=None)

    def unremoved(self) -> dict[str, int]:
        """Peers whose removal failed and is being retried: attempts so far."""
        return {
            r.peer: r.failures
            for r in self._under_way.values()
            if r.failures and r.phase in (Phase.REMOVING, Phase.BACKING_OFF)
        }

    def backing_off(self) -> bool:
        """Whether a failed removal waits for its retry."""
        return any(r.phase is Phase.BACKING_OFF for r in self._under_way.values())

    def under_way(self) -> list[Teardown]:
        return sorted(self._under_way.values(), key=lambda r: r.number)

    def report(self, now: float) -> HoldReport:
        """The teardowns by phase and when the last one's blocks go back (`HoldReport`)."""
        by_phase: dict[str, int] = {}
        ends: list[float] = []
        for record in self._under_way.values():
            by_phase[record.phase.value] = by_phase.get(record.phase.value, 0) + 1
            if record.deadline is None or record.phase is Phase.BACKING_OFF:
                continue  # the removal has not returned: its grace and hold have not begun
            # a silent peer's grace is followed by the whole hold
            then = self.hold if record.phase is Phase.GRACE and record.kind is Kind.SILENT else 0.0
            ends.append(record.deadline + then)
        return HoldReport(by_phase, max(max(ends) - now, 0.0) if ends else 0.0)

    # ---------------------------------------------------------------- the table

    def _of(self, peer: str) -> list[Teardown]:
        return [r for r in self.under_way() if r.peer == peer]

    def _event(self, number: int, event: Event, now: float, error: KVFlowError | None = None) -> list[TeardownAction]:
        record = self._under_way.get(number)
        return [] if record is None else self._feed(record, event, now, error)

    def _feed(self, record: Teardown, event: Event, now: float, error: KVFlowError | None) -> list[TeardownAction]:
        out: list[TeardownAction] = []
        while True:
            before = record.phase
            target, dos = TABLES[record.kind][(before, event)]
            record.phase = target
            if target is not before:
                record.deadline = self._deadline(record, now)
            for do in dos:
                self._apply(record, do, now, error, out)
            if target is Phase.ENDED:
                del self._under_way[record.number]
                return out
            # a deadline already due (no grace) passes at once
            if target is before or record.deadline is None or record.deadline > now:
                return out
            event = Event.DEADLINE

    def _deadline(self, record: Teardown, now: float) -> float | None:
        if record.phase is Phase.BACKING_OFF:
            return now + backoff(record.failures)
        if record.phase is Phase.GRACE:
            return now + record.grace
        if record.phase is Phase.HOLDING:
            return now + self.hold
        return None

    def _apply(
        self, record: Teardown, do: Do, now: float, error: KVFlowError | None, out: list[TeardownAction]
    ) -> None:
        if do is Do.REMOVE:
            out.append(RemovePeer(record.peer, record.number))
        elif do is Do.REPORT_FAILURE:
            cause = error or KVFlowError("the removal failed")
            out.append(RemovalFailed(record.peer, record.failures + 1, backoff(record.failures), cause))
            record.failures += 1
        elif do is Do.LOSE or do is Do.LOSE_UNFENCED:
            out.append(PeerGone(record.peer, record.reason, do is Do.LOSE_UNFENCED, record.failures))
        elif do is Do.SUPERSEDE:
            for older in self._of(record.peer):
                if older is not record and older.phase is Phase.HOLDING:
                    self._feed(older, Event.SUPERSEDED, now, None)
        elif do is Do.SHORTEN_HOLD:
            waited = self.lease + (now - record.torn_down)  # at most, by a segment still retransmitted
            assert record.deadline is not None  # HOLDING has one
            record.deadline = min(record.deadline, now + min(self.grace + waited, self.hold))
        elif do is Do.FENCE:
            out.append(PeerFenced(record.peer))
