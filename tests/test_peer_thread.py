"""A transport whose `add_peer` / `remove_peer` block does not stall the engine's loop.

NIXL's `add_peer` may wait up to 30 s and shared memory's `remove_peer` waits for copies and an
exclusive lock; the engine runs both on its peer thread.  Here a loopback endpoint holds them
until the test opens a gate, and meanwhile the same engine keeps moving another peer's transfer
and exchanging heartbeats.  A removed peer's transfers fail only once its removal returned.
"""

from __future__ import annotations

import asyncio
import resource
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import pytest
import pytest_asyncio

from kvflow.control.channel import LocalControlHub
from kvflow.errors import PeerProtocolError, TransportError
from kvflow.layout import Region, fingerprint
from kvflow.protocol.association import EARLY_MESSAGES_KEPT, Associations
from kvflow.protocol.core import CoreConfig
from kvflow.protocol.messages import Goodbye, Heartbeat, TransferKey
from kvflow.protocol.peer_actions import (
    AddTransportPeer,
    HandshakeSettled,
    PeerConnected,
    Redeliver,
    Refused,
    RenewLeases,
    SendHello,
    TearDown,
    UnknownSender,
)
from kvflow.protocol.state import Outcome, Role
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.transports.loopback import LoopbackFabric, LoopbackTransport
from kvflow_tools.testing import SMALL_SPEC, KVBuffers
from tests.handshakes import kept
from tests.hostile import hello
from tests.waiting import eventually

CONFIG = EngineConfig(
    core=CoreConfig(fence_timeout=1.0, retention=5.0), transfer_timeout=30.0, drain_timeout=2.0, lease=5.0
)
HOLD_AT_MOST = 10.0  # a gate nobody opens lets go by itself, so that a failing test ends


class Gate:
    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.returned = threading.Event()

    def hold(self) -> None:
        self.entered.set()
        self.opened.wait(HOLD_AT_MOST)


class GatedTransport(LoopbackTransport):
    """Loopback, except that adding or removing the peers named in `gates` waits for a gate."""

    def __init__(self, name: str, fabric: LoopbackFabric, gates: dict[tuple[str, str], Gate]) -> None:
        super().__init__(name, fabric=fabric)
        self.gates = gates
        self.unfenceable: set[str] = set()  # removing these fails, as shm's does for a stopped peer

    def add_peer(self, name: str, metadata: bytes, regions: Sequence[Region]) -> None:
        gate = self.gates.get(("add", name))
        if gate is not None:
            gate.hold()
        super().add_peer(name, metadata, regions)
        if gate is not None:
            gate.returned.set()

    def remove_peer(self, name: str) -> None:
        if name in self.unfenceable:
            raise TransportError(f"copies from {name!r} into our memory did not stop within fence_timeout")
        gate = self.gates.get(("remove", name))
        if gate is not None:
            gate.hold()
        super().remove_peer(name)
        if gate is not None:
            gate.returned.set()


@dataclass
class Trio:
    """P on a gated transport; D and E ordinary peers of it."""

    p: Engine
    d: Engine
    e: Engine
    hub: LocalControlHub
    gates: dict[tuple[str, str], Gate]
    kv: dict[str, KVBuffers]
    transport: GatedTransport
    fabric: LoopbackFabric


@pytest_asyncio.fixture
async def trio() -> AsyncIterator[Trio]:
    fabric, hub = LoopbackFabric(), LocalControlHub()
    gates: dict[tuple[str, str], Gate] = {}
    kv = {name: KVBuffers(SMALL_SPEC, 8) for name in "PDE"}
    transport = GatedTransport("P", fabric, gates)
    p = Engine("P", kv["P"].layout, transport, hub.channel("P"), config=CONFIG)
    d = Engine("D", kv["D"].layout, fabric.endpoint("D"), hub.channel("D"), config=CONFIG)
    e = Engine("E", kv["E"].layout, fabric.endpoint("E"), hub.channel("E"), config=CONFIG)
    for engine in (p, d, e):
        await engine.start()
    await d.connect("P", timeout=5)
    yield Trio(p, d, e, hub, gates, kv, transport, fabric)
    transport.unfenceable.clear()
    for gate in gates.values():
        gate.opened.set()
    for engine in (e, d, p):
        await engine.aclose()
    fabric.close()


async def d_and_p_still_move_a_transfer(trio: Trio, transfer_id: str) -> None:
    trio.kv["P"].fill([3], seed=5)
    waiting = await trio.d.expect(transfer_id, 1, peer="P", block_ids=[4])
    sending = await trio.p.kv_ready(transfer_id, 1, block_ids=[3])
    assert (await waiting.wait(5)).ok and (await sending.wait(5)).ok


async def heartbeats_flow(trio: Trio) -> None:
    trio.p.assoc.liveness.interval = trio.d.assoc.liveness.interval = 0.02
    before = trio.hub.delivered
    await eventually(lambda: trio.hub.delivered >= before + 6, "heartbeats between P and D")


