"""The asyncio engine over the loopback transport: real bytes, real threads, injected faults."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from kvflow.control.channel import LocalControlHub
from kvflow.errors import (
    BlockConflict,
    ConfigError,
    EngineClosed,
    EngineCrashed,
    HandshakeTimeout,
    InvalidBatch,
    InvalidTransition,
    LayoutMismatch,
    StaleEpoch,
    TransportError,
    UnknownTransfer,
    UsageError,
)
from kvflow.layout import KVSpec
from kvflow.protocol.core import CoreConfig
from kvflow.protocol.messages import Goodbye, TransferKey, encode_notification, id_tag
from kvflow.protocol.state import Mode, Outcome, Role, State
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.transports.loopback import FaultPlan, LinkModel, LoopbackFabric
from kvflow_tools.testing import EnginePair, KVBuffers, ManualClock, same_kv
from tests.waiting import eventually, quiesce

FAST = EngineConfig(core=CoreConfig(fence_timeout=0.5, retention=5.0), transfer_timeout=5.0, drain_timeout=2.0)
# for tests that hold an op stalled while they look: no fence timeout may end the wait meanwhile
PATIENT = EngineConfig(core=CoreConfig(fence_timeout=60.0, retention=5.0), transfer_timeout=60.0, drain_timeout=2.0)


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[EnginePair]:
    engines = await EnginePair(LoopbackFabric(LinkModel(latency=1e-4)), config=FAST).start()
    yield engines
    await engines.close()


def ledgers_empty(pair: EnginePair) -> bool:
    return pair.p.core.ledger.held_blocks == 0 and pair.d.core.ledger.held_blocks == 0


async def settle(pair: EnginePair) -> None:
    """Wait until neither engine has a live transfer (acknowledgements and fences arrive)."""
    await eventually(lambda: not pair.p.core.live() and not pair.d.core.live(), "both engines settle")


async def stalled_op_posted(fabric: LoopbackFabric) -> None:
    """Wait until the first op (stalled by the fault plan) sits in the fabric: it is in flight."""
    await eventually(lambda: fabric.pending() == 1, "the stalled op is posted")


@pytest.mark.asyncio
@pytest.mark.parametrize("registration_first", [True, False])
async def test_push_moves_the_bytes_in_either_order(pair: EnginePair, registration_first: bool) -> None:
    pair.p_kv.fill([5, 6, 7], seed=1)
    if registration_first:
        waiting = await pair.d.expect("r", 1, peer="P", block_ids=[1, 2, 3])
        key = TransferKey("r", 1)
        await eventually(lambda: (key, Role.PREFILL) in {m.owner for m in pair.p.core.machines()}, "P registered")
        assert pair.p.core.machine(key, Role.PREFILL).state is State.REGISTERED
        sending = await pair.p.kv_ready("r", 1, block_ids=[5, 6, 7])
    else:
        sending = await pair.p.kv_ready("r", 1, block_ids=[5, 6, 7])
        assert pair.p.core.machine(TransferKey("r", 1), Role.PREFILL).state is State.PREFILL_READY
        waiting = await pair.d.expect("r", 1, peer="P", block_ids=[1, 2, 3])
    assert (await waiting.wait(5)).ok
    assert (await sending.wait(5)).ok
    assert same_kv(pair.p_kv, [5, 6, 7], pair.d_kv, [1, 2, 3])
    await settle(pair)
    assert ledgers_empty(pair)
    assert [r.block_ids for r in pair.d.released] == [(1, 2, 3)]
    assert [r.block_ids for r in pair.p.released] == [(5, 6, 7)]


@pytest.mark.asyncio
async def test_pull_reads_the_bytes_and_releases_prefill_after_done(pair: EnginePair) -> None:
    pair.p_kv.fill([8, 9], seed=2)
    waiting = await pair.d.expect("r", 1, peer="P", block_ids=[0, 4], mode=Mode.PULL)
    sending = await pair.p.kv_ready("r", 1, block_ids=[8, 9], mode=Mode.PULL, peer="D")
    assert (await waiting.wait(5)).ok and (await sending.wait(5)).ok
    assert same_kv(pair.p_kv, [8, 9], pair.d_kv, [0, 4])
    await settle(pair)
    assert ledgers_empty(pair)


@pytest.mark.asyncio
async def test_layer_by_layer_push_completes_after_the_last_layer(pair: EnginePair) -> None:
    pair.p_kv.fill([3, 4], seed=3)
    waiting = await pair.d.expect("r", 1, peer="P", block_ids=[10, 11], expected_batches=2)
    await pair.p.kv_ready("r", 1, block_ids=[3, 4], layers=(0, 1), final=False)
    receiving = pair.d.core.machine(TransferKey("r", 1), Role.DECODE)
    await eventually(lambda: len(receiving.landed) == 1, "the first WRITE lands")
    assert not waiting.done() and receiving.state is State.WRITING  # P has not produced layer 1 yet
    await pair.p.kv_ready("r", 1, block_ids=[3, 4], layers=(1, 2), final=True)
    assert (await waiting.wait(5)).ok
    assert same_kv(pair.p_kv, [3, 4], pair.d_kv, [10, 11])


@pytest.mark.asyncio
async def test_failed_write_reaches_decode_at_once() -> None:
    faults = FaultPlan(fail_ops={1})
    pair = await EnginePair(LoopbackFabric(faults=faults), config=FAST).start()
    try:
        waiting = await pair.d.expect("r", 1, peer="P", block_ids=[1, 2], timeout=30.0)
        await pair.p.kv_ready("r", 1, block_ids=[3, 4])
        result = await waiting.wait(2.0)  # long before the 30 s deadline
        assert result.outcome is Outcome.FAILED and "injected" in result.reason
        await settle(pair)
        assert ledgers_empty(pair)
    finally:
        await pair.close()


@pytest.mark.asyncio
async def test_stalled_write_keeps_decode_blocks_quarantined_until_it_lands() -> None:
    fabric = LoopbackFabric(faults=FaultPlan(stall_ops={1}))
    pair = await EnginePair(fabric, config=PATIENT).start()
    try:
        pair.p_kv.fill([3], seed=4)
        waiting = await pair.d.expect("old", 1, peer="P", block_ids=[7])
        await pair.p.kv_ready("old", 1, block_ids=[3])
        await stalled_op_posted(fabric)
        await pair.d.abort("old", 1, Role.DECODE, "client went away")
        assert (await waiting.wait(1)).outcome is Outcome.ABORTED
        sending = pair.p.core.machine(TransferKey("old", 1), Role.PREFILL)
        await eventually(lambda: sending.state is not State.WRITING, "P takes the abort")
        await quiesce()  # whatever P answered has arrived
        # The WRITE is still in flight: block 7 must not go back, nor be handed to anyone.
        assert sending.state is State.ABORTING and sending.inflight and fabric.pending() == 1
        assert pair.d.core.ledger.quarantined_blocks == 1
        assert not [r for r in pair.d.released if 7 in r.block_ids]
        with pytest.raises(BlockConflict, match="quarantined"):
            await pair.d.expect("new", 1, peer="P", block_ids=[7])
        fabric.unstall()
        await settle(pair)
        assert [r.block_ids for r in pair.d.released] == [(7,)]
        # Only now may block 7 take new KV, and the stale bytes are overwritten by the new ones.
        pair.p_kv.fill([5], seed=5)
        waiting = await pair.d.expect("new", 1, peer="P", block_ids=[7])
        await pair.p.kv_ready("new", 1, block_ids=[5])
        assert (await waiting.wait(5)).ok
        assert same_kv(pair.p_kv, [5], pair.d_kv, [7])
    finally:
        await pair.close()


@pytest.mark.asyncio
async def test_dead_prefill_fails_decode_by_its_deadline_and_frees_blocks_after_the_fence() -> None:
    fabric = LoopbackFabric(faults=FaultPlan(stall_ops={1}))
    pair = await EnginePair(fabric, config=FAST).start()
    try:
        waiting = await pair.d.expect("r", 1, peer="P", block_ids=[1, 2], timeout=0.3)
        await pair.p.kv_ready("r", 1, block_ids=[3, 4])
        await stalled_op_posted(fabric)
        fabric.kill("P")  # the process is gone: its memory, its ops and its control channel
        pair.p.control.close()
        result = await waiting.wait(2)
        assert result.outcome is Outcome.EXPIRED
        # the fence never comes; after fence_timeout P is declared lost
        await eventually(lambda: pair.d.core.ledger.held_blocks == 0, "D frees the blocks")
        assert "P" not in pair.d.peers()
    finally:
        await pair.d.aclose()
        await pair.p.aclose(drain_timeout=0.1)
        fabric.close()


@pytest.mark.asyncio
async def test_prefill_abort_before_registration_refuses_the_later_registration_at_once(pair: EnginePair) -> None:
    await pair.p.abort("gone", 1, Role.PREFILL, reason="client went away")
    waiting = await pair.d.expect("gone", 1, peer="P", block_ids=[1, 2], timeout=30.0)
    result = await waiting.wait(2.0)  # long before the 30 s deadline
    assert result.outcome is Outcome.ABORTED
    await settle(pair)
    assert ledgers_empty(pair)
    assert [r.block_ids for r in pair.d.released] == [(1, 2)]
    with pytest.raises(UnknownTransfer):
        await pair.d.abort("never", 1, Role.DECODE)


@pytest.mark.asyncio
async def test_expiry_without_prefill(pair: EnginePair) -> None:
    waiting = await pair.d.expect("r", 1, peer="P", block_ids=[1], timeout=0.1)
    result = await waiting.wait(2)
    assert result.outcome is Outcome.EXPIRED
    await settle(pair)
    assert ledgers_empty(pair)


@pytest.mark.asyncio
async def test_new_epoch_supersedes_the_old_one_and_stale_notifications_complete_nothing(pair: EnginePair) -> None:
    old = await pair.d.expect("r", 1, peer="P", block_ids=[1])
    new = await pair.d.expect("r", 2, peer="P", block_ids=[2])
    assert (await old.wait(1)).outcome is Outcome.ABORTED
    with pytest.raises(StaleEpoch):
        await pair.d.expect("r", 2, peer="P", block_ids=[3])
    # A notification for the old epoch arrives: it is counted and completes nothing.
    pair.p.transport.send_notification("D", encode_notification(TransferKey("r", 1), 0))
    pair.p.transport.send_notification("D", encode_notification(TransferKey("zzz", 9), 0))
    # D takes notifications in order: once it has counted the second, it has handled the first.
    await eventually(lambda: pair.d.stats()["unknown_transfer"] == 1, "D counts the unknown transfer")
    stats = pair.d.stats()
    assert stats["ignored"] + stats["stale_epoch"] == 1 and not new.done()
    await pair.p.kv_ready("r", 2, block_ids=[9])
    assert (await new.wait(5)).ok


@pytest.mark.asyncio
async def test_bad_input_is_refused_and_changes_nothing(pair: EnginePair) -> None:
    await pair.d.expect("held", 1, peer="P", block_ids=[4, 5])
    before = (pair.d.stats(), pair.d.core.ledger.held_blocks, len(pair.d.core.machines()))
    with pytest.raises(InvalidBatch, match="twice"):
        await pair.d.expect("x", 1, peer="P", block_ids=[1, 1])
    with pytest.raises(InvalidBatch, match="empty"):
        await pair.d.expect("x", 1, peer="P", block_ids=[])
    for beyond in (-1, 2**31, True):  # block ids travel as uint32, below 2**31
        with pytest.raises(InvalidBatch, match=rf"block id {beyond!r} is not an int in 0\.\.2147483647"):
            await pair.d.expect("x", 1, peer="P", block_ids=[4, beyond])
        with pytest.raises(InvalidBatch, match=rf"block id {beyond!r} is not an int"):
            await pair.p.kv_ready("x", 1, block_ids=[beyond], final=True)
    with pytest.raises(BlockConflict, match="block 5 is held"):
        await pair.d.expect("x", 1, peer="P", block_ids=[6, 5])
    assert (pair.d.stats(), pair.d.core.ledger.held_blocks, len(pair.d.core.machines())) == before
    await pair.p.kv_ready("p", 1, block_ids=[1], final=True)
    with pytest.raises(InvalidTransition, match="PREFILL_FINISHED"):
        await pair.p.kv_ready("p", 1, block_ids=[2], final=True, first_position=1)
    with pytest.raises(InvalidBatch, match="overlaps"):
        await pair.p.kv_ready("q", 1, block_ids=[1, 2], final=False)
        await pair.p.kv_ready("q", 1, block_ids=[3], first_position=1, final=True)


@pytest.mark.asyncio
async def test_layout_mismatch_is_refused_naming_the_field() -> None:
    fabric = LoopbackFabric()
    pair = await EnginePair(fabric, config=FAST).start(connect=False)
    other = KVBuffers(KVSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="bfloat16"), 16)
    odd = Engine("odd", other.layout, fabric.endpoint("odd"), pair.hub.channel("odd"), config=FAST)
    await odd.start()
    try:
        with pytest.raises(LayoutMismatch, match="dtype"):
            await odd.connect("P", timeout=2)
        assert "odd" not in pair.p.peers()
    finally:
        await odd.aclose()
        await pair.close()


async def pair_with_a_mute_prefill() -> EnginePair:
    """An unconnected pair whose P receives every message and answers none."""
    pair = await EnginePair(LoopbackFabric(), config=FAST).start(connect=False)
    pair.hub.unregister("P")
    pair.hub.register("P", asyncio.get_running_loop(), lambda sender, incarnation, message: None)
    return pair


@pytest.mark.asyncio
async def test_handshake_with_nobody_answering_times_out() -> None:
    pair = await pair_with_a_mute_prefill()
    try:
        with pytest.raises(HandshakeTimeout, match="handshake"):
            await pair.d.connect("P", timeout=0.1)
    finally:
        pair.hub.unregister("P")
        await pair.close()


@pytest.mark.asyncio
async def test_closing_the_engine_during_a_handshake_fails_it_as_closed() -> None:
    pair = await pair_with_a_mute_prefill()
    try:
        connecting = asyncio.ensure_future(pair.d.connect("P", timeout=5))
        await asyncio.sleep(0.05)
        await pair.d.aclose()
        with pytest.raises(EngineClosed, match="during the handshake"):
            await connecting
    finally:
        pair.hub.unregister("P")
        await pair.close()


@pytest.mark.asyncio
async def test_a_crashing_callback_is_recorded_and_surfaced() -> None:
    fabric = LoopbackFabric()
    pair = EnginePair(fabric, config=FAST)

    def broken(release: object) -> None:
        raise RuntimeError("callback bug")

    pair.d.outcomes.on_release = broken
    await pair.start()
    waiting = await pair.d.expect("r", 1, peer="P", block_ids=[1])
    await pair.p.kv_ready("r", 1, block_ids=[2])
    await waiting.wait(5)
    assert [type(e) for e in pair.d.crashed] == [RuntimeError]
    with pytest.raises(EngineCrashed, match="callback bug"):
        await pair.d.expect("s", 1, peer="P", block_ids=[3])
    await pair.p.aclose()
    with pytest.raises(EngineCrashed):
        await pair.d.aclose()
    fabric.close()


@pytest.mark.asyncio
async def test_close_aborts_what_is_left_and_returns_every_block() -> None:
    fabric = LoopbackFabric(faults=FaultPlan(stall_ops={1}))
    pair = await EnginePair(fabric, config=FAST).start()
    waiting = await pair.d.expect("r", 1, peer="P", block_ids=[1, 2])
    await pair.p.kv_ready("r", 1, block_ids=[3, 4])  # its WRITE stalls forever
    await stalled_op_posted(fabric)
    await pair.d.expect("s", 1, peer="P", block_ids=[5])  # P never produces this one
    await pair.d.aclose(drain_timeout=0.1)
    assert (await waiting.wait(1)).outcome is Outcome.ABORTED
    assert pair.d.core.ledger.held_blocks == 0
    assert sorted(b for r in pair.d.released for b in r.block_ids) == [1, 2, 5]
    with pytest.raises(EngineClosed):
        await pair.d.expect("t", 1, peer="P", block_ids=[6])
    await pair.p.aclose(drain_timeout=0.1)
    assert pair.p.core.ledger.held_blocks == 0
    fabric.close()


@pytest.mark.asyncio
async def test_starting_an_engine_twice_is_a_usage_error_not_a_closed_engine() -> None:
    fabric = LoopbackFabric()
    pair = await EnginePair(fabric, config=FAST).start(connect=False)
    with pytest.raises(UsageError, match="'D' was already started"):
        await pair.d.start()
    await pair.close()
    with pytest.raises(UsageError, match="already started"):
        await pair.p.start()


@pytest.mark.asyncio
async def test_close_tears_down_a_peer_whose_fence_never_comes() -> None:
    # The cores' clock stands still, so no fence timeout of theirs fires: only close can end it.
    fabric = LoopbackFabric(faults=FaultPlan(stall_ops={1}))
    pair = await EnginePair(fabric, config=FAST, clock=ManualClock()).start()
    await pair.d.expect("r", 1, peer="P", block_ids=[1, 2])
    await pair.p.kv_ready("r", 1, block_ids=[3, 4])  # its WRITE stalls: P never confirms a fence
    await stalled_op_posted(fabric)
    await pair.d.aclose(drain_timeout=0.1)
    assert pair.d.core.ledger.held_blocks == 0 and "P" not in pair.d.peers()
    assert [r.block_ids for r in pair.d.released] == [(1, 2)]
    await pair.p.aclose(drain_timeout=0.1)
    assert pair.p.core.ledger.held_blocks == 0
    fabric.close()


@pytest.mark.asyncio
async def test_a_write_from_a_torn_down_peer_lands_nowhere(monkeypatch: pytest.MonkeyPatch) -> None:
    fabric = LoopbackFabric(faults=FaultPlan(stall_ops={1}))
    pair = EnginePair(fabric, config=FAST)
    pair.p.core.config = PATIENT.core  # P keeps its association; only D gives up on it
    send = pair.d.control.send
    # and D's goodbye is lost on the way, so P never learns that D tore it down
    monkeypatch.setattr(pair.d.control, "send", lambda peer, m: None if isinstance(m, Goodbye) else send(peer, m))
    await pair.start()
    try:
        pair.p_kv.fill([3], seed=7)
        untouched = pair.d_kv.snapshot([1])
        await pair.d.expect("old", 1, peer="P", block_ids=[1])
        old_p = await pair.p.kv_ready("old", 1, block_ids=[3])  # its WRITE stalls
        await stalled_op_posted(fabric)
        await pair.d.abort("old", 1, Role.DECODE)
        # No fence from P: D tears P down and gives block 1 back, trusting that nothing of P lands.
        await eventually(lambda: [r.block_ids for r in pair.d.released] == [(1,)], "D gives block 1 back")
        assert "P" not in pair.d.peers() and "D" in pair.p.peers()
        fabric.unstall()  # P's WRITE runs now, into a block D may have handed to another transfer
        await eventually(lambda: fabric.pending() == 0, "P's WRITE runs")
        assert pair.d_kv.snapshot([1]) == untouched
        assert (await old_p.wait(5)).outcome is Outcome.ABORTED
    finally:
        await pair.close()


@pytest.mark.asyncio
async def test_a_peer_that_starts_over_fails_the_old_association_and_serves_new_transfers() -> None:
    fabric = LoopbackFabric(faults=FaultPlan(stall_ops={1}))
    pair = await EnginePair(fabric, config=FAST).start()
    try:
        pair.p_kv.fill([3, 4], seed=6)
        old_d = await pair.d.expect("old", 1, peer="P", block_ids=[1])
        old_p = await pair.p.kv_ready("old", 1, block_ids=[3])  # its WRITE stalls
        await stalled_op_posted(fabric)
        await pair.d.abort("old", 1, Role.DECODE)
        # P's WRITE never drains, so D's fence times out and D tears P down.
        await eventually(lambda: "P" not in pair.d.peers(), "D tears P down")
        assert (await old_d.wait(1)).outcome is Outcome.ABORTED
        # the block goes back once P's removal returned (on the peer thread), not before
        await eventually(lambda: pair.d.core.ledger.held_blocks == 0, "D's block back after P's removal")
        # P's own fence for its stalled WRITE times out as well, and P tears D down; D starts
        # over only after that.  (Seen 4 times in 30 runs beside load: P's timer fired after D
        # had started over, and tore the new association down, whose transfer then failed.)
        await eventually(lambda: "D" not in pair.p.peers(), "P tears D down too")
        await pair.d.connect("P", timeout=2)  # a new association: P drops everything of the old one
        assert (await old_p.wait(1)).outcome in (Outcome.ABORTED, Outcome.FAILED)
        waiting = await pair.d.expect("new", 1, peer="P", block_ids=[1])
        await pair.p.kv_ready("new", 1, block_ids=[4])
        assert (await waiting.wait(5)).ok
        assert same_kv(pair.p_kv, [4], pair.d_kv, [1])
        fabric.unstall()  # the old WRITE finally runs: it was fenced and lands nowhere
        await settle(pair)
        assert same_kv(pair.p_kv, [4], pair.d_kv, [1])
        assert ledgers_empty(pair)
    finally:
        await pair.close()


@pytest.mark.asyncio
async def test_engine_ids_are_checked_where_they_are_given() -> None:
    fabric = LoopbackFabric()
    pair = await EnginePair(fabric, config=FAST).start()
    try:
        kv = KVBuffers(pair.p_kv.layout.spec, 4)
        with pytest.raises(ConfigError, match="engine id '../p' may hold only"):
            Engine("../p", kv.layout, fabric.endpoint("x"), pair.hub.channel("x"), config=FAST)
        before = pair.d.peers()
        with pytest.raises(ConfigError, match="peer 'P/0' may hold only"):
            await pair.d.connect("P/0")
        assert pair.d.peers() == before and pair.d.stats()["crashed"] == 0
    finally:
        await pair.close()


@pytest.mark.asyncio
async def test_released_and_finished_keep_only_the_newest_records_when_nobody_polls() -> None:
    config = EngineConfig(core=FAST.core, transfer_timeout=5.0, drain_timeout=2.0, results_kept=2)
    pair = await EnginePair(LoopbackFabric(), config=config).start()
    try:
        for n in range(3):
            waiting = await pair.d.expect(f"r{n}", 1, peer="P", block_ids=[n])
            sending = await pair.p.kv_ready(f"r{n}", 1, block_ids=[n])
            assert (await waiting.wait(5)).ok and (await sending.wait(5)).ok
            await settle(pair)
        assert [r.key.transfer_id for r in pair.d.finished] == ["r1", "r2"]
        assert [r.block_ids for r in pair.d.released] == [(1,), (2,)]
        assert pair.d.stats()["finished_dropped"] == 1 and pair.d.stats()["released_dropped"] == 1
        pair.d.finished.popleft()  # a poller makes room: nothing more is dropped
        waiting = await pair.d.expect("r3", 1, peer="P", block_ids=[3])
        await pair.p.kv_ready("r3", 1, block_ids=[3])
        assert (await waiting.wait(5)).ok
        assert [r.key.transfer_id for r in pair.d.finished] == ["r2", "r3"]
        assert pair.d.stats()["finished_dropped"] == 1
    finally:
        await pair.close()


def test_results_kept_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="results_kept"):
        EngineConfig(results_kept=0)


@pytest.mark.asyncio
async def test_a_failed_transfer_is_logged_by_its_ids_tag_never_by_the_id(
    pair: EnginePair, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "capability-3f9a61c0d2"  # whoever knows a transfer id can ask for its KV
    with caplog.at_level(logging.DEBUG, logger="kvflow"):
        waiting = await pair.d.expect(secret, 1, peer="P", block_ids=[1], timeout=0.1)
        assert (await waiting.wait(2)).outcome is Outcome.EXPIRED
        await settle(pair)
    said = "\n".join(record.getMessage() for record in caplog.records)
    assert f"{id_tag(secret)}@1 expired" in said and secret not in said


class Owned:
    """A transport or control channel that records being closed (and a transport that refuses
    its regions, when told to)."""

    def __init__(self, inner: Any, refuse: bool = False) -> None:
        self.inner, self.refuse, self.closed = inner, refuse, False

    def register_regions(self, regions: Any) -> None:
        if self.refuse:
            raise TransportError("this transport registers no memory")
        self.inner.register_regions(regions)

    def close(self) -> None:
        self.closed = True
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def engine_threads(name: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in (f"kvflow-writer-{name}", f"kvflow-peers-{name}")]


@pytest.mark.asyncio
async def test_an_engine_whose_start_fails_or_that_never_starts_leaves_no_thread_and_closes_what_it_owns() -> None:
    fabric, hub = LoopbackFabric(), LocalControlHub()
    layout = KVBuffers(KVSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="int8"), 4).layout
    transport, control = Owned(fabric.endpoint("E1"), refuse=True), Owned(hub.channel("E1"))
    failing = Engine("E1", layout, transport, control, config=FAST)
    with pytest.raises(TransportError, match="registers no memory"):
        await failing.start()
    assert engine_threads("E1") == [] and transport.closed and control.closed
    with pytest.raises(UsageError, match="already started"):
        await failing.start()
    await failing.aclose()  # nothing left to close, and no error
    idle_transport, idle_control = Owned(fabric.endpoint("E2")), Owned(hub.channel("E2"))
    idle = Engine("E2", layout, idle_transport, idle_control, config=FAST)
    assert engine_threads("E2") == []
    await idle.aclose()
    assert idle_transport.closed and idle_control.closed
    fabric.close()


@pytest.mark.asyncio
async def test_a_closed_engine_stops_the_threads_its_transfers_started(pair: EnginePair) -> None:
    await pair.d.expect("t", 1, peer="P", block_ids=[1])
    await pair.p.kv_ready("t", 1, peer="D", block_ids=[2])
    await eventually(lambda: not pair.p.core.live() and not pair.d.core.live(), "both transfers ended")
    assert engine_threads("P")  # the writer ran the WRITE
    await pair.close()
    assert engine_threads("P") == [] and engine_threads("D") == []


@pytest.mark.asyncio
async def test_abort_promise_and_delivered_on_a_closed_engine_say_so_instead_of_running_its_core() -> None:
    pair = await EnginePair(LoopbackFabric(), config=FAST).start()
    await pair.close()
    for call in (
        pair.p.abort("t", 1, Role.PREFILL),
        pair.p.promise("t", 1, peer="D"),
        pair.d.delivered("t", 1),
    ):
        with pytest.raises(EngineClosed, match="is closed"):
            await call
    assert pair.p.stats()["sends_failed"] == 0
