"""The teardown machine: its tables are total, and its deadlines do what the design promises, on a
manual clock (a removal retried with backoff, the grace, the late-ops hold and its end once the
peer is heard again)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.errors import TransportError
from kvflow.protocol.teardown import (
    RETRY_FIRST,
    RETRY_MAX,
    START,
    TABLES,
    Event,
    Kind,
    PeerFenced,
    PeerGone,
    Phase,
    RemovalFailed,
    RemovePeer,
    TeardownAction,
    Teardowns,
)
from kvflow_tools.diagrams import reachable_from

GRACE, HOLD, LEASE = 5.0, 120.0, 30.0


def reachable(kind: Kind) -> set[Phase]:
    return reachable_from(TABLES[kind], START[0])


def test_ended_and_every_phase_a_kind_never_reaches_change_nothing() -> None:
    """(Each table says what every pair does, or refuses to load: `kvflow.protocol.tables`.)"""
    for kind, table in TABLES.items():
        phases = reachable(kind)
        assert Phase.ENDED in phases, kind
        for phase in (set(Phase) - phases) | {Phase.ENDED}:
            assert all(table[(phase, event)] == (phase, ()) for event in Event), (kind, phase)


def test_a_row_that_changes_nothing_does_nothing_and_only_a_silent_peer_is_held() -> None:
    for table in TABLES.values():
        for (source, event), (target, dos) in table.items():
            if target is source and event is not Event.HEARD_AGAIN:
                assert dos == (), (source, event)
    assert Phase.HOLDING in reachable(Kind.SILENT) and Phase.HOLDING not in reachable(Kind.ANSWERED)


def removal(actions: list[TeardownAction]) -> RemovePeer:
    (remove,) = [a for a in actions if isinstance(a, RemovePeer)]
    return remove


def test_a_silent_peer_is_lost_after_the_grace_and_fenced_after_the_hold() -> None:
    t = Teardowns(GRACE, HOLD, LEASE)
    remove = removal(t.torn_down("P", "no message for 30s", 100.0, answered=False))
    assert t.cooling_until("P") is not None and t.next_deadline() is None  # removing: no deadline yet
    assert t.removed(remove.number, 101.0) == [] and t.next_deadline() == 106.0
    assert t.tick(105.9) == []
    assert t.tick(106.0) == [PeerGone("P", "no message for 30s", unfenced=True)]
    assert t.cooling_until("P") is None  # the peer may associate again
    assert t.next_deadline() == 106.0 + HOLD
    assert t.tick(106.0 + HOLD) == [PeerFenced("P")] and t.under_way() == []


def test_a_silent_peer_heard_again_is_fenced_once_a_retransmitted_segment_had_its_chance() -> None:
    t = Teardowns(GRACE, HOLD, LEASE)
    remove = removal(t.torn_down("P", "silent", 100.0, answered=False))
    t.removed(remove.number, 100.0)
    t.tick(105.0)
    assert t.heard_again("P", 110.0) == []
    # a segment still retransmitted waited at most the lease and the 10 s since the teardown
    assert t.next_deadline() == 110.0 + GRACE + LEASE + 10.0
    t.heard_again("P", 200.0)  # later: the hold's own end comes first
    assert t.next_deadline() == 110.0 + GRACE + LEASE + 10.0
    assert t.tick(155.0) == [PeerFenced("P")]


def test_a_hold_over_nothing_ends_at_once() -> None:
    t = Teardowns(GRACE, HOLD, LEASE)
    remove = removal(t.torn_down("P", "silent", 0.0, answered=False))
    t.removed(remove.number, 0.0)
    assert t.tick(5.0) == [PeerGone("P", "silent", unfenced=True)]
    assert t.nothing_held("P", 5.0) == [] and t.under_way() == [] and t.next_deadline() is None


def test_an_answered_teardown_loses_the_peer_after_the_grace_without_a_hold() -> None:
    t = Teardowns(GRACE, HOLD, LEASE)
    remove = removal(t.torn_down("P", "goodbye", 0.0, answered=True))
    t.removed(remove.number, 1.0)
    assert t.tick(6.0) == [PeerGone("P", "goodbye", unfenced=False)] and t.under_way() == []


def test_without_a_grace_the_peer_is_lost_as_soon_as_its_removal_returned() -> None:
    t = Teardowns(0.0, HOLD, LEASE)  # the transport fences inbound ops
    remove = removal(t.torn_down("P", "silent", 0.0, answered=False))
    assert t.cooling_until("P") is None
    assert t.removed(remove.number, 2.0) == [PeerGone("P", "silent", unfenced=False)]
    assert t.under_way() == [] and t.next_deadline() is None


def test_closing_drops_the_grace_of_removals_under_way_but_keeps_the_hold_of_a_silent_peer() -> None:
    t = Teardowns(GRACE, HOLD, LEASE)
    remove = removal(t.torn_down("P", "silent", 0.0, answered=False))
    t.closing()
    assert t.removed(remove.number, 1.0) == [PeerGone("P", "silent", unfenced=True)]
    later = removal(t.torn_down("Q", "silent", 2.0, answered=False))
    assert t.removed(later.number, 2.0) == [PeerGone("Q", "silent", unfenced=False)]


def test_a_failed_removal_is_retried_with_backoff_and_the_peer_cools_until_it_succeeds() -> None:
    t = Teardowns(0.0, HOLD, LEASE)
    error = TransportError("cannot fence")
    now, number = 0.0, removal(t.torn_down("P", "silent", 0.0, answered=False)).number
    delays = []
    for attempt in range(1, 10):
        (failed,) = t.removal_failed(number, now, error)
        assert isinstance(failed, RemovalFailed) and failed.attempt == attempt and failed.error is error
        delays.append(failed.retry_in)
        assert t.unremoved() == {"P": attempt} and t.backing_off() and t.cooling_until("P") == now + failed.retry_in
        assert t.torn_down("P", "again", now, answered=True) == []  # the teardown under way is the one
        assert t.tick(now + failed.retry_in - 0.001) == []
        now += failed.retry_in
        number = removal(t.tick(now)).number
        assert not t.backing_off() and t.unremoved() == {"P": attempt}
    assert delays == [min(RETRY_FIRST * 2**i, RETRY_MAX) for i in range(9)]
    assert t.removed(number, now) == [PeerGone("P", "silent", unfenced=False, failed_attempts=9)]
    assert t.unremoved() == {} and t.cooling_until("P") is None


def test_a_newer_hold_on_the_same_peer_supersedes_the_older_one() -> None:
    t = Teardowns(GRACE, HOLD, LEASE)
    first = removal(t.torn_down("P", "one", 0.0, answered=False))
    t.removed(first.number, 0.0)
    t.tick(5.0)  # holding until 125
    second = removal(t.torn_down("P", "two", 50.0, answered=False))
    t.removed(second.number, 50.0)
    assert t.tick(55.0) == [PeerGone("P", "two", unfenced=True)]
    assert [r.number for r in t.under_way()] == [second.number]
    assert t.tick(125.0) == [] and t.tick(175.0) == [PeerFenced("P")]


def test_unknown_removal_numbers_change_nothing() -> None:
    t = Teardowns(GRACE, HOLD, LEASE)
    removal(t.torn_down("P", "x", 0.0, answered=True))
    before = repr(t.under_way())
    assert t.removed(99, 1.0) == [] and t.removal_failed(99, 1.0, TransportError("x")) == []
    assert t.heard_again("nobody", 1.0) == [] and repr(t.under_way()) == before


@dataclass
class Model:
    """What every run must show, whatever the order of inputs."""

    removes: dict[int, str] = field(default_factory=dict)
    removed: set[int] = field(default_factory=set)
    gone: list[str] = field(default_factory=list)
    held: set[str] = field(default_factory=set)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["down", "down-silent", "removed", "failed", "tick", "heard", "nothing", "closing"]),
            st.sampled_from(["P", "Q"]),
            st.integers(0, 5),
            st.floats(0.0, 200.0),
        ),
        max_size=40,
    )
)
def test_any_order_of_inputs_keeps_the_promises(steps: list[tuple[str, str, int, float]]) -> None:
    t, model, now = Teardowns(GRACE, HOLD, LEASE), Model(), 0.0
    for kind, peer, pick, step in steps:
        now += step
        numbers = sorted(model.removes)
        number = numbers[pick % len(numbers)] if numbers else pick
        if kind.startswith("down"):
            actions = t.torn_down(peer, kind, now, answered=kind == "down")
        elif kind == "removed":
            actions = t.removed(number, now)
        elif kind == "failed":
            actions = t.removal_failed(number, now, TransportError("x"))
        elif kind == "tick":
            actions = t.tick(now)
        elif kind == "heard":
            actions = t.heard_again(peer, now)
        elif kind == "nothing":
            actions = t.nothing_held(peer, now)
            assert not [r for r in t.under_way() if r.peer == peer and r.phase is Phase.HOLDING]
            model.held.discard(peer)  # nothing of it was quarantined
        else:
            t.closing()
            actions = []
        for action in actions:
            if isinstance(action, RemovePeer):
                assert action.number not in model.removes or model.removes[action.number] == action.peer
                model.removes[action.number] = action.peer
            elif isinstance(action, PeerGone):
                model.gone.append(action.peer)
                if action.unfenced:
                    model.held.add(action.peer)
            elif isinstance(action, PeerFenced):
                assert action.peer in model.held  # only what was kept unfenced is fenced
                model.held.discard(action.peer)
        if kind == "removed" and actions:
            model.removed.add(number)
        deadline = t.next_deadline()
        if kind == "tick":  # nothing that was due is left due
            assert deadline is None or deadline > now
        for record in t.under_way():
            assert record.phase is not Phase.ENDED
            cooling = record.phase in (Phase.REMOVING, Phase.BACKING_OFF, Phase.GRACE) and (
                record.grace > 0 or record.failures
            )
            if cooling:
                assert t.cooling_until(record.peer) is not None
    # every peer lost had a removal asked for first; nothing is lost twice per teardown
    assert set(model.gone) <= set(model.removes.values())
    assert len(model.gone) <= len(model.removes)


def test_the_report_says_each_phase_and_when_the_last_held_block_goes_back() -> None:
    t = Teardowns(GRACE, HOLD, LEASE)
    silent = removal(t.torn_down("P", "silent", 100.0, answered=False))
    answered = removal(t.torn_down("Q", "goodbye", 100.0, answered=True))
    report = t.report(100.0)
    assert report.by_phase == {"removing": 2} and report.release_in == 0.0  # no removal returned yet
    t.removed(answered.number, 100.0)
    assert t.report(101.0).release_in == GRACE - 1.0  # Q's blocks go back when its grace ends
    t.removed(silent.number, 101.0)
    report = t.report(102.0)
    assert report.by_phase == {"grace": 2} and report.release_in == 101.0 + GRACE + HOLD - 102.0
    t.tick(106.0)
    report = t.report(106.0)
    assert report.by_phase == {"holding": 1} and report.release_in == HOLD
    t.heard_again("P", 110.0)  # back: the hold ends once a retransmitted segment had its chance
    assert t.report(110.0).release_in == GRACE + LEASE + 10.0
    t.tick(155.0)
    assert t.report(155.0) == t.report(0.0) and t.report(155.0).by_phase == {}
