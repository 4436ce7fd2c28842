"""The `Endpoint`: one engine's pure state, driven here by a pure pair harness with no I/O.

Two endpoints, P and D, are wired by a `Wire` that performs effects as a perfect runtime would
(messages delivered at once, routes and transport peers accepted, removals done, a WRITE landing
as soon as it is posted), so that what is checked is the coordination the endpoint does between
its transfer core and its associations: a handshake connects the transfers waiting for the peer,
a message the channel refuses fails only its transfer while an unreachable peer is torn down, a
resolved D transfer is delivered when the consumer takes blocks at once, a teardown's removal
fails the peer's transfers, heartbeats name at most what one frame may carry, and the one
deadline is the earliest of the core's and the associations'.
"""

from __future__ import annotations

from collections import deque

import pytest

from kvflow.errors import KVFlowError, PeerUnknown, PeerUnreachable, UnsendableMessage
from kvflow.layout import fingerprint, layout_to_wire
from kvflow.protocol.actions import ReleaseBlocks, Resolve, SendMessage, SubmitOp
from kvflow.protocol.association import Associations
from kvflow.protocol.core import CoreConfig, TransferCore
from kvflow.protocol.endpoint import Effect, Endpoint
from kvflow.protocol.messages import MAX_HEARTBEAT_KEYS, FirstToken, Heartbeat, Hello, Registration, transfer_key
from kvflow.protocol.peer_actions import (
    AddRoute,
    AddTransportPeer,
    AnswerUnassociated,
    SendControl,
    SendHello,
    TearDown,
    TokenArrived,
    UnknownSender,
)
from kvflow.protocol.requests import Expect, KvReady
from kvflow.protocol.state import Mode, Outcome, Role
from kvflow.protocol.teardown import PeerGone, RemovePeer
from kvflow_tools.testing import SMALL_SPEC, KVBuffers

LAYOUT = KVBuffers(SMALL_SPEC, 64).layout


def endpoint(name: str, *, auto_deliver: bool = True) -> Endpoint:
    core = TransferCore(name, SMALL_SPEC.num_layers, CoreConfig(max_peer_transfers=10_000, max_unstarted=10_000))
    assoc = Associations(name, fingerprint(SMALL_SPEC), lease=6.0, interval=1.0)
    return Endpoint(core, assoc, LAYOUT, auto_deliver=auto_deliver)


def expect(d: Endpoint, tid: str, *, peer: str = "P", block: int = 1, deadline: float = 10.0) -> list[Effect]:
    """D expects one push batch of one block from `peer`."""
    key, mode = transfer_key(tid, 1), Mode.PUSH
    return d.expect(
        Expect(
            key, peer=peer, mode=mode, block_ids=[block], expected_batches=1, first_position=0, share="", layers=None
        ),
        now=0.0,
        deadline=deadline,
    )


