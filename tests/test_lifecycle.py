"""Lifecycle gaps between a prefill and a decode core: P's promise on a queued request renews D's
wait, and D's abort of a transfer it never registered reaches P.

Pure cores joined by hand (time is an argument): what P's heartbeats carry, how far they hold
D's deadline, and what P does when D gives up before allocating any block.
"""

from __future__ import annotations

import asyncio

import pytest

from kvflow.control.channel import LocalControlHub
from kvflow.errors import ConfigError, StaleEpoch, UnknownTransfer
from kvflow.protocol.actions import Action, ReleaseBlocks, Resolve, SendMessage
from kvflow.protocol.core import CoreConfig, TransferCore
from kvflow.protocol.messages import Hello, Message, Notice, Quiesced, Registration, TransferKey
from kvflow.protocol.requests import Abort, Expect, KvReady
from kvflow.protocol.state import Mode, Outcome, Role, State
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.transports.loopback import LoopbackFabric
from kvflow_tools.testing import SMALL_SPEC, EnginePair, KVBuffers, ManualClock, same_kv
from tests.waiting import eventually, quiesce

KEY = TransferKey("r", 1)
CONFIG = CoreConfig(fence_timeout=2.0, retention=30.0, max_hold=20.0)


def messages(actions: list[Action]) -> list[Message]:
    return [a.message for a in actions if isinstance(a, SendMessage)]


def released(actions: list[Action]) -> list[int]:
    return [b for a in actions if isinstance(a, ReleaseBlocks) for b in a.block_ids]


def pair() -> tuple[TransferCore, TransferCore]:
    p, d = TransferCore("P", 2, CONFIG), TransferCore("D", 2, CONFIG)
    p.peer_connected("D", 0.0)
    d.peer_connected("P", 0.0)
    return p, d


def registered(p: TransferCore, d: TransferCore, deadline: float = 5.0) -> None:
    (registration,) = messages(
        d.expect(Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[1, 2]), now=0.0, deadline=deadline)
    )
    assert isinstance(registration, Registration)
    p.receive("D", registration, 0.1)


# ---------------------------------------------------------------- P's promise renews D's wait


def test_a_promised_transfer_keeps_d_waiting_past_its_deadline_while_p_beats() -> None:
    p, d = pair()
    registered(p, d)
    p.promise(KEY, "D", 0.2)
    for beat in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):  # P's queue is long: no KV yet, only heartbeats
        keys = p.heartbeat_keys("D", beat)
        assert keys == (KEY,)
        d.renew("P", keys, beat, lease=3.0)
        p.renew("D", d.heartbeat_keys("P", beat), beat, lease=3.0)  # D's beats hold P's side
        assert d.timer(beat) == [] and p.timer(beat) == []
    assert d.machine(KEY, Role.DECODE).state is State.REGISTERED
    assert d.next_deadline() == 9.0  # a lease past the last beat


def test_without_a_promise_d_expires_at_its_deadline() -> None:
    p, d = pair()
    registered(p, d)
    d.renew("P", p.heartbeat_keys("D", 4.0), 4.0, lease=3.0)
    assert p.heartbeat_keys("D", 4.0) == ()
    expired = d.timer(5.0)
    assert [a.outcome for a in expired if isinstance(a, Resolve)] == [Outcome.EXPIRED]


def test_promises_never_hold_d_past_max_hold_and_only_renew_the_promisees_transfers() -> None:
    p, d = pair()
    registered(p, d)
    p.promise(KEY, "D", 0.2)
    d.renew("elsewhere", (KEY,), 4.0, lease=100.0)  # another peer's word renews nothing
    assert d.next_deadline() == 5.0
    expired_at = None
    for beat in range(4, 30, 2):
        d.renew("P", p.heartbeat_keys("D", float(beat)), float(beat), lease=3.0)
        if d.timer(float(beat)):
            expired_at = beat
            break
    assert d.machine(KEY, Role.DECODE).outcome is Outcome.EXPIRED
    assert expired_at == 20  # created at 0, max_hold 20: P's beats at 18 and 20 did not hold it
    assert d.stats.capped_renewals >= 1


def test_a_promise_ends_with_the_transfer_or_after_max_hold() -> None:
    p, d = pair()
    p.promise(KEY, "D", 0.0)
    p.promise(TransferKey("other", 1), "D2", 0.0)
    assert p.heartbeat_keys("D", 1.0) == (KEY,) and p.heartbeat_keys("D2", 1.0) == (TransferKey("other", 1),)
    p.abort(Abort(KEY, Role.PREFILL, "request ended"), 2.0)
    assert p.heartbeat_keys("D", 3.0) == ()
    assert p.heartbeat_keys("D2", 20.0) == ()  # max_hold after the promise: left out
    # listing is a query; the timer forgets what ended, so promises take no memory for long
    assert p.store.promisee(KEY) is None  # (gone with its abort)
    assert p.store.promisee(TransferKey("other", 1)) == "D2"
    p.timer(20.0)
    assert p.store.promisee(TransferKey("other", 1)) is None


