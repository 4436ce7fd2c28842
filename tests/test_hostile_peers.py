"""Peers that hold the secret and still send what they should not: none of it crashes an engine.

Each test reproduces one way a peer's messages used to end in `Engine.crashed` (after which
every call raises `EngineCrashed`) or change a live association: it must be refused, counted,
and leave everything else as it was.
"""

from __future__ import annotations

import pytest

from kvflow.control.zeromq import ZmqControl
from kvflow.errors import HandshakeTimeout, PeerProtocolError
from kvflow.layout import fingerprint
from kvflow.protocol.association import Associations
from kvflow.protocol.messages import Hello
from kvflow.protocol.peer_actions import AddTransportPeer, HandshakeSettled, Refused, SendHello, TearDown
from kvflow.runtime.engine import Engine
from kvflow.transports.loopback import LoopbackFabric
from kvflow_tools.testing import SMALL_SPEC, EnginePair, KVBuffers
from tests.handshakes import kept
from tests.hostile import CONFIG, LAYOUT, SECRET, Zmq, hello, signed
from tests.waiting import eventually


async def a_real_peer_still_associates(engine: Zmq) -> None:
    kv = KVBuffers(SMALL_SPEC, 16)
    d = Engine("D", kv.layout, engine.fabric.endpoint("D"), ZmqControl("D", secret=SECRET), config=CONFIG)
    await d.start()
    try:
        await d.connect("P", engine.p.control.address, timeout=5)
        assert "D" in engine.p.peers()
    finally:
        await d.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("address", ["bogus://nowhere", ""], ids=["unconnectable", "none"])
async def test_a_hello_whose_answer_cannot_be_sent_is_refused_not_a_crash(zmq_p: Zmq, address: str) -> None:
    engine = zmq_p
    engine.fabric.endpoint("M")  # its transport metadata is good: only the answer fails
    sock = engine.dealer("M")
    sock.send_multipart(signed("M", "P", hello("M", address)))
    await eventually(lambda: engine.p.stats()["peers_refused"] == 1 or bool(engine.p.crashed), "P decides on M")
    assert engine.p.crashed == [] and engine.p.peers() == []
    assert engine.p.stats()["sends_failed"] == 1
    await a_real_peer_still_associates(engine)


@pytest.mark.asyncio
async def test_more_hellos_than_sockets_are_refused_beyond_the_peer_limit(zmq_p: Zmq) -> None:
    engine = zmq_p
    port = engine.sink()
    count = 1100  # more than a ZeroMQ context's default 1023 sockets
    for n in range(count):
        name = f"m{n}"
        engine.fabric.endpoint(name)
        engine.dealer(name).send_multipart(signed(name, "P", hello(name, f"tcp://127.0.0.1:{port}")))
    stats = engine.p.stats
    await eventually(
        lambda: stats()["peers_refused"] + len(engine.p.peers()) == count or bool(engine.p.crashed),
        "P decides on every Hello",
        timeout=60,
    )
    assert engine.p.crashed == []
    assert len(engine.p.peers()) == CONFIG.max_peers and stats()["peers_refused"] == count - CONFIG.max_peers


@pytest.mark.asyncio
async def test_refused_names_do_not_use_up_sockets_and_a_real_peer_still_connects(zmq_p: Zmq) -> None:
    engine = zmq_p
    port = engine.sink()
    control = engine.p.control
    assert isinstance(control, ZmqControl)
    count = 1100  # more than a ZeroMQ context's default 1023 sockets
    for n in range(count):
        name = f"m{n}"
        impostor = hello(name, f"tcp://127.0.0.1:{port}")
        impostor = Hello(
            f"x{n}", impostor.fingerprint, LAYOUT, impostor.transport_metadata, False, impostor.control_address
        )
        engine.dealer(name).send_multipart(signed(name, "P", impostor))  # refused with a Reject, sent
    await eventually(
        lambda: engine.p.stats()["peers_refused"] == count or bool(engine.p.crashed), "P refuses every name", timeout=60
    )
    assert engine.p.crashed == [] and engine.p.peers() == []
    assert control.connections == 0 and control.counters["connections_forgotten"] == count
    await a_real_peer_still_associates(engine)


