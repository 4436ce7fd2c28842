"""Heartbeats, leases, goodbyes and restarts: the pure associations, then over the in-process
hub with real time."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.control import wire
from kvflow.control.channel import LocalControl
from kvflow.errors import ConfigError, HandshakeTimeout, PeerProtocolError, TransportError
from kvflow.protocol.actions import ReleaseBlocks
from kvflow.protocol.association import ATTEMPTS_KEPT, Liveness
from kvflow.protocol.core import CoreConfig, TransferCore
from kvflow.protocol.messages import MAX_HEARTBEAT_KEYS, ControlMessage, Goodbye, Heartbeat, Hello, Reject, TransferKey
from kvflow.protocol.peer_actions import (
    AddRoute,
    AddTransportPeer,
    AnswerUnassociated,
    HandshakeSettled,
    PeerConnected,
    Refused,
    RenewLeases,
    SendControl,
    SendHeartbeat,
    SendHello,
    TearDown,
    UnknownSender,
)
from kvflow.protocol.requests import KvReady
from kvflow.protocol.state import Mode, Outcome, Role
from kvflow.protocol.transfer_tables import ACTIVE
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.transports.loopback import FaultPlan, LoopbackFabric
from kvflow_tools.testing import SMALL_SPEC, EnginePair, KVBuffers, same_kv
from tests.handshakes import associations, hello, kept, receive
from tests.waiting import eventually

LEASE = EngineConfig(
    core=CoreConfig(fence_timeout=0.3, retention=5.0), transfer_timeout=0.4, lease=0.6, drain_timeout=0.5
)


def test_liveness_schedule() -> None:
    live = Liveness(lease=6.0, interval=1.0)
    live.add("p", 0.0)
    assert live.due(0.5) == [] and live.due(1.0) == ["p"] and live.due(1.5) == []
    assert live.next_deadline() == 2.0
    live.heard("p", 3.0)
    assert live.expired(8.9) == [] and live.expired(9.0) == ["p"]
    live.remove("p")
    assert live.next_deadline() is None


def test_a_peer_starting_over_is_torn_down_before_it_is_added_again() -> None:
    peers = associations()
    assert [type(a) for a in receive(peers, "P", 1, hello("P"), 0.0)] == [
        AddTransportPeer,
        SendHello,
        HandshakeSettled,
        PeerConnected,
    ]
    again = receive(peers, "P", 2, hello("P"), 1.0)
    assert [type(a) for a in again] == [TearDown, AddTransportPeer, SendHello, HandshakeSettled, PeerConnected]
    assert kept(peers, "incarnation") == {"P": 2} and peers.peers() == ["P"]
    assert peers.receive("P", 1, Heartbeat(), 2.0) == [UnknownSender("P")]  # the old run is unknown now
    assert peers.receive("P", 2, hello("P", reply=True), 2.0) == [HandshakeSettled("P")]


def test_a_hello_sent_again_for_the_association_in_place_is_answered_not_torn_down() -> None:
    # P's first Hello associated us; its wait for our answer ran out (a loaded host) and it asks
    # again, with the same number: the association and its transfers stay, P gets its answer.
    peers = associations()
    receive(peers, "P", 1, hello("P", association=7), 0.0)
    ours = peers.records["P"].ours
    assert ours is not None
    assert receive(peers, "P", 1, hello("P", association=7), 1.0) == [
        SendHello("P", reply=True, best_effort=True, association=ours)
    ]
    assert peers.peers() == ["P"] and peers.receive("P", 1, Heartbeat(), 1.5) == [RenewLeases("P", (), 1.5, 6.0)]
    # A Hello of another association of the same run: P dropped us and started over.
    again = receive(peers, "P", 1, hello("P", association=8), 2.0)
    assert [type(a) for a in again] == [TearDown, AddTransportPeer, SendHello, HandshakeSettled, PeerConnected]
    assert isinstance(again[0], TearDown) and again[0].reason == "peer started a new association"
    assert kept(peers, "theirs")["P"] == 8 and kept(peers, "ours")["P"] != ours  # ours is renumbered with it


def test_our_hellos_keep_one_number_per_association_until_it_is_dropped() -> None:
    peers = associations()
    first = [a for a in peers.connect("P", "tcp://127.0.0.1:1") if isinstance(a, SendHello)]
    retry = [a for a in peers.connect("P", "tcp://127.0.0.1:1") if isinstance(a, SendHello)]
    assert first == retry and first[0].association > 0  # a retry after a timeout: the same association
    receive(peers, "P", 1, hello("P", reply=True), 1.0)  # the answer: associated, with that number
    assert kept(peers, "ours")["P"] == first[0].association
    peers.tear_down("P", "silent")
    (after,) = [a for a in peers.connect("P", "tcp://127.0.0.1:1") if isinstance(a, SendHello)]
    assert after.association != first[0].association


def test_attempts_never_answered_are_bounded() -> None:
    peers = associations()
    for n in range(ATTEMPTS_KEPT + 10):
        peers.connect(f"P{n}", "tcp://127.0.0.1:1")
    ours = kept(peers, "ours")
    assert len(ours) == ATTEMPTS_KEPT and "P0" not in ours and f"P{ATTEMPTS_KEPT + 9}" in ours


def test_the_addresses_of_attempts_are_bounded_and_a_live_peer_keeps_its_own() -> None:
    peers = associations()
    peers.connect("L", "tcp://127.0.0.1:1")
    receive(peers, "L", 1, hello("L", reply=True), 0.0)  # L answers: associated at the address dialled
    for n in range(ATTEMPTS_KEPT):
        peers.connect(f"P{n}", f"tcp://127.0.0.1:{n + 2}")
    newest = f"P{ATTEMPTS_KEPT - 1}"  # one past the bound: every other attempt's address goes
    assert kept(peers, "address") == {"L": "tcp://127.0.0.1:1", newest: f"tcp://127.0.0.1:{ATTEMPTS_KEPT + 1}"}


def test_a_reject_from_a_later_run_of_an_associated_peer_ends_the_association() -> None:
    # P restarted at the same address and refuses what D still sends its earlier run.
    peers = associations()
    receive(peers, "P", 1, hello("P"), 0.0)
    same_run = peers.receive("P", 1, Reject("restarted"), 1.0)  # the run we know: a handshake's verdict only
    assert [type(a) for a in same_run] == [HandshakeSettled] and peers.peers() == ["P"]
    ended = peers.receive("P", 2, Reject("restarted"), 1.0)
    assert [type(a) for a in ended] == [TearDown, HandshakeSettled] and peers.peers() == []
    assert isinstance(ended[0], TearDown) and ended[0].reason == "a later run of it says: restarted"
    assert [type(a) for a in peers.receive("Q", 5, Reject("x"), 1.0)] == [HandshakeSettled]  # not associated


def test_a_silent_peer_is_told_why_torn_down_and_gets_no_heartbeat() -> None:
    peers = associations()
    receive(peers, "P", 1, hello("P"), 0.0)
    receive(peers, "Q", 1, hello("Q"), 3.0)
    # The goodbye goes first, while P is still known: a P that was only paused learns it.
    assert peers.tick(6.0) == [
        SendControl("P", Goodbye("no message for 6.0s")),
        TearDown("P", "no message for 6.0s"),
        SendHeartbeat("Q"),
    ]
    assert peers.peers() == ["Q"]
    assert peers.tear_down("P", "again") == [TearDown("P", "again")]  # no goodbye to a peer not associated


def test_a_refused_route_refuses_the_peer() -> None:
    peers = associations()
    (route,) = peers.receive("P", 1, hello("P", address="tcp://10.0.0.1:1"), 0.0)
    assert isinstance(route, AddRoute) and route.pending is not None
    error = ConfigError("unauthenticated")
    assert peers.pending_refused("P", route.pending, error) == [
        Refused("P", error, abandon=True),  # the channel refuses its address for good
        SendControl("P", Reject("unauthenticated")),
        HandshakeSettled("P", error),
    ]
    assert peers.peers() == []


def test_a_peer_the_transport_refuses_is_refused_and_not_associated() -> None:
    peers = associations()
    (add,) = peers.receive("P", 1, hello("P"), 0.0)
    assert isinstance(add, AddTransportPeer) and peers.peers() == []  # nothing kept before the transport agrees
    error = TransportError("metadata names another endpoint")
    assert peers.pending_refused("P", add.pending, error) == [
        Refused("P", error),
        SendControl("P", Reject("metadata names another endpoint")),
        HandshakeSettled("P", error),
    ]
    # it speaks as if associated: told it is not (a Goodbye), at once
    assert peers.peers() == [] and peers.receive("P", 1, Heartbeat(), 1.0) == [AnswerUnassociated("P", 1)]


@pytest.mark.asyncio
async def test_a_hello_whose_memory_the_transport_refuses_does_not_crash_the_engine() -> None:
    fabric = LoopbackFabric()
    pair = await EnginePair(fabric, config=LEASE).start(connect=False)
    kv = KVBuffers(SMALL_SPEC, 16)
    # Its Hello names another endpoint's memory ("elsewhere"), which P's transport refuses.
    liar = Engine("L", kv.layout, fabric.endpoint("elsewhere"), pair.hub.channel("L"), config=LEASE)
    await liar.start()
    try:
        with pytest.raises(PeerProtocolError, match="names another endpoint"):
            await liar.connect("P", timeout=5)
        stats = pair.p.stats()
        assert stats["crashed"] == 0 and stats["peers_refused"] == 1 and pair.p.peers() == []
        await pair.d.connect("P", timeout=5)  # P still serves everyone else
        assert pair.p.peers() == ["D"]
    finally:
        await liar.aclose()
        await pair.close()


@pytest.mark.asyncio
async def test_decode_heartbeats_keep_a_pull_lease_alive_past_its_deadline() -> None:
    # D's READ (the fabric's first op) stalls 1.5 s, several of P's deadlines: D's heartbeats,
    # which list the transfer, keep P holding the blocks meanwhile.
    pair = await EnginePair(LoopbackFabric(faults=FaultPlan(stall_ops={1}, stall_for=1.5)), config=LEASE).start()
    try:
        waiting = await pair.d.expect("r", 1, peer="P", block_ids=[1], mode=Mode.PULL, timeout=5)
        pair.d.assoc.liveness.interval = 0.1
        pair.p_kv.fill([2], seed=1)
        sending = await pair.p.kv_ready("r", 1, block_ids=[2], mode=Mode.PULL, peer="D")
        assert (await waiting.wait(3)).ok and (await sending.wait(3)).ok
        # and without D listing it, P's lease runs out
        pair.d.assoc.liveness.interval = 10.0
        held = await pair.p.kv_ready("s", 1, block_ids=[3], mode=Mode.PULL, peer="D")
        result = await held.wait(3)
        assert result.outcome is Outcome.EXPIRED
    finally:
        await pair.close()


@pytest.mark.asyncio
async def test_a_silent_peer_is_lost_after_a_lease_and_its_transfers_fail() -> None:
    pair = await EnginePair(LoopbackFabric(), config=LEASE).start()
    try:
        waiting = await pair.d.expect("r", 1, peer="P", block_ids=[1], timeout=30)
        pair.p.assoc.liveness.interval = 100.0  # P stops sending anything
        result = await waiting.wait(3)
        assert result.outcome is Outcome.FAILED and "lost" in result.reason
        assert pair.d.peers() == [] and pair.d.core.ledger.held_blocks == 0
    finally:
        await pair.close()


@pytest.mark.asyncio
async def test_goodbye_ends_the_association_at_once() -> None:
    pair = await EnginePair(LoopbackFabric(), config=LEASE).start()
    waiting = await pair.d.expect("r", 1, peer="P", block_ids=[1], timeout=30)
    await pair.p.aclose()
    result = await waiting.wait(10)
    # ended by the goodbye, not by the lease running out ("no message for ...")
    assert result.reason == "peer P lost: it tore us down: engine closing"
    assert pair.d.peers() == [] and pair.d.core.ledger.held_blocks == 0
    await pair.d.aclose()
    pair.fabric.close()


@pytest.mark.asyncio
async def test_a_restarted_peer_fails_the_old_transfers_and_serves_new_ones() -> None:
    pair = await EnginePair(LoopbackFabric(), config=EngineConfig(lease=30.0)).start()
    try:
        old = await pair.d.expect("old", 1, peer="P", block_ids=[1], timeout=30)
        # P "restarts": same name, a new control channel (a new incarnation) and a new endpoint
        pair.p.control.close()
        pair.p.transport.close()
        pair.fabric._endpoints.pop("P")
        reborn = Engine("P", pair.p_kv.layout, pair.fabric.endpoint("P"), LocalControl(pair.hub, "P"))
        await reborn.start()
        await reborn.connect("D")
        assert (await old.wait(2)).outcome is Outcome.FAILED
        pair.p_kv.fill([5], seed=3)
        new = await pair.d.expect("new", 1, peer="P", block_ids=[2])
        await reborn.kv_ready("new", 1, block_ids=[5])
        assert (await new.wait(3)).ok
        await reborn.aclose()
    finally:
        await pair.p.aclose(drain_timeout=0.1)  # the old run, whose channel is already gone
        await pair.d.aclose()
        pair.fabric.close()


@pytest.mark.asyncio
async def test_a_handshake_asked_again_after_its_wait_ran_out_keeps_the_association_and_its_transfers() -> None:
    # D's first wait for P's answer runs out (P's answers are held back, as a loaded host holds
    # them) and D asks again.  P, associated since D's first Hello and holding KV for D to pull,
    # answers again instead of starting over: the transfer survives and completes.
    pair = await EnginePair(LoopbackFabric(), config=EngineConfig(lease=30.0)).start(connect=False)
    held: list[tuple[str, int, str, ControlMessage]] = []
    route = pair.hub.route

    def holding(sender: str, incarnation: int, peer: str, message: ControlMessage) -> None:
        if sender == "P":
            held.append((sender, incarnation, peer, message))
        else:
            route(sender, incarnation, peer, message)

    def answers() -> int:
        return sum(isinstance(m, Hello) and m.reply for *_, m in held)

    pair.hub.route = holding  # type: ignore[method-assign]
    try:
        with pytest.raises(HandshakeTimeout):
            await pair.d.connect("P", timeout=0.05)
        await eventually(lambda: pair.p.peers() == ["D"] and answers() == 1, "P associated, its answer held")
        pair.p_kv.fill([2], seed=4)
        sending = await pair.p.kv_ready("r", 1, block_ids=[2], mode=Mode.PULL, peer="D")  # held for D
        retry = asyncio.create_task(pair.d.connect("P", timeout=30))
        await eventually(lambda: answers() == 2, "P answered D's second Hello")
        pair.hub.route = route  # type: ignore[method-assign]
        for message in held:
            route(*message)
        await retry
        waiting = await pair.d.expect("r", 1, peer="P", block_ids=[1], mode=Mode.PULL, timeout=30)
        assert (await sending.wait(5)).ok and (await waiting.wait(5)).ok
        assert pair.p.stats()["failed"] == 0
        assert same_kv(pair.p_kv, [2], pair.d_kv, [1])
    finally:
        await pair.close()


def test_core_renewal_holds_p_blocks_a_lease_past_the_heartbeat_and_only_for_its_peer() -> None:
    core = TransferCore("P", num_layers=2, config=CoreConfig(fence_timeout=1.0))
    key, other = TransferKey("r", 1), TransferKey("s", 1)
    core.kv_ready(KvReady(key, block_ids=[1, 2], mode=Mode.PULL, peer="D"), now=0.0, deadline=10.0)
    core.kv_ready(KvReady(other, block_ids=[3], mode=Mode.PULL, peer="E"), now=0.0, deadline=10.0)
    assert core.renew("D", [key, other, TransferKey("unknown", 1)], now=9.0, lease=5.0) == []
    core.timer(10.0)  # the original deadline: only the transfer of the peer that renewed survives
    assert core.machine(key, Role.PREFILL).state in ACTIVE
    assert core.machine(other, Role.PREFILL).outcome is Outcome.EXPIRED
    core.renew("D", [key], now=10.0, lease=1.0)  # a shorter lease never pulls a deadline in
    core.timer(13.9)
    assert core.machine(key, Role.PREFILL).state in ACTIVE
    core.timer(14.0)
    assert core.machine(key, Role.PREFILL).outcome is Outcome.EXPIRED


def test_core_renewal_never_holds_p_blocks_past_max_hold() -> None:
    core = TransferCore("P", num_layers=2, config=CoreConfig(fence_timeout=1.0, max_hold=20.0))
    key = TransferKey("r", 1)
    core.kv_ready(KvReady(key, block_ids=[1, 2], mode=Mode.PULL, peer="D"), now=5.0, deadline=10.0)
    for beat in (9.0, 14.0, 19.0):  # each renewal in full: the cap (5 + 20) is not reached
        core.renew("D", [key], now=beat, lease=5.0)
    assert core.next_deadline() == 24.0 and core.stats.capped_renewals == 0
    core.renew("D", [key], now=23.0, lease=5.0)  # would hold until 28: cut to 25
    assert core.next_deadline() == 25.0 and core.stats.capped_renewals == 1
    core.renew("D", [key], now=24.5, lease=5.0)  # the peer keeps beating: still 25
    core.timer(24.9)
    assert core.machine(key, Role.PREFILL).state in ACTIVE
    core.timer(25.0)
    assert core.machine(key, Role.PREFILL).outcome is Outcome.EXPIRED
    assert core.stats.capped_renewals == 2


@pytest.mark.asyncio
async def test_decode_heartbeats_cannot_hold_prefill_blocks_past_max_hold() -> None:
    # D's READ stalls for ever, and D's heartbeats keep listing the transfer: P still gives up
    # max_hold after the transfer opened, where before it renewed the lease for as long as D beat.
    config = EngineConfig(
        core=CoreConfig(fence_timeout=0.3, retention=5.0, max_hold=1.0),
        transfer_timeout=0.4,
        lease=0.6,
        drain_timeout=0.5,
    )
    pair = await EnginePair(LoopbackFabric(faults=FaultPlan(stall_ops={1}, stall_for=30.0)), config=config).start()
    try:
        await pair.d.expect("r", 1, peer="P", block_ids=[1], mode=Mode.PULL, timeout=30)
        pair.d.assoc.liveness.interval = 0.05
        pair.p_kv.fill([2], seed=1)
        sending = await pair.p.kv_ready("r", 1, block_ids=[2], mode=Mode.PULL, peer="D")
        result = await sending.wait(5)
        assert result.outcome is Outcome.EXPIRED
        assert pair.p.stats()["capped_renewals"] >= 1
    finally:
        await pair.close()


@pytest.mark.asyncio
async def test_the_side_that_tears_a_peer_down_tells_it_why() -> None:
    # D's READ stalls, P aborts and no fence comes: P tears D down after its fence timeout.
    # D's lease and its own fence timeout are far away: only P's goodbye makes D settle now.
    config = EngineConfig(core=CoreConfig(fence_timeout=0.3, retention=5.0), lease=60.0, drain_timeout=0.5)
    pair = EnginePair(LoopbackFabric(faults=FaultPlan(stall_ops={1}, stall_for=30.0)), config=config)
    pair.d.core.config = CoreConfig(fence_timeout=60.0, retention=5.0)
    await pair.start()
    try:
        waiting = await pair.d.expect("r", 1, peer="P", block_ids=[1], mode=Mode.PULL, timeout=30)
        pair.p_kv.fill([2], seed=1)
        sending = await pair.p.kv_ready("r", 1, block_ids=[2], mode=Mode.PULL, peer="D", timeout=30)
        await eventually(lambda: pair.p.stats()["live_transfers"] == 1 and pair.d.core.live() != [], "D reads")
        await pair.p.abort("r", 1, Role.PREFILL)
        assert (await sending.wait(5)).outcome is Outcome.ABORTED
        await eventually(lambda: pair.p.peers() == [], "P tears D down")
        await eventually(lambda: pair.d.peers() == [], "D hears why and drops P", timeout=5.0)
        result = await waiting.wait(5)
        assert result.outcome is not Outcome.SUCCEEDED
    finally:
        await pair.close()


@pytest.mark.asyncio
async def test_a_heartbeat_naming_more_keys_than_a_frame_carries_goes_out_as_several() -> None:
    # One heartbeat names at most MAX_HEARTBEAT_KEYS keys (decoding a key costs the receiver a
    # Python object, so the cap bounds its loop's work per frame); P holding more requests for
    # D than that still says so of every one.
    pair = await EnginePair(LoopbackFabric(), config=EngineConfig(lease=600.0, heartbeat_interval=0.05)).start()
    beats: list[Heartbeat] = []
    route = pair.hub.route

    def recording(sender: str, incarnation: int, peer: str, message: ControlMessage) -> None:
        if isinstance(message, Heartbeat) and sender == "P":
            beats.append(wire.decode(wire.encode(wire.Envelope(sender, 1, peer, 1, message))).message)  # type: ignore[arg-type]
        route(sender, incarnation, peer, message)

    pair.hub.route = recording  # type: ignore[method-assign]
    try:
        promised = {TransferKey(f"r{i}", 1) for i in range(MAX_HEARTBEAT_KEYS + 904)}
        for key in promised:
            await pair.p.promise(key.transfer_id, key.epoch, peer="D")
        await eventually(
            lambda: promised <= {key for beat in beats for key in beat.keys}, "every promise in a heartbeat", timeout=60
        )
        assert all(len(beat.keys) <= MAX_HEARTBEAT_KEYS for beat in beats) and pair.p.crashed == []
    finally:
        await pair.close()


def test_a_transfer_naming_a_peer_refused_for_good_fails_at_once_until_it_connects() -> None:
    """P refused D's handshake for good (another model, say) before P's request handed its KV
    over: the transfer naming D fails at once instead of holding P's blocks to its deadline.
    Once D associates (fixed and back), a transfer for it waits as any other."""
    core = TransferCore("P", num_layers=2)
    core.peer_lost("D", 0.0, "its handshake was refused: kv layout mismatch on model", refused=True)
    key, later = TransferKey("r", 1), TransferKey("s", 1)
    actions = core.kv_ready(KvReady(key, block_ids=[1, 2], peer="D"), now=1.0, deadline=600.0)
    m = core.machine(key, Role.PREFILL)
    assert m.outcome is Outcome.FAILED and "kv layout mismatch on model" in m.reason
    assert [a.block_ids for a in actions if isinstance(a, ReleaseBlocks)] == [(1, 2)]
    core.peer_connected("D", 2.0)
    core.kv_ready(KvReady(later, block_ids=[3], peer="D"), now=3.0, deadline=600.0)
    assert core.machine(later, Role.PREFILL).state in ACTIVE
