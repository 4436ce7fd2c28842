"""The peer-association table (`kvflow.protocol.phases`): total, every phase reachable, and the
associations' data agreeing with the phase the table moved each peer to, after any sequence of
inputs a runtime can produce (Hellos of any run, number, address and content, messages, Rejects,
connects, lost peers, a transport that adds or refuses, answers that go out or do not)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvflow.errors import TransportError
from kvflow.layout import fingerprint
from kvflow.protocol.association import Associations
from kvflow.protocol.messages import ControlMessage, Goodbye, Heartbeat, Hello, Ready, Reject, TransferKey
from kvflow.protocol.peer_actions import (
    AddRoute,
    AddTransportPeer,
    AssociationAction,
    PendingHello,
    Redeliver,
    SendHello,
    TearDown,
)
from kvflow.protocol.peer_record import PeerRecord
from kvflow.protocol.phases import LIVE, TABLE, Do, Event, Phase, relate_hello, relate_message, relate_reject
from kvflow.protocol.teardown import RemovePeer
from kvflow_tools.diagrams import reachable_from
from kvflow_tools.testing import SMALL_SPEC
from tests.handshakes import associations, hello, kept, receive

PEERS = ("P", "Q", "R")
REFUSED_ADDRESS = "tcp://127.0.0.1:7999"  # the channel refuses a route to it


def test_the_table_is_total_with_at_most_one_step_a_row_and_every_phase_is_reachable() -> None:
    assert set(TABLE) == {(phase, event) for phase in Phase for event in Event}
    assert all(len(steps) <= 1 for _, steps in TABLE.values())
    assert reachable_from(TABLE, Phase.NONE) == set(Phase)
    assert {step for _, steps in TABLE.values() for step in steps} == set(Do)  # no step is dead


def test_a_hello_is_new_with_no_run_in_place_and_otherwise_related_to_it() -> None:
    assert relate_hello(None, None, 5, True, 1) is Event.NEW
    assert relate_hello(5, 1, 5, True, 9) is Event.ANSWER
    assert relate_hello(5, 1, 5, False, 1) is Event.RETRY
    assert relate_hello(5, None, 5, False, 1) is Event.NEW  # being added: nothing live to retry
    assert relate_hello(5, 1, 4, False, 1) is Event.OLDER_RUN
    assert relate_hello(5, 1, 6, True, 1) is Event.NEW  # a later run's answer: a new association
    assert relate_message(5, 5, goodbye=False) is Event.MESSAGE
    assert relate_message(5, 5, goodbye=True) is Event.GOODBYE
    assert relate_message(5, 6, goodbye=True) is Event.STRAY
    assert relate_message(None, 1, goodbye=False) is Event.UNASSOCIATED  # answered: see below
    assert relate_message(None, 1, goodbye=True) is Event.STRAY  # never answered: no ping-pong
    assert relate_reject(5, 6) is Event.REJECT_LATER_RUN
    assert relate_reject(5, 5) is Event.REJECT and relate_reject(None, 9) is Event.REJECT


@given(
    st.none() | st.integers(0, 2**64 - 1),
    st.none() | st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.booleans(),
    st.integers(0, 2**64 - 1),
)
def test_relating_any_hello_or_message_names_one_event(
    run: int | None, association: int | None, incarnation: int, reply: bool, number: int
) -> None:
    assert relate_hello(run, association, incarnation, reply, number) in Event
    assert relate_message(run, incarnation, reply) in (Event.MESSAGE, Event.GOODBYE, Event.STRAY, Event.UNASSOCIATED)
    assert relate_reject(run, incarnation) in (Event.REJECT, Event.REJECT_LATER_RUN)


@pytest.mark.parametrize("accepted", [True, False])
def test_a_peer_torn_down_while_the_transport_adds_it_is_given_up_and_the_answer_changes_nothing(
    accepted: bool,
) -> None:
    assoc = associations()
    (add,) = assoc.receive("P", 1, hello("P"), 0.0)
    assert isinstance(add, AddTransportPeer) and assoc.phase("P") is Phase.ADDING
    assert [type(a) for a in assoc.tear_down("P", "lost here")] == [TearDown]
    assert assoc.phase("P") is Phase.NONE and kept(assoc, "adding") == {}
    if accepted:
        late = assoc.transport_peer_added("P", add.pending, 1.0)
    else:
        late = assoc.pending_refused("P", add.pending, TransportError("no"))
    assert late == [] and assoc.phase("P") is Phase.NONE and assoc.peers() == [] and kept(assoc, "given_up") == {}


def test_the_transports_answer_about_an_addition_never_under_way_changes_nothing() -> None:
    assoc = associations()
    (add,) = assoc.receive("P", 1, hello("P"), 0.0)
    assert isinstance(add, AddTransportPeer)
    other = PendingHello(2, hello("P"), add.pending.layout)  # not the addition under way
    assert assoc.transport_peer_added("P", other, 1.0) == []
    assert assoc.phase("P") is Phase.ADDING and assoc.peers() == [] and kept(assoc, "adding") == {"P": add.pending}
    assert [type(a) for a in assoc.transport_peer_added("P", add.pending, 1.0)] == [SendHello]


def test_two_additions_given_up_before_the_transport_answered_either_stay_given_up() -> None:
    """The runtime's peer cools until its removal, so a second addition before the first answer
    is rare; the associations do not count on it (the state machine below found this)."""
    assoc = associations()
    additions = []
    for _ in range(2):
        (add,) = assoc.receive("Q", 1, hello("Q"), 0.0)
        assert isinstance(add, AddTransportPeer)
        additions.append(add)
        assoc.tear_down("Q", "lost here")
    assert assoc.transport_peer_added("Q", additions[0].pending, 1.0) == []
    assert assoc.pending_refused("Q", additions[1].pending, TransportError("no")) == []
    assert assoc.phase("Q") is Phase.NONE and assoc.peers() == [] and kept(assoc, "given_up") == {}


def test_a_peer_that_goes_leaves_no_record_behind() -> None:
    """Whatever way an association ends (torn down here, a Goodbye, an addition refused, given
    up and answered, an answer that cannot go out), nothing of the peer is kept afterwards."""
    assoc = associations()
    receive(assoc, "P", 1, hello("P"), 0.0)  # P's Hello associates it
    assoc.connect("Q", "tcp://127.0.0.1:7001")
    receive(assoc, "Q", 1, hello("Q", reply=True), 0.0)  # Q answers ours
    assert assoc.peers() == ["P", "Q"] and set(assoc.records) == {"P", "Q"}
    assoc.tear_down("P", "lost here")
    assert [type(a) for a in assoc.receive("Q", 1, Goodbye("bye"), 1.0)] == [TearDown]
    for peer in ("R", "S", "T"):
        (add,) = assoc.receive(peer, 1, hello(peer), 2.0)
        assert isinstance(add, AddTransportPeer)
        if peer == "R":
            assoc.pending_refused(peer, add.pending, TransportError("no"))
        elif peer == "S":
            assoc.tear_down(peer, "lost here")
            assert set(assoc.records) == {"S"}  # until the transport answers about the addition
            assert assoc.transport_peer_added(peer, add.pending, 3.0) == []
        else:
            assoc.transport_peer_added(peer, add.pending, 3.0)
            assoc.hello_unsent(peer, TransportError("unreachable"))
    assert assoc.records == {} and assoc.liveness.next_deadline() is None


class PeerPhases(RuleBasedStateMachine):
    """D's `Associations` with three peers, driven as `runtime/peering.py` drives it: a route is
    added (or refused) at once, an answering Hello is sent (or fails) at once, a torn-down peer is
    removed at once, Redeliver is fed back in order, and the transport adds a peer whenever the
    machine chooses."""

    def __init__(self) -> None:
        super().__init__()
        self.assoc = Associations("D", fingerprint(SMALL_SPEC), lease=6.0, interval=1.0, max_peers=2)
        self.now = 0.0
        self.unsendable: set[str] = set()  # peers our answering Hello cannot reach
        self.owed: list[AddTransportPeer] = []  # additions the transport has not answered yet

    def run(self, actions: list[AssociationAction]) -> None:
        queue = list(actions)
        while queue:
            action = queue.pop(0)
            more: list[AssociationAction] = []
            if isinstance(action, AddRoute) and action.pending is not None:
                pending: PendingHello = action.pending
                if action.address == REFUSED_ADDRESS:
                    more = self.assoc.pending_refused(action.peer, pending, TransportError("refused"))
                else:
                    more = self.assoc.route_added(action.peer, pending, self.now)
            elif isinstance(action, AddTransportPeer):
                self.owed.append(action)
            elif isinstance(action, SendHello) and action.associating:
                if action.peer in self.unsendable:
                    more = self.assoc.hello_unsent(action.peer, TransportError("unreachable"))
                else:
                    more = self.assoc.hello_sent(action.peer, self.now)
            elif isinstance(action, TearDown):
                more = [*self.assoc.teardowns.torn_down(action.peer, action.reason, self.now, answered=action.answered)]
            elif isinstance(action, RemovePeer):
                more = [*self.assoc.teardowns.removed(action.number, self.now)]
            elif isinstance(action, Redeliver):
                more = self.assoc.receive(action.peer, action.incarnation, action.hello, self.now)
            queue[:0] = more

    @rule(
        peer=st.sampled_from(PEERS),
        incarnation=st.integers(1, 3),
        reply=st.booleans(),
        number=st.integers(0, 2),
        address=st.sampled_from(["", "", "tcp://127.0.0.1:7001", REFUSED_ADDRESS]),
        flaw=st.sampled_from(["", "", "", "", "identity", "layout"]),
    )
    def a_hello(self, peer: str, incarnation: int, reply: bool, number: int, address: str, flaw: str) -> None:
        message = hello(peer, reply=reply, address=address, association=number)
        if flaw == "identity":
            message = Hello("X", message.fingerprint, message.layout, b"", reply, address, number)
        elif flaw == "layout":
            message = Hello(peer, {**message.fingerprint, "block_size": 999}, message.layout, b"", reply, address)
        self.run(self.assoc.receive(peer, incarnation, message, self.now))

    @rule(
        peer=st.sampled_from(PEERS),
        incarnation=st.integers(1, 3),
        kind=st.sampled_from(["heartbeat", "ready", "goodbye", "reject"]),
    )
    def a_message(self, peer: str, incarnation: int, kind: str) -> None:
        messages: dict[str, ControlMessage] = {
            "heartbeat": Heartbeat(()),
            "ready": Ready(TransferKey("t", 1), (0,)),
            "goodbye": Goodbye("bye"),
            "reject": Reject("no"),
        }
        self.run(self.assoc.receive(peer, incarnation, messages[kind], self.now))

    @rule(peer=st.sampled_from(PEERS))
    def a_connect(self, peer: str) -> None:
        self.run(self.assoc.connect(peer, f"tcp://127.0.0.1:710{PEERS.index(peer)}"))

    @rule(peer=st.sampled_from(PEERS))
    def a_tear_down(self, peer: str) -> None:
        self.run(self.assoc.tear_down(peer, "lost here"))

    @rule(seconds=st.sampled_from([0.5, 2.0, 7.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.run(self.assoc.tick(self.now))

    @rule(peer=st.sampled_from(PEERS))
    def answers_to_it_fail_or_not(self, peer: str) -> None:
        self.unsendable ^= {peer}

    @rule(data=st.data(), accept=st.booleans())
    def the_transport_answers(self, data: st.DataObject, accept: bool) -> None:
        if not self.owed:
            return
        addition = self.owed.pop(data.draw(st.integers(0, len(self.owed) - 1)))
        if accept:
            self.run(self.assoc.transport_peer_added(addition.peer, addition.pending, self.now))
        else:
            self.run(self.assoc.pending_refused(addition.peer, addition.pending, TransportError("no")))

    @invariant()
    def each_record_keeps_the_data_of_the_phase_the_table_moved_the_peer_to(self) -> None:
        assoc, records = self.assoc, self.assoc.records
        assert set(records) <= set(PEERS)
        assert all(record != PeerRecord() for record in records.values())  # none kept for nothing
        for peer in PEERS:
            record = records.get(peer, PeerRecord())
            phase = assoc.phase(peer)
            assert phase is record.phase, peer
            assert (phase is Phase.ADDING) == (record.adding is not None), (peer, phase)
            live = phase in LIVE
            in_place = (record.layout is not None, record.incarnation is not None, record.theirs is not None)
            assert in_place == (live, live, live), peer
            assert live == (peer in assoc.liveness._heard), peer
            assert record.deferred is None or phase is Phase.ADDING, peer
            assert not record.early or phase in (Phase.ADDING, Phase.ANSWERING), peer
            assert all(given_up is not record.adding for given_up in record.given_up), peer
        in_place_or_adding = [
            p for p, record in records.items() if record.layout is not None or record.adding is not None
        ]
        assert len(in_place_or_adding) <= assoc.max_peers
        # what the bounds count agrees with the records
        assert assoc._engaged == sum(1 for record in records.values() if record.phase is not Phase.NONE)
        assert assoc._addressed == sum(1 for record in records.values() if record.address)
        assert assoc._numbers == {record.ours: peer for peer, record in records.items() if record.ours is not None}
        assert list(assoc._numbers) == sorted(assoc._numbers)


PeerPhases.TestCase.settings = settings(max_examples=500, stateful_step_count=60, deadline=None)
test_peer_phases = PeerPhases.TestCase