class Wire:
    """P and D, with every effect performed at once; `seen` keeps each side's effects in order."""

    def __init__(self, *, auto_deliver: bool = True, refuse: type[KVFlowError] | None = None) -> None:
        self.ends = {"P": endpoint("P", auto_deliver=auto_deliver), "D": endpoint("D", auto_deliver=auto_deliver)}
        self.seen: dict[str, list[Effect]] = {"P": [], "D": []}
        self.now = 0.0
        self.refuse = refuse  # what D's channel raises for its next SendMessage (then it sends again)
        self._work: deque[tuple[str, list[Effect]]] = deque()

    def feed(self, name: str, effects: list[Effect]) -> None:
        self._work.append((name, effects))
        while self._work:
            side, batch = self._work.popleft()
            queue = deque(batch)
            while queue:
                effect = queue.popleft()
                self.seen[side].append(effect)
                queue.extendleft(reversed(self._perform(side, effect)))

    def _perform(self, side: str, effect: Effect) -> list[Effect]:
        end, other = self.ends[side], "D" if side == "P" else "P"
        if isinstance(effect, SendMessage):
            if side == "D" and self.refuse is not None:
                error, self.refuse = self.refuse(f"refused {type(effect.message).__name__}"), None
                return end.send_failed(effect.peer, effect.message, error, self.now)
            self._work.append((other, self.ends[other].receive(side, 1, effect.message, self.now)))
        elif isinstance(effect, SendControl):
            self._work.append((other, self.ends[other].receive(side, 1, effect.message, self.now)))
        elif isinstance(effect, SendHello):
            hello = Hello(side, end.fingerprint, layout_to_wire(LAYOUT), side.encode(), effect.reply, "", 1)
            self._work.append((other, self.ends[other].receive(side, 1, hello, self.now)))
            return end.hello_sent(effect.peer, self.now) if effect.associating else []
        elif isinstance(effect, AddRoute) and effect.pending is not None:
            return end.route_added(effect.peer, effect.pending, self.now)
        elif isinstance(effect, AddTransportPeer):
            return end.transport_peer_added(effect.peer, effect.pending, self.now)
        elif isinstance(effect, RemovePeer):
            return end.removed(effect.number, self.now)
        elif isinstance(effect, SubmitOp):  # posted and landed at once
            self._work.append((other, self.ends[other].notification(side, effect.notification, self.now, None)))
            return [*end.op_submitted(effect.op_id, self.now), *end.op_finished(effect.op_id, self.now)]
        return []

    def resolved(self, side: str) -> list[Resolve]:
        return [e for e in self.seen[side] if isinstance(e, Resolve)]

    def connect(self) -> None:
        self.feed("D", self.ends["D"].connect("P", "", self.now))
        assert self.ends["D"].peers() == ["P"] and self.ends["P"].peers() == ["D"]

    def push(self, tid: str) -> None:
        p, key = self.ends["P"], transfer_key(tid, 1)
        self.feed("D", expect(self.ends["D"], tid))
        ready = p.kv_ready(
            KvReady(key, block_ids=[2], final=True, first_position=0, layers=None, mode=Mode.PUSH, peer="D"),
            now=self.now,
            deadline=10.0,
        )
        self.feed("P", ready)


def test_a_push_between_two_endpoints_succeeds_and_every_block_goes_back() -> None:
    wire = Wire()
    wire.connect()
    wire.push("t")
    assert [(r.role, r.outcome) for r in wire.resolved("D")] == [(Role.DECODE, Outcome.SUCCEEDED)]
    assert [(r.role, r.outcome) for r in wire.resolved("P")] == [(Role.PREFILL, Outcome.SUCCEEDED)]
    # delivered on its own (the consumer takes blocks at once): D's blocks go back after the Resolve
    d_effects = wire.seen["D"]
    resolve = next(i for i, e in enumerate(d_effects) if isinstance(e, Resolve))
    assert any(isinstance(e, ReleaseBlocks) for e in d_effects[resolve + 1 :])
    assert not wire.ends["D"].live() and not wire.ends["P"].live()


def test_without_auto_delivery_d_keeps_its_blocks_until_the_consumer_takes_them() -> None:
    wire = Wire(auto_deliver=False)
    wire.connect()
    wire.push("t")
    assert not any(isinstance(e, ReleaseBlocks) for e in wire.seen["D"])
    assert len(wire.ends["D"].live()) == 1
    wire.feed("D", wire.ends["D"].delivered(transfer_key("t", 1), wire.now))
    assert any(isinstance(e, ReleaseBlocks) for e in wire.seen["D"]) and not wire.ends["D"].live()


def test_a_registration_waiting_for_its_peer_goes_out_when_the_handshake_completes() -> None:
    wire = Wire()
    d, key = wire.ends["D"], transfer_key("early", 1)
    effects = expect(d, key.transfer_id, peer="P", block=3, deadline=10.0)
    assert not any(isinstance(e, SendMessage) for e in effects)  # not connected: nothing to send yet
    wire.feed("D", effects)
    wire.connect()
    sent = [e.message for e in wire.seen["D"] if isinstance(e, SendMessage)]
    assert isinstance(sent[0], Registration) and sent[0].key == key and sent[0].block_ids == (3,)


def test_a_message_the_channel_refuses_fails_its_transfer_and_keeps_the_peer() -> None:
    wire = Wire(refuse=UnsendableMessage)
    wire.connect()
    wire.push("t")  # D's Registration refused: D gives its transfer up, and P's ends with it
    assert [(r.outcome, r.reason) for r in wire.resolved("D")] == [
        (Outcome.ABORTED, "its Registration: refused Registration")
    ]
    assert [r.outcome for r in wire.resolved("P")] == [Outcome.ABORTED]
    assert wire.ends["D"].peers() == ["P"]
    assert not any(isinstance(e, TearDown) for e in wire.seen["D"])


