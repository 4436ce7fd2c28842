"""A peer whose process dies is noticed when its connection drops, not a lease later.

The ZeroMQ DEALER to a peer reports `EVENT_DISCONNECTED` as soon as the peer's kernel closes the
connection; the peer is then *suspect* and counts as lost unless the connection comes back (or
the peer speaks) within `suspect_timeout`.  The lease stays the fallback for a peer that falls
silent with its connection up.  Leases here are 600 s, so only the fast path can fail a
transfer within these tests' waits.
"""

from __future__ import annotations

import asyncio

import pytest

from kvflow.control.auth import Secret
from kvflow.control.zeromq import ZmqControl
from kvflow.layout import fingerprint
from kvflow.protocol.association import Associations
from kvflow.protocol.messages import Goodbye, Heartbeat
from kvflow.protocol.peer_actions import SendControl, TearDown
from kvflow.protocol.state import Outcome
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.transports.loopback import LoopbackFabric
from kvflow_tools.testing import SMALL_SPEC, KVBuffers
from tests.handshakes import hello, receive
from tests.peer_processes import TRANSPORTS, kill_prefill_after_registration, start_pair
from tests.waiting import eventually

SECRET = Secret(b"a shared secret of some length")
LONG_LEASE = EngineConfig(transfer_timeout=600.0, drain_timeout=1.0, lease=600.0, suspect_timeout=0.5)


def associated(*peers: str) -> Associations:
    assoc = Associations("D", fingerprint(SMALL_SPEC), lease=600.0, interval=100.0, confirm=1.0)
    for peer in peers:
        receive(assoc, peer, 1, hello(peer), 0.0)
    return assoc


def test_a_dropped_link_makes_the_peer_lost_after_the_confirmation_delay() -> None:
    assoc = associated("P", "Q")
    assert assoc.link_changed("P", False, 10.0) == []
    assert assoc.liveness.next_deadline() == 11.0
    assert assoc.tick(10.9) == []
    why = "its connection dropped and did not come back within 1.0s"
    assert assoc.tick(11.0) == [SendControl("P", Goodbye(why)), TearDown("P", why, answered=True)]
    assert assoc.peers() == ["Q"]


def test_a_link_back_or_a_message_clears_the_suspicion() -> None:
    assoc = associated("P", "Q")
    assoc.link_changed("P", False, 10.0)
    assoc.link_changed("P", True, 10.5)
    assoc.link_changed("Q", False, 10.0)
    assoc.receive("Q", 1, Heartbeat(), 10.2)
    assert assoc.tick(20.0) == [] and assoc.peers() == ["P", "Q"]
    assoc.link_changed("P", False, 30.0)
    assoc.link_changed("P", False, 30.9)  # a second drop does not push the confirmation out
    assert [type(a) for a in assoc.tick(31.0)] == [SendControl, TearDown]


def test_a_dropped_link_to_a_peer_not_associated_changes_nothing() -> None:
    assoc = associated("P")
    assert assoc.link_changed("nobody", False, 1.0) == [] and assoc.liveness.next_deadline() == 100.0
    assoc.receive("P", 1, Goodbye("bye"), 2.0)
    assert assoc.link_changed("P", False, 3.0) == [] and assoc.liveness.next_deadline() is None


@pytest.mark.asyncio
async def test_the_channel_reports_a_link_going_down_and_coming_back() -> None:
    a = ZmqControl("A", secret=SECRET)
    b = ZmqControl("B", secret=SECRET)
    links: list[tuple[str, bool]] = []
    a.set_link_listener(lambda peer, up: links.append((peer, up)))
    loop = asyncio.get_running_loop()
    a.start(loop, lambda sender, incarnation, message: None)
    b.start(loop, lambda sender, incarnation, message: None)
    address = b.address
    try:
        a.add_route("B", address)
        a.send("B", Goodbye("hello"))
        await eventually(lambda: links == [("B", True)], "A's DEALER connects to B")
        b.close()  # B's process "dies": its socket closes
        await eventually(lambda: links[-1:] == [("B", False)], "A sees the connection drop")
        b = ZmqControl("B", address, secret=SECRET)  # B is back, at the same address
        b.start(loop, lambda sender, incarnation, message: None)
        await eventually(lambda: links[-1:] == [("B", True)], "A's DEALER reconnects")
    finally:
        a.close()
        b.close()