@pytest.mark.asyncio
async def test_connects_nobody_answers_leave_no_connection_open(zmq_p: Zmq) -> None:
    # Each request naming a made-up P made D open a connection that stayed after its handshake
    # ran out: some 340 of them filled the ZeroMQ context ("Too many open files").
    engine = zmq_p
    for n in range(40):
        with pytest.raises(HandshakeTimeout):
            await engine.p.connect(f"ghost{n}", "tcp://127.0.0.1:9", timeout=0.01)
    control = engine.p.control
    assert isinstance(control, ZmqControl) and control.connections == 0 and engine.p.peers() == []
    await a_real_peer_still_associates(engine)


@pytest.mark.asyncio
async def test_a_replayed_hello_of_an_earlier_run_changes_nothing() -> None:
    pair = await EnginePair(LoopbackFabric(), config=CONFIG).start()
    try:
        live = pair.p.control.incarnation
        assert kept(pair.d.assoc, "incarnation") == {"P": live}
        delivered = pair.hub.delivered
        pair.hub.route("P", live - 1, "D", hello("P", ""))  # what P's earlier run once sent
        await eventually(lambda: pair.hub.delivered > delivered, "D gets the replayed Hello")
        assert kept(pair.d.assoc, "incarnation") == {"P": live} and pair.d.crashed == []
        assert pair.d.stats()["peers_refused"] == 1
        pair.p_kv.fill([4], seed=1)
        waiting = await pair.d.expect("r", 1, peer="P", block_ids=[2])
        await pair.p.kv_ready("r", 1, block_ids=[4])
        assert (await waiting.wait(5)).ok
    finally:
        await pair.close()


# ---------------------------------------------------------------- the decisions, without I/O


def test_an_unsent_answer_ends_the_association_it_would_have_completed() -> None:
    peers = Associations("P", fingerprint(SMALL_SPEC), lease=6.0, interval=1.0)
    (add,) = peers.receive("M", 1, hello("M", ""), 0.0)
    assert isinstance(add, AddTransportPeer)
    assert peers.transport_peer_added("M", add.pending, 0.0) == [
        SendHello("M", reply=True, associating=True, association=1)
    ]
    error = PeerProtocolError("no route")
    assert peers.hello_unsent("M", error) == [
        Refused("M", error),
        TearDown("M", "cannot answer its hello: no route"),
        HandshakeSettled("M", error),
    ]
    assert peers.peers() == [] and peers.liveness.next_deadline() is None


def test_beyond_the_limit_hellos_and_connects_are_refused_without_an_answer() -> None:
    peers = Associations("P", fingerprint(SMALL_SPEC), lease=6.0, interval=1.0, max_peers=1)
    (add,) = peers.receive("A", 1, hello("A", ""), 0.0)
    assert isinstance(add, AddTransportPeer)
    peers.transport_peer_added("A", add.pending, 0.0)
    refused = peers.receive("B", 1, hello("B", ""), 0.0)
    assert [type(a) for a in refused] == [Refused, HandshakeSettled]  # no Reject: no socket spent on B
    assert "limit of 1 peers" in str(refused[0])
    assert [type(a) for a in peers.connect("C", "")][-1] is HandshakeSettled
    assert [type(a) for a in peers.receive("A", 2, hello("A", ""), 0.0)][-1] is AddTransportPeer  # A may restart


def test_a_hello_of_an_earlier_run_is_refused_without_touching_the_association() -> None:
    peers = Associations("P", fingerprint(SMALL_SPEC), lease=6.0, interval=1.0)
    (add,) = peers.receive("A", 5, hello("A", ""), 0.0)
    assert isinstance(add, AddTransportPeer)
    peers.transport_peer_added("A", add.pending, 0.0)
    assert [type(a) for a in peers.receive("A", 4, hello("A", ""), 1.0)] == [Refused]
    assert kept(peers, "incarnation") == {"A": 5}