def test_a_peer_that_cannot_be_reached_is_torn_down_and_its_transfers_fail() -> None:
    wire = Wire(refuse=PeerUnreachable)
    wire.connect()
    wire.push("t")  # D's Registration cannot reach P
    d_effects = wire.seen["D"]
    assert any(isinstance(e, TearDown) and e.peer == "P" for e in d_effects)
    assert any(isinstance(e, PeerGone) and e.peer == "P" for e in d_effects)  # removed, then gone
    assert wire.ends["D"].peers() == []
    assert [(r.role, r.outcome) for r in wire.resolved("D")] == [(Role.DECODE, Outcome.FAILED)]


def test_heartbeats_name_at_most_one_frames_worth_of_transfers_each() -> None:
    wire = Wire()
    wire.connect()
    d = wire.ends["D"]
    count = MAX_HEARTBEAT_KEYS + 5
    for i in range(count):
        key = transfer_key(f"w{i}", 1)
        expect(d, key.transfer_id, peer="P", block=i, deadline=100.0)
    effects = d.timer(2.0)  # a heartbeat is due (interval 1 s)
    beats = [e.message for e in effects if isinstance(e, SendControl) and isinstance(e.message, Heartbeat)]
    assert [len(b.keys) for b in beats] == [MAX_HEARTBEAT_KEYS, 5]


def test_the_next_deadline_is_the_earliest_of_the_transfers_and_the_peers() -> None:
    lonely = endpoint("D")
    assert lonely.next_deadline() is None
    key = transfer_key("t", 1)
    expect(lonely, key.transfer_id, peer="P", block=1, deadline=7.5)
    assert lonely.next_deadline() == 7.5  # no peer: the transfer's deadline
    wire = Wire()
    wire.connect()
    assert wire.ends["D"].next_deadline() == 1.0  # a peer: its first heartbeat comes first


def test_fences_not_confirmed_tear_down_every_peer_waited_on_and_every_associated_one() -> None:
    wire = Wire()
    wire.connect()  # D is associated with P
    d = wire.ends["D"]
    key = transfer_key("stuck", 1)
    expect(d, key.transfer_id, peer="Q", block=9, deadline=100.0)
    effects = d.tear_down_unfenced("engine closing", 0.0)
    torn = [(e.peer, e.reason) for e in effects if isinstance(e, TearDown)]
    assert torn == [("P", "engine closing: fence not confirmed"), ("Q", "engine closing: fence not confirmed")]


def test_a_first_token_from_an_associated_peer_goes_to_the_host_and_not_to_the_core() -> None:
    wire = Wire()
    wire.connect()
    key = transfer_key("t", 1)
    wire.feed("P", wire.ends["P"].first_token("D", key, 42))
    arrived = [e for e in wire.seen["D"] if isinstance(e, TokenArrived)]
    assert arrived == [TokenArrived("P", FirstToken(key, 42))]
    assert wire.ends["D"].live_count() == 0  # no transfer was started by it
    # before D registered, and after: the core never sees it (D's transfer is untouched)
    wire.feed("D", expect(wire.ends["D"], "t"))
    wire.feed("P", wire.ends["P"].first_token("D", key, 43))
    assert [e.message.token for e in wire.seen["D"] if isinstance(e, TokenArrived)] == [42, 43]
    assert wire.ends["D"].machine(key, Role.DECODE).outcome is None


def test_a_first_token_from_a_stranger_is_dropped_and_one_for_a_stranger_is_refused() -> None:
    d = endpoint("D")
    effects = d.receive("X", 1, FirstToken(transfer_key("t", 1), 42), 0.0)
    assert not any(isinstance(e, TokenArrived) for e in effects)
    assert any(isinstance(e, UnknownSender | AnswerUnassociated) for e in effects)
    with pytest.raises(PeerUnknown, match="not associated"):
        d.first_token("X", transfer_key("t", 1), 42)