async def zmq_pair(config: EngineConfig) -> tuple[LoopbackFabric, dict[str, KVBuffers], ZmqControl, Engine, Engine]:
    """P and D over authenticated ZeroMQ on one loopback fabric, started: (fabric, their KV,
    P's control channel, P, D)."""
    fabric = LoopbackFabric()
    kv = {name: KVBuffers(SMALL_SPEC, 8) for name in "PD"}
    p_control = ZmqControl("P", secret=SECRET)
    p = Engine("P", kv["P"].layout, fabric.endpoint("P"), p_control, config=config)
    d = Engine("D", kv["D"].layout, fabric.endpoint("D"), ZmqControl("D", secret=SECRET), config=config)
    await p.start()
    await d.start()
    return fabric, kv, p_control, p, d


@pytest.mark.asyncio
async def test_a_peer_whose_channel_dies_fails_its_transfers_long_before_the_lease() -> None:
    fabric, kv, p_control, p, d = await zmq_pair(LONG_LEASE)
    try:
        await d.connect("P", p_control.address, timeout=5)
        waiting = await d.expect("r", 1, peer="P", block_ids=[1, 2])
        await eventually(lambda: bool(p.core.live()), "P has D's registration")
        p_control.close()  # P's process is gone as far as D can tell: no goodbye, sockets closed
        result = await waiting.wait(30)
        assert result.outcome is Outcome.FAILED and "lost" in result.reason
        assert d.peers() == [] and d.core.ledger.held_blocks == 0 and d.crashed == []
    finally:
        await d.aclose()
        await p.aclose(drain_timeout=0.1)
        fabric.close()


@pytest.mark.asyncio
async def test_a_peer_restarted_at_the_same_address_is_noticed_at_the_first_frame_not_at_the_lease() -> None:
    # P's run ends without a goodbye and a new run binds the same port at once, so D's
    # connection comes back before D suspects anything.  The new run refuses D's frames for the
    # old one and says so: D ends that association (and its transfers) at once and associates
    # with the new run.  Lease and suspicion are 600 s here: nothing else can end it in time.
    patient = EngineConfig(transfer_timeout=600.0, drain_timeout=1.0, lease=600.0, suspect_timeout=600.0)
    fabric, kv, first, p, d = await zmq_pair(patient)
    again: Engine | None = None
    try:
        await d.connect("P", first.address, timeout=5)
        address = first.address
        first.close()  # the run is gone: no goodbye
        fabric._endpoints.pop("P").close()
        again = Engine("P", kv["P"].layout, fabric.endpoint("P"), ZmqControl("P", bind=address, secret=SECRET))
        await again.start()
        waiting = await d.expect("r", 1, peer="P", block_ids=[1, 2])  # its registration goes to the new run
        result = await waiting.wait(20)
        assert result.outcome is Outcome.FAILED and "a later run of it says: restarted" in result.reason
        await d.connect("P", address, timeout=5)  # and D associates with the new run
        kv["P"].fill([4], seed=2)
        new = await d.expect("s", 1, peer="P", block_ids=[3])
        await again.kv_ready("s", 1, block_ids=[4])
        assert (await new.wait(10)).ok and d.crashed == [] and again.crashed == []
    finally:
        await d.aclose()
        if again is not None:
            await again.aclose()
        await p.aclose(drain_timeout=0.1)
        fabric.close()


@pytest.mark.parametrize("transport", ["shm", "nixl-direct"])
def test_a_killed_prefill_process_fails_the_decode_transfer_within_a_second_not_a_lease(
    prefix: str, transport: str
) -> None:
    p, d = start_pair(prefix, "--lease", "600", "--ttl", "600", *TRANSPORTS[transport])
    try:
        result = kill_prefill_after_registration(p, d, timeout=30)
        assert result["outcome"] == "failed" and "lost" in result["reason"]
        stats = d.ask("stats", cmd="stats")
        assert stats["held_blocks"] == 0 and stats["peers"] == [] and stats["crashed"] == 0
    finally:
        d.close()
        p.close()
