"""A peer's association phase, as a table: what each input does to it, and which step it takes.

Why a table: an association with a peer is a handshake that can cross, be retried, be answered
late, be refused by the transport, or be replaced by a new run of the peer while the old one
still serves.  Kept as dicts of half-made associations, each input handler decided by its own
ladder of checks; as rows over (phase, event) every combination has one answer, the tests check
that the table is total and that the associations' data agrees with it after every input, and
`kvflow diagrams` draws it.  `kvflow.protocol.association` reads it: it turns each input into an
event (`relate_hello` and `relate_message` below, pure), looks up the row, moves the phase and
executes the row's step.

A Hello is first related to the run in place (the associated one, or the one the transport is
adding): an answer from it, a retry of the association in place, one from an earlier run, or
`NEW`.  A new one is vetted (`Do.VET`) and that outcome is a second event of the same table,
so that a Hello arriving while the transport adds its sender is deferred before anything is
checked.  Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from kvflow.protocol.tables import complete, pairs

__all__ = ("LIVE", "TABLE", "Do", "Event", "Phase", "relate_hello", "relate_message", "relate_reject")


class Phase(Enum):
    NONE = "none"  # no association, none being added (a number for one we attempted may be kept)
    ADDING = "adding"  # its Hello passed every check; the transport is adding the peer
    ANSWERING = "answering"  # added; our answer to the Hello that started it is going out
    ASSOCIATED = "associated"  # both sides in place: transfers, heartbeats, a lease


class Event(Enum):
    CONNECT = "connect"  # a local connect to the peer
    # a Hello, related to the run in place (`relate_hello`)
    ANSWER = "answer"  # a reply from the run in place
    RETRY = "retry"  # the run in place asks again for the association in place
    OLDER_RUN = "older-run"  # from a run before the one in place
    NEW = "new"  # any other: a new association, vetted first
    # ... a new one, vetted
    NOT_PERMITTED = "not-permitted"  # this engine's own name, another peer's address, or not allowed
    FULL = "full"  # this engine is at its limit of peers
    UNACCEPTABLE = "unacceptable"  # asleep, the peer cooling, a false identity or another layout
    ACCEPTED = "accepted"
    # outcomes of the actions the rows ask for
    ROUTED = "routed"  # the route to an accepted Hello's sender is in place (or none was needed)
    PENDING_REFUSED = "pending-refused"  # the channel refused its address, or the transport the peer
    ADDED = "added"  # the transport added a peer that started the association
    ADDED_ANSWERED = "added-answered"  # ... a peer whose Hello answered ours
    ANSWER_SENT = "answer-sent"  # our answer to the Hello that started the association went out
    ANSWER_UNSENT = "answer-unsent"  # ... cannot be sent
    # other messages, related to the run in place (`relate_message`)
    MESSAGE = "message"  # a heartbeat or a transfer message from it
    GOODBYE = "goodbye"  # ... a Goodbye
    STRAY = "stray"  # anything from another run, or a Goodbye from a peer with no run in place
    UNASSOCIATED = "unassociated"  # any other message from a peer with no run in place
    REJECT = "reject"  # a Reject of our Hello
    REJECT_LATER_RUN = "reject-later-run"  # ... from a later run than the associated one
    # this side ends the association: the peer silent for a lease, its link down, cannot be sent to
    LOST = "lost"


class Do(Enum):
    DIAL = "dial"  # route to the peer and send our Hello (a local connect's own checks first)
    SETTLE = "settle"  # the handshake settled: associated
    ANSWER_AGAIN = "answer-again"  # send our answer again, best effort
    DEFER = "defer"  # keep the Hello (the newest only), decided once the transport is done
    VET = "vet"  # check a new Hello: feeds NOT_PERMITTED, FULL, UNACCEPTABLE or ACCEPTED
    REFUSE_OLDER_RUN = "refuse-older-run"  # for the log; the live association is not its to end
    REFUSE_SILENTLY = "refuse-silently"  # no answer: a Reject would cost what the limit bounds
    REFUSE = "refuse"  # answer with a Reject (or with our Hello, which names a layout's difference)
    ROUTE = "route"  # route to the sender at the address its Hello gives: feeds ROUTED
    ADD = "add"  # hand the peer to the transport
    REPLACE = "replace"  # tear the old association down, then hand the peer to the transport
    DROP_PENDING = "drop-pending"  # refuse the peer; what it sent early is dropped
    ANSWER_HELLO = "answer-hello"  # the association's data in place; answer the Hello that started it
    CONNECT = "connect"  # associated: settle the handshake, start waiting transfers, replay early messages
    GIVE_UP = "give-up"  # the association ends before it began: refuse and tear down
    DELIVER = "deliver"  # renew leases (a heartbeat) or hand the message to the transfer core
    KEEP_EARLY = "keep-early"  # kept, in order, until our side is in place (bounded)
    DROP_MESSAGE = "drop-message"  # counted as from an unknown sender
    # counted so, and answered with a Goodbye: the peer thinks it is associated with us (we tore
    # it down, or forgot it) and would otherwise wait out its transfers' deadlines
    ANSWER_UNASSOCIATED = "answer-unassociated"
    SAY_GOODBYE = "say-goodbye"  # the peer tore us down: tear it down here
    SETTLE_REFUSED = "settle-refused"  # the peer refused our Hello
    END_RUN = "end-run"  # a later run of the peer refused us: the associated run is gone
    TEAR_DOWN = "tear-down"  # tell the peer why (if associated), then tear it down


Row = tuple[Phase, tuple[Do, ...]]  # the phase it moves to, and its step (none, or one)
LIVE = (Phase.ANSWERING, Phase.ASSOCIATED)  # the association's data is in place
# the events a Hello makes: related to the run in place, then (a new one) vetted
_HELLOS = (
    Event.ANSWER,
    Event.RETRY,
    Event.OLDER_RUN,
    Event.NEW,
    Event.NOT_PERMITTED,
    Event.FULL,
    Event.UNACCEPTABLE,
    Event.ACCEPTED,
)


def _rows(
    phases: tuple[Phase, ...], event: Event, do: Do | None, to: Phase | None = None
) -> dict[tuple[Phase, Event], Row]:
    """`event` takes `do` (None: no step) in each of `phases`, moving to `to` (None: the phase stays)."""
    return {(phase, event): (phase if to is None else to, () if do is None else (do,)) for phase in phases}


_ROWS: dict[tuple[Phase, Event], Row] = {
    # A local connect dials unless the association's data is in place.
    **_rows((Phase.NONE, Phase.ADDING), Event.CONNECT, Do.DIAL),
    **_rows(LIVE, Event.CONNECT, None),
    # Hellos.  With no run in place every Hello is new (`relate_hello`); a live association
    # serves on while a new one is vetted and routed, or refused.
    **{(Phase.NONE, event): (Phase.NONE, (Do.VET,)) for event in (Event.ANSWER, Event.RETRY, Event.OLDER_RUN)},
    **_rows(LIVE, Event.ANSWER, Do.SETTLE),  # the answer to ours, after the peer's own Hello associated us
    # its wait for our answer ran out, or crossed it: tearing down would lose its transfers with us
    **_rows(LIVE, Event.RETRY, Do.ANSWER_AGAIN),
    # a replayed Hello of an earlier run: the run it speaks for is not there to hear an answer
    **_rows(LIVE, Event.OLDER_RUN, Do.REFUSE_OLDER_RUN),
    **_rows((Phase.NONE, *LIVE), Event.NEW, Do.VET),
    **_rows((Phase.NONE, *LIVE), Event.NOT_PERMITTED, Do.REFUSE_SILENTLY),
    **_rows((Phase.NONE, *LIVE), Event.FULL, Do.REFUSE_SILENTLY),
    **_rows((Phase.NONE, *LIVE), Event.UNACCEPTABLE, Do.REFUSE),
    **_rows((Phase.NONE, *LIVE), Event.ACCEPTED, Do.ROUTE),
    # While the transport adds the peer, its answer settles nothing more (the association under
    # way does) and any other Hello waits for the transport, unvetted.
    **_rows((Phase.ADDING,), Event.ANSWER, None),
    **{(Phase.ADDING, event): (Phase.ADDING, (Do.DEFER,)) for event in _HELLOS if event is not Event.ANSWER},
    # Routed: nothing of an old association survives a new one.
    **_rows((Phase.NONE, Phase.ADDING), Event.ROUTED, Do.ADD, Phase.ADDING),
    **_rows(LIVE, Event.ROUTED, Do.REPLACE, Phase.ADDING),
    # Refused on its way in; a live association (whose new Hello's address was refused) stays.
    **_rows((Phase.NONE, Phase.ADDING), Event.PENDING_REFUSED, Do.DROP_PENDING, Phase.NONE),
    **_rows(LIVE, Event.PENDING_REFUSED, Do.DROP_PENDING),
    # Added by the transport.  (An answer about an addition given up is no event: `Associations`
    # drops it, since the teardown's removal, queued behind the addition, undoes it.)
    **_rows((Phase.ADDING,), Event.ADDED, Do.ANSWER_HELLO, Phase.ANSWERING),
    **_rows((Phase.ADDING,), Event.ADDED_ANSWERED, Do.CONNECT, Phase.ASSOCIATED),
    **_rows((Phase.ANSWERING,), Event.ANSWER_SENT, Do.CONNECT, Phase.ASSOCIATED),
    **_rows((Phase.ANSWERING,), Event.ANSWER_UNSENT, Do.GIVE_UP, Phase.NONE),
    # Other messages.  While the transport adds it, the peer's side is in place already.
    **_rows(LIVE, Event.MESSAGE, Do.DELIVER),
    **_rows(LIVE, Event.GOODBYE, Do.SAY_GOODBYE, Phase.NONE),
    **_rows((Phase.ADDING,), Event.MESSAGE, Do.KEEP_EARLY),
    **_rows((Phase.ADDING,), Event.GOODBYE, Do.KEEP_EARLY),
    **_rows((Phase.NONE,), Event.MESSAGE, Do.DROP_MESSAGE),
    **_rows((Phase.NONE,), Event.GOODBYE, Do.DROP_MESSAGE),
    **_rows(tuple(Phase), Event.STRAY, Do.DROP_MESSAGE),
    # With no run in place (only in NONE: adding or live, a run is), answered; a Goodbye is a
    # STRAY, never answered, so two sides that each forgot the other do not answer each other.
    **_rows((Phase.NONE,), Event.UNASSOCIATED, Do.ANSWER_UNASSOCIATED),
    **_rows((Phase.ADDING, *LIVE), Event.UNASSOCIATED, Do.DROP_MESSAGE),
    **_rows(tuple(Phase), Event.REJECT, Do.SETTLE_REFUSED),
    **_rows(LIVE, Event.REJECT_LATER_RUN, Do.END_RUN, Phase.NONE),
    **_rows((Phase.NONE, Phase.ADDING), Event.REJECT_LATER_RUN, Do.SETTLE_REFUSED),
    # Ended here; a peer being added is given up (what the transport is adding it removes next).
    **_rows(tuple(Phase), Event.LOST, Do.TEAR_DOWN, Phase.NONE),
}

# Changing nothing: the transport's and our answer's outcomes about an addition that is not
# under way in that phase (`Associations` drops those about one given up before they come).
_IGNORED = {
    *pairs([Phase.NONE, Phase.ASSOCIATED], [Event.ADDED, Event.ADDED_ANSWERED, Event.ANSWER_SENT, Event.ANSWER_UNSENT]),
    *pairs([Phase.ADDING], [Event.ANSWER_SENT, Event.ANSWER_UNSENT]),
    *pairs([Phase.ANSWERING], [Event.ADDED, Event.ADDED_ANSWERED]),
}

TABLE: Mapping[tuple[Phase, Event], Row] = complete(
    "peer phases", Phase, Event, _ROWS, _IGNORED, lambda phase: (phase, ())
)


def relate_hello(run: int | None, association: int | None, incarnation: int, reply: bool, number: int) -> Event:
    """A Hello from run `incarnation` of its sender, numbering its association `number`, against
    the run in place (`run`, None: none) and that run's number for the live association
    (`association`, None: none live)."""
    if run is None:
        return Event.NEW
    if reply and incarnation == run:
        return Event.ANSWER
    if incarnation == run and number == association:
        return Event.RETRY
    return Event.OLDER_RUN if incarnation < run else Event.NEW


def relate_message(run: int | None, incarnation: int, goodbye: bool) -> Event:
    """Any other message than a Hello or a Reject, from run `incarnation` of its sender."""
    if run is None and not goodbye:
        return Event.UNASSOCIATED
    if run is None or incarnation != run:
        return Event.STRAY
    return Event.GOODBYE if goodbye else Event.MESSAGE


def relate_reject(associated: int | None, incarnation: int) -> Event:
    """A Reject from run `incarnation`; `associated`: the associated run (None: none)."""
    return Event.REJECT_LATER_RUN if associated is not None and incarnation > associated else Event.REJECT