@pytest.mark.asyncio
async def test_a_blocking_add_peer_leaves_the_loop_serving_other_peers(trio: Trio) -> None:
    gate = trio.gates["add", "E"] = Gate()
    connecting = asyncio.create_task(trio.e.connect("P", timeout=20))
    await eventually(gate.entered.is_set, "P's transport is adding E")
    await d_and_p_still_move_a_transfer(trio, "while-adding")
    await heartbeats_flow(trio)
    assert not gate.returned.is_set() and trio.p.peers() == ["D"]  # all that while, E's addition was held
    gate.opened.set()
    await connecting
    assert trio.p.peers() == ["D", "E"] and trio.p.crashed == []


@pytest.mark.asyncio
async def test_a_peer_being_added_counts_against_the_descriptor_reserve(
    trio: Trio, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hellos arriving together all saw the same descriptor count, none of their files open
    yet (16 names at once took a process at a limit of 256 to 6 descriptors left): with E's
    addition under way, F is refused unless a further association's worth is left too."""
    from kvflow.runtime import descriptors

    soft = 4096
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (soft, soft))
    left = descriptors.reserve_for(soft) + descriptors.PEER_DESCRIPTORS // 2  # room for one more peer, not two at once
    monkeypatch.setattr(descriptors, "open_descriptors", lambda: soft - left)
    gate = trio.gates["add", "E"] = Gate()
    connecting = asyncio.create_task(trio.e.connect("P", timeout=20))
    await eventually(gate.entered.is_set, "P's transport is adding E")
    f = Engine("F", KVBuffers(SMALL_SPEC, 8).layout, trio.fabric.endpoint("F"), trio.hub.channel("F"), config=CONFIG)
    await f.start()
    try:
        with pytest.raises(PeerProtocolError, match="for each of the 1 peers being added"):
            await f.connect("P", timeout=5)
        gate.opened.set()
        await connecting
        await f.connect("P", timeout=5)  # E's files are counted as open now: room for F again
    finally:
        gate.opened.set()
        await f.aclose()
    assert trio.p.peers() == ["D", "E", "F"] and trio.p.crashed == []


@pytest.mark.asyncio
async def test_a_blocking_remove_peer_fails_the_peers_transfers_only_once_it_returned(trio: Trio) -> None:
    await trio.e.connect("P", timeout=5)
    gate = trio.gates["remove", "E"] = Gate()
    await trio.e.expect("e", 1, peer="P", block_ids=[1])
    key = TransferKey("e", 1)
    await eventually(lambda: (key, Role.PREFILL) in {m.owner for m in trio.p.core.machines()}, "P has E's registration")
    trio.hub.route("E", trio.e.control.incarnation, "P", Goodbye("leaving"))
    await eventually(gate.entered.is_set, "P's transport is removing E")
    assert trio.p.peers() == ["D"]  # the association ended at once
    await d_and_p_still_move_a_transfer(trio, "while-removing")
    await heartbeats_flow(trio)
    assert not gate.returned.is_set()
    assert trio.p.core.machine(key, Role.PREFILL).outcome is None  # not failed while E may still land
    gate.opened.set()
    await eventually(lambda: trio.p.core.machine(key, Role.PREFILL).outcome is not None, "E's transfer ends")
    assert trio.p.core.machine(key, Role.PREFILL).outcome is Outcome.FAILED and gate.returned.is_set()
    assert trio.p.crashed == []


@pytest.mark.asyncio
async def test_a_removal_that_cannot_fence_keeps_the_blocks_and_is_retried_never_a_crash(trio: Trio) -> None:
    await trio.e.connect("P", timeout=5)
    trio.transport.unfenceable.add("E")
    waiting = await trio.p.expect("e", 1, peer="E", block_ids=[1])
    assert trio.p.stats()["held_blocks"] == 1
    trio.hub.route("E", trio.e.control.incarnation, "P", Goodbye("no message for 30s"))
    await eventually(lambda: trio.p.stats()["peer_removals_failed"] >= 3 or bool(trio.p.crashed), "removal retried")
    assert trio.p.crashed == []
    stats = trio.p.stats()
    assert stats["unfenced_peers"] == 1 and stats["held_blocks"] == 1  # E's copies may still land in block 1
    assert trio.p.core.machine(TransferKey("e", 1), Role.DECODE).outcome is None
    refused = stats["peers_refused"]
    trio.hub.route("E", trio.e.control.incarnation + 1, "P", hello("E", ""))  # E, restarted, says hello
    await eventually(lambda: trio.p.stats()["peers_refused"] == refused + 1, "P refuses the unfenced peer")
    assert trio.p.peers() == ["D"]
    await d_and_p_still_move_a_transfer(trio, "while-unfenced")
    trio.transport.unfenceable.discard("E")  # the peer's copies stop: the next retry succeeds
    result = await waiting.wait(10)
    assert result.outcome is Outcome.FAILED and result.reason == "peer E lost: it tore us down: no message for 30s"
    stats = trio.p.stats()
    assert stats["unfenced_peers"] == 0 and stats["held_blocks"] == 0 and trio.p.crashed == []