# ---------------------------------------------------------------- D's promise holds P's ready KV


def test_d_holding_a_queued_request_keeps_p_holding_the_kv_it_made_ready_past_its_deadline() -> None:
    p, d = pair()
    # push P is ready before D could allocate: P holds the KV until its transfer deadline (4.0)
    p.kv_ready(KvReady(KEY, block_ids=[5, 6], peer="D"), now=0.0, deadline=4.0)
    d.promise(KEY, "P", 0.0)  # D's request is queued behind others: no block yet
    for beat in (1.0, 3.0, 5.0, 7.0, 9.0):
        keys = d.heartbeat_keys("P", beat)
        assert keys == (KEY,)
        p.renew("D", keys, beat, lease=3.0)
        assert p.timer(beat) == [] and d.timer(beat) == []
    assert p.machine(KEY, Role.PREFILL).state is State.PREFILL_READY
    # D allocates at last: its transfer, not its promise, is what its heartbeats list now
    (registration,) = messages(
        d.expect(Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[1, 2]), now=9.5, deadline=20.0)
    )
    assert d.heartbeat_keys("P", 9.6) == (KEY,)
    p.receive("D", registration, 9.6)
    assert p.machine(KEY, Role.PREFILL).state is State.WRITING  # the WRITE goes out


def test_without_d_s_promise_p_frees_the_ready_kv_at_its_deadline() -> None:
    p, _ = pair()
    p.kv_ready(KvReady(KEY, block_ids=[5, 6], peer="D"), now=0.0, deadline=4.0)
    actions = p.timer(4.0)
    assert p.machine(KEY, Role.PREFILL).state in (State.EXPIRING, State.EXPIRED) and actions


def test_d_s_promise_ends_with_its_abort_and_never_outlives_max_hold() -> None:
    _, d = pair()
    d.promise(KEY, "P", 0.0)
    d.abort(Abort(KEY, Role.DECODE, "request ended while queued", peer="P", mode=Mode.PUSH), 1.0)
    assert d.heartbeat_keys("P", 1.5) == ()
    other = TransferKey("other", 1)
    d.promise(other, "P", 0.0)
    assert d.heartbeat_keys("P", 19.0) == (other,) and d.heartbeat_keys("P", 20.0) == ()  # max_hold 20


@pytest.mark.asyncio
async def test_d_s_heartbeats_carry_its_promise_so_p_holds_ready_kv_past_its_transfer_timeout() -> None:
    """Two engines on a manual clock: P's KV is ready 12 s before D allocates, three times P's
    transfer timeout; D's heartbeats (every second) name the transfer, and it then moves."""
    clock = ManualClock(1000.0)
    config = EngineConfig(core=CoreConfig(fence_timeout=1.0), transfer_timeout=4.0, lease=6.0, drain_timeout=0.5)
    fabric, hub = LoopbackFabric(), LocalControlHub()
    kv = {name: KVBuffers(SMALL_SPEC, 8) for name in "PD"}
    p, d = (Engine(n, kv[n].layout, fabric.endpoint(n), hub.channel(n), config=config, clock=clock) for n in "PD")
    await p.start()
    await d.start()
    try:
        await d.connect("P", timeout=5)
        kv["P"].fill([5], seed=7)
        sending = await p.kv_ready("r", 1, block_ids=[5], peer="D")  # push: D has not registered
        await d.promise("r", 1, peer="P")  # D's request is queued: no block yet
        for second in range(1, 13):
            clock.now = 1000.0 + second
            p.poke()
            d.poke()
            await quiesce()
        assert p.core.machine(KEY, Role.PREFILL).state is State.PREFILL_READY
        receiving = await d.expect("r", 1, peer="P", block_ids=[2])
        assert (await receiving.wait(10)).ok and (await sending.wait(10)).ok
        assert same_kv(kv["P"], [5], kv["D"], [2])
    finally:
        await d.aclose()
        await p.aclose()
        fabric.close()


# ---------------------------------------------------------------- D gives up before allocating


def test_d_aborting_a_transfer_it_never_registered_tells_p() -> None:
    p, d = pair()
    actions = d.abort(Abort(KEY, Role.DECODE, "client went away", peer="P"), 1.0)
    (notice,) = messages(actions)
    assert isinstance(notice, Notice) and notice.outcome is Outcome.ABORTED and released(actions) == []
    # P had its KV ready, waiting for a registration that will never come: its blocks come back now
    p.kv_ready(KvReady(KEY, block_ids=[7, 8], peer="D"), now=0.5, deadline=60.0)
    answer = p.receive("D", notice, 1.1)
    assert released(answer) == [7, 8]
    assert p.machine(KEY, Role.PREFILL).outcome is Outcome.ABORTED
    (quiesced,) = messages(answer)
    assert isinstance(quiesced, Quiesced)
    assert d.receive("P", quiesced, 1.2) == [] and d.stats.unknown_transfer == 0  # absorbed