@pytest.mark.asyncio
async def test_an_engine_closed_while_a_removal_cannot_fence_keeps_the_blocks_and_says_so(
    trio: Trio, caplog: pytest.LogCaptureFixture
) -> None:
    await trio.e.connect("P", timeout=5)
    trio.transport.unfenceable.add("E")
    await trio.p.expect("e", 1, peer="E", block_ids=[1])
    trio.hub.route("E", trio.e.control.incarnation, "P", Goodbye("leaving"))
    await eventually(lambda: trio.p.stats()["peer_removals_failed"] >= 1 or bool(trio.p.crashed), "removal failed")
    await trio.p.aclose()  # no EngineCrashed: the blocks are held on purpose
    assert trio.p.crashed == [] and trio.p.stats()["held_blocks"] == 1
    assert "closed without removing peers ['E']" in caplog.text


# ---------------------------------------------------------------- the decisions, without I/O


def adding(assoc: Associations, peer: str, incarnation: int) -> AddTransportPeer:
    (add,) = assoc.receive(peer, incarnation, hello(peer, ""), 0.0)
    assert isinstance(add, AddTransportPeer) and assoc.peers() == []
    return add


def test_a_hello_arriving_while_its_sender_is_added_is_decided_once_the_transport_is_done() -> None:
    assoc = Associations("P", fingerprint(SMALL_SPEC), lease=6.0, interval=1.0)
    first = adding(assoc, "E", 1)
    assert assoc.receive("E", 2, hello("E", ""), 0.5) == []  # E started over meanwhile
    assert assoc.receive("E", 3, hello("E", ""), 0.6) == []  # only the newest is kept
    assert assoc.transport_peer_added("E", first.pending, 1.0)[-1] == Redeliver("E", 3, hello("E", ""))
    again = assoc.receive("E", 3, hello("E", ""), 1.0)
    assert [type(a) for a in again] == [TearDown, AddTransportPeer]


def test_the_answer_to_our_hello_while_its_sender_is_added_waits_for_the_addition() -> None:
    assoc = Associations("P", fingerprint(SMALL_SPEC), lease=6.0, interval=1.0)
    first = adding(assoc, "E", 1)
    assert assoc.receive("E", 1, hello("E", "", reply=True), 0.5) == []  # nothing deferred
    assert assoc.transport_peer_added("E", first.pending, 1.0) == [
        SendHello("E", reply=True, associating=True, association=1)
    ]
    assert [type(a) for a in assoc.hello_sent("E", 1.0)] == [HandshakeSettled, PeerConnected]


def test_what_a_peer_says_while_we_still_add_it_is_delivered_in_order_once_the_association_is_in_place() -> None:
    """The peer's side of the association is in place before ours when it answered our Hello (or
    our transport is slow to add it), and its first message, a pull transfer's ready say, can come
    before our transport is done: it was dropped as from an unknown peer and the transfer hung."""
    assoc = Associations("D", fingerprint(SMALL_SPEC), lease=6.0, interval=1.0)
    first = adding(assoc, "P", 1)
    key = TransferKey("t1", 1)
    assert assoc.receive("P", 1, Heartbeat((key,)), 0.5) == []  # kept, not dropped
    assert assoc.receive("P", 1, Goodbye("done"), 0.6) == []
    assert assoc.receive("P", 2, Heartbeat(()), 0.6) == [UnknownSender("P")]  # another run of P
    assert assoc.transport_peer_added("P", first.pending, 1.0) == [
        SendHello("P", reply=True, associating=True, association=1)
    ]
    decided = assoc.hello_sent("P", 1.1)
    assert decided[:3] == [HandshakeSettled("P"), PeerConnected("P", 1.1), RenewLeases("P", (key,), 1.1, 6.0)]
    assert [type(a) for a in decided[3:]] == [TearDown]  # then its goodbye, in the order it was sent
    assert assoc.peers() == [] and kept(assoc, "early") == {}


def test_early_messages_are_bounded_and_forgotten_with_a_refused_addition() -> None:
    assoc = Associations("D", fingerprint(SMALL_SPEC), lease=6.0, interval=1.0)
    first = adding(assoc, "P", 1)
    for _ in range(EARLY_MESSAGES_KEPT):
        assert assoc.receive("P", 1, Heartbeat(()), 0.5) == []
    assert assoc.receive("P", 1, Heartbeat(()), 0.5) == [UnknownSender("P")]  # one too many
    refused = assoc.pending_refused("P", first.pending, TransportError("no"))
    assert refused.count(UnknownSender("P")) == EARLY_MESSAGES_KEPT and kept(assoc, "early") == {}


def test_peers_being_added_count_toward_the_limit_and_a_refused_addition_frees_its_place() -> None:
    assoc = Associations("P", fingerprint(SMALL_SPEC), lease=6.0, interval=1.0, max_peers=1)
    first = adding(assoc, "E", 1)
    assert [type(a) for a in assoc.receive("F", 1, hello("F", ""), 0.1)] == [Refused, HandshakeSettled]
    assoc.pending_refused("E", first.pending, TransportError("no"))
    adding(assoc, "F", 1)