def test_p_ready_after_d_gave_up_returns_its_blocks_at_once() -> None:
    p, d = pair()
    (notice,) = messages(d.abort(Abort(KEY, Role.DECODE, "client went away", peer="P"), 1.0))
    p.receive("D", notice, 1.1)  # P's request is still queued: nothing of it here yet
    late = p.kv_ready(KvReady(KEY, block_ids=[7, 8], peer="D"), now=2.0, deadline=60.0)
    assert released(late) == [7, 8]
    assert p.live() == []


def test_a_late_registration_of_an_abandoned_transfer_is_refused_by_d_itself() -> None:
    p, d = pair()
    d.abort(Abort(KEY, Role.DECODE, "client went away", peer="P"), 1.0)
    assert d.machine(KEY, Role.DECODE).state is State.ABORTED
    # the epoch is taken: a stale caller cannot register blocks for it any more
    with pytest.raises(StaleEpoch):
        d.expect(Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[1]), now=2.0, deadline=9.0)


def test_d_without_the_peer_still_refuses_an_unknown_abort_and_p_ignores_a_bogus_one() -> None:
    p, d = pair()
    with pytest.raises(UnknownTransfer):
        d.abort(Abort(KEY, Role.DECODE), 1.0)
    registered(p, d)
    # a notice from a peer that is not the transfer's changes nothing, and is counted
    p.receive("intruder", Notice(KEY, Outcome.ABORTED, "x"), 1.0)
    assert p.machine(KEY, Role.PREFILL).state is State.REGISTERED and p.stats.foreign_peer == 1


def test_a_push_p_not_yet_registered_takes_the_abort_only_from_the_peer_its_promise_names() -> None:
    p, d = pair()
    (notice,) = messages(d.abort(Abort(KEY, Role.DECODE, "client went away", peer="P"), 1.0))
    # push: P's KV is ready before any registration, so P knows its peer only from its promise
    p.kv_ready(KvReady(KEY, block_ids=[7, 8]), now=0.5, deadline=60.0)
    p.receive("D", notice, 1.1)
    assert p.stats.foreign_peer == 1  # unclaimed: not D's to end
    assert p.machine(KEY, Role.PREFILL).state is State.PREFILL_READY
    other = TransferKey("s", 1)
    p.promise(other, "D", 0.0)
    (notice,) = messages(d.abort(Abort(other, Role.DECODE, "client went away", peer="P"), 1.0))
    p.receive("D", notice, 1.1)  # held: P has nothing of it yet
    assert released(p.kv_ready(KvReady(other, block_ids=[3]), now=2.0, deadline=60.0)) == [3]


# ---------------------------------------------------------------- engines


@pytest.mark.asyncio
async def test_concurrent_connects_to_one_peer_make_one_association() -> None:
    """D registers several transfers in one step, each connecting to P first: one Hello goes
    out, else P takes the second for a restart of D and tears the association down."""
    pair = await EnginePair(LoopbackFabric()).start(connect=False)
    try:
        hellos = []
        sent = pair.d.control.send

        def counting(peer: str, message: object) -> None:
            if isinstance(message, Hello):
                hellos.append(peer)
            sent(peer, message)  # type: ignore[arg-type]

        pair.d.control.send = counting  # type: ignore[method-assign]
        await asyncio.gather(*(pair.d.connect("P") for _ in range(3)))
        await pair.d.expect("t", 1, peer="P", block_ids=[1], mode=Mode.PUSH)
        await eventually(lambda: len(pair.p.core.live()) == 1, "P holds the registration")
        assert hellos == ["P"]
        assert pair.d.peers() == ["P"] and pair.p.peers() == ["D"]
    finally:
        await pair.d.aclose(drain_timeout=0.1)
        await pair.p.aclose(drain_timeout=0.1)


# ---------------------------------------------------------------- a push transfer is bound to its D


def test_a_registration_from_an_engine_other_than_the_promised_d_is_refused_and_the_d_still_registers() -> None:
    p, d = pair()
    p.peer_connected("X", 0.0)
    p.promise(KEY, "D", 0.0)  # P holds the request for D: another engine knowing the id cannot take it
    answer = messages(p.receive("X", Registration(KEY, (5, 6), 1, 5.0), 0.05))
    assert answer == [Notice(KEY, Outcome.FAILED, "transfer is for another engine"), Quiesced(KEY)]
    with pytest.raises(UnknownTransfer):  # no machine was made for it
        p.machine(KEY, Role.PREFILL)
    assert p.stats.foreign_peer == 1
    registered(p, d)
    assert p.machine(KEY, Role.PREFILL).peer == "D"


def test_p_ready_for_d_refuses_a_transfer_another_engine_registered_first() -> None:
    p, _ = pair()
    p.peer_connected("X", 0.0)
    p.receive("X", Registration(KEY, (5, 6), 1, 5.0), 0.05)  # before P had the request: not refusable then
    with pytest.raises(ConfigError, match="peer is X, not D"):
        p.kv_ready(KvReady(KEY, block_ids=[7, 8], peer="D"), now=0.5)
    assert p.machine(KEY, Role.PREFILL).batches == []  # nothing of P's is X's to write into
