"""Two pure cores and what one peer can do to the other: whose verdict a written transfer gets
when D gives up first or is lost, and how far one peer's quotas reach (also between engines)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvflow.errors import BlockConflict
from kvflow.protocol.actions import Action, ReleaseBlocks, Resolve, SendMessage, SubmitOp
from kvflow.protocol.core import CoreConfig, TransferCore
from kvflow.protocol.messages import Message, Notice, Quiesced, Ready, Registration, TransferKey
from kvflow.protocol.requests import Expect, KvReady
from kvflow.protocol.state import Mode, Outcome, Role, State
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.transports.loopback import FaultPlan, LoopbackFabric
from kvflow_tools.testing import SMALL_SPEC, EnginePair, KVBuffers, same_kv
from tests.waiting import eventually

KEY = TransferKey("r", 1)
CONFIG = CoreConfig(fence_timeout=2.0, retention=30.0)


def messages(actions: list[Action]) -> list[Message]:
    return [a.message for a in actions if isinstance(a, SendMessage)]


def verdicts(actions: list[Action]) -> list[tuple[Role, Outcome]]:
    return [(a.role, a.outcome) for a in actions if isinstance(a, Resolve)]


def written_push() -> tuple[TransferCore, TransferCore, bytes]:
    """D registered, P wrote everything and its WRITE completed; the notification is on its way."""
    p, d = TransferCore("P", 2, CONFIG), TransferCore("D", 2, CONFIG)
    d.peer_connected("P", 0.0)
    p.peer_connected("D", 0.0)
    (registration,) = messages(d.expect(Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[1, 2]), now=0.0, deadline=5.0))
    p.receive("D", registration, 0.1)
    (op,) = [
        a
        for a in p.kv_ready(KvReady(KEY, block_ids=[7, 8], peer="D"), now=0.2, deadline=30.0)
        if isinstance(a, SubmitOp)
    ]
    p.op_submitted(op.op_id, 0.3)
    finished = p.op_finished(op.op_id, 0.4)
    assert verdicts(finished) == []  # written, and P's blocks are back, but the verdict is D's
    assert p.machine(KEY, Role.PREFILL).state is State.WRITTEN
    return p, d, op.notification


def test_prefill_succeeds_only_on_decodes_word() -> None:
    p, d, note = written_push()
    landed = d.notification("P", note, 1.0)
    assert verdicts(landed) == [(Role.DECODE, Outcome.SUCCEEDED)]
    (done,) = messages(landed)
    assert verdicts(p.receive("D", done, 1.1)) == [(Role.PREFILL, Outcome.SUCCEEDED)]


def test_decode_expired_first_so_both_sides_fail() -> None:
    p, d, note = written_push()
    # D was stopped past its deadline: the notification is handled after it, before any timer
    # ran.  The deadline counts first, so D expires, and P, told so, does not claim success.
    late = d.notification("P", note, 6.0)
    assert verdicts(late) == [(Role.DECODE, Outcome.EXPIRED)]
    answer = p.receive("D", messages(late)[0], 1.5)  # each host has its own clock
    assert verdicts(answer) == [(Role.PREFILL, Outcome.FAILED)]
    assert "expired" in p.machine(KEY, Role.PREFILL).reason
    for message in messages(answer):  # P's fence lets D release its quarantined blocks
        d.receive("P", message, 6.2)
    assert d.ledger.held_blocks == 0 and p.ledger.held_blocks == 0


def test_prefill_that_loses_decode_before_its_word_reports_failure() -> None:
    p, _, _ = written_push()
    assert verdicts(p.peer_lost("D", 3.0)) == [(Role.PREFILL, Outcome.FAILED)]
    assert "before its verdict" in p.machine(KEY, Role.PREFILL).reason


def test_a_silent_peers_late_writes_keep_decodes_blocks_quarantined_until_it_is_fenced() -> None:
    """Lost while its WRITE may still be held by a dead link: D's transfer fails at once, but its
    blocks go back only when the driver says nothing of the peer can land any more."""
    p, d, _ = written_push()
    lost = d.peer_lost("P", 3.0, unfenced=True)
    assert verdicts(lost) == [(Role.DECODE, Outcome.FAILED)]
    assert not [a for a in lost if isinstance(a, ReleaseBlocks)]
    assert d.ledger.quarantined_blocks == 2 and d.unfenced("P")
    with pytest.raises(BlockConflict):  # the blocks cannot go to another transfer meanwhile
        d.expect(Expect(TransferKey("next", 1), peer="P", mode=Mode.PUSH, block_ids=[2]), now=3.1, deadline=9.0)
    assert d.peer_fenced("Q") == []  # another peer's fence releases nothing
    (released,) = d.peer_fenced("P")
    assert isinstance(released, ReleaseBlocks)
    assert released.block_ids == (1, 2) and released.outcome is Outcome.FAILED
    assert d.ledger.held_blocks == 0 and not d.unfenced("P") and d.peer_fenced("P") == []
    # P initiated the WRITE: its own blocks never wait for D's fence
    assert p.peer_lost("D", 3.0, unfenced=True) and p.ledger.held_blocks == 0 and not p.unfenced("D")


def test_prefill_without_decodes_word_within_the_fence_timeout_reports_failure() -> None:
    p, _, _ = written_push()
    assert verdicts(p.timer(0.4 + CONFIG.fence_timeout)) == [(Role.PREFILL, Outcome.FAILED)]
    assert "no verdict" in p.machine(KEY, Role.PREFILL).reason


# ------------------------------------------------------------------ per-peer quotas

QUOTA = CoreConfig(fence_timeout=2.0, retention=30.0, max_unstarted=8, max_peer_transfers=4, max_peer_early=4)


def register(p: TransferCore, peer: str, tid: str, blocks: int = 1, now: float = 0.0) -> list[Message]:
    reg = Registration(TransferKey(tid, 1), tuple(range(blocks)), 1, 30.0)
    return messages(p.receive(peer, reg, now))


def test_a_greedy_peer_cannot_use_up_the_registrations_of_others() -> None:
    p = TransferCore("P", 2, QUOTA)
    answers = [register(p, "G", f"g{i}") for i in range(QUOTA.max_unstarted)]  # all P keeps for everyone
    live = len(p.live())
    # another peer's transfer is still served: registered, then written
    assert register(p, "D", "d") == [] and len(p.live()) == live + 1
    actions = p.kv_ready(KvReady(TransferKey("d", 1), block_ids=[5], peer="D"), now=1.0, deadline=30.0)
    assert [a.peer for a in actions if isinstance(a, SubmitOp)] == ["D"]
    # the greedy peer got its quota, and each refusal names it
    assert [bool(a) for a in answers] == [i >= QUOTA.max_peer_transfers for i in range(QUOTA.max_unstarted)]
    refusals = [a[0] for a in answers if a]
    assert all(isinstance(n, Notice) and "max_peer_transfers" in n.reason for n in refusals)
    assert p.stats.over_quota == len(refusals)


def test_a_registration_beyond_the_peers_block_quota_is_refused_and_changes_nothing_else() -> None:
    config = CoreConfig(fence_timeout=2.0, retention=30.0, max_peer_blocks=10)
    p = TransferCore("P", 2, config)
    assert register(p, "G", "a", blocks=6) == []
    before = [(m.key, m.state) for m in p.machines()]
    notice, fence = register(p, "G", "b", blocks=5)
    assert isinstance(notice, Notice) and "max_peer_blocks" in notice.reason and isinstance(fence, Quiesced)
    assert [(m.key, m.state) for m in p.machines()] == before and p.stats.over_quota == 1
    assert register(p, "D", "c", blocks=10) == []  # another peer has its own quota
    # a registration for a transfer P started itself fails that transfer, naming the quota
    p.kv_ready(KvReady(TransferKey("e", 1), block_ids=[1], peer="G"), now=0.0, deadline=30.0)
    notice, _ = register(p, "G", "e", blocks=5)
    assert isinstance(notice, Notice) and "max_peer_blocks" in notice.reason
    assert p.machine(TransferKey("e", 1), Role.PREFILL).outcome is Outcome.FAILED


def test_a_greedy_peers_early_messages_cannot_push_out_anothers() -> None:
    d = TransferCore("D", 2, QUOTA)
    d.peer_connected("P", 0.0)
    # P is ready before D allocates: its ready message is held until D does
    assert d.receive("P", Ready(KEY, (7,)), 0.0) == []
    for i in range(2 * QUOTA.max_unstarted):  # notices about transfers D never heard of
        d.receive("G", Notice(TransferKey(f"g{i}", 1), Outcome.ABORTED, "spam"), 0.1)
    actions = d.expect(Expect(KEY, peer="P", mode=Mode.PULL, block_ids=[1]), now=0.2, deadline=10.0)
    assert [a.remote_blocks for a in actions if isinstance(a, SubmitOp)] == [(7,)]  # P's ready was kept
    assert d.store.early.count_from("G") == (QUOTA.max_peer_early, 0)
    assert d.stats.over_quota == 2 * QUOTA.max_unstarted - QUOTA.max_peer_early


def test_a_notice_over_the_early_quota_still_withdraws_the_ready_it_follows() -> None:
    d = TransferCore("D", 2, CoreConfig(fence_timeout=2.0, retention=30.0, max_peer_early=1))
    d.peer_connected("P", 0.0)
    d.receive("P", Ready(KEY, (7,)), 0.0)  # held: the peer's one early message
    # P gave up before D allocated; D answers that nothing is in flight, so P reuses block 7
    assert messages(d.receive("P", Notice(KEY, Outcome.EXPIRED, "deadline"), 0.1)) == [Quiesced(KEY)]
    actions = d.expect(Expect(KEY, peer="P", mode=Mode.PULL, block_ids=[1]), now=0.2, deadline=10.0)
    assert [a for a in actions if isinstance(a, SubmitOp)] == []  # block 7 is not read
    assert verdicts(actions) == [(Role.DECODE, Outcome.FAILED)]


@pytest.mark.asyncio
async def test_between_engines_a_greedy_decode_cannot_fail_anothers_transfers() -> None:
    config = EngineConfig(core=QUOTA, transfer_timeout=30.0, drain_timeout=0.5)
    fabric = LoopbackFabric()
    pair = await EnginePair(fabric, config=config).start()
    greedy = Engine("G", KVBuffers(SMALL_SPEC, 32).layout, fabric.endpoint("G"), pair.hub.channel("G"), config=config)
    await greedy.start()
    try:
        await greedy.connect("P", timeout=5)
        # G registers as many transfers as P keeps for all peers together, and never needs them
        hogs = [await greedy.expect(f"g{i}", 1, peer="P", block_ids=[i]) for i in range(QUOTA.max_unstarted)]

        def answered(registrations: int) -> Callable[[], bool]:
            stats = pair.p.stats
            return lambda: stats()["live_transfers"] + stats()["rejected_registrations"] == registrations

        await eventually(answered(QUOTA.max_unstarted), "P answered every registration of G")
        pair.p_kv.fill([9], seed=4)
        waiting = await pair.d.expect("d", 1, peer="P", block_ids=[1])
        await eventually(answered(QUOTA.max_unstarted + 1), "P answered D's registration")  # before P starts
        sending = await pair.p.kv_ready("d", 1, block_ids=[9])
        assert (await waiting.wait(5)).ok and (await sending.wait(5)).ok
        assert same_kv(pair.p_kv, [9], pair.d_kv, [1])
        refused = [await hog.wait(5) for hog in hogs[QUOTA.max_peer_transfers :]]
        assert all(r.outcome is Outcome.FAILED and "max_peer_transfers" in r.reason for r in refused)
        assert pair.p.stats()["over_quota"] == len(refused)
    finally:
        await greedy.aclose(drain_timeout=0.1)
        await pair.close()


def test_a_prefill_stopped_past_its_fence_timeout_still_takes_decodes_verdict() -> None:
    p, d, note = written_push()
    (done,) = messages(d.notification("P", note, 1.0))
    # P was stopped while D's acknowledgement waited in its queue; P's own timer has not run
    assert verdicts(p.receive("D", done, 0.4 + 3 * CONFIG.fence_timeout)) == [(Role.PREFILL, Outcome.SUCCEEDED)]


def writing_push(
    expected: int = 1, batches: int = 1, final: bool = True
) -> tuple[TransferCore, TransferCore, list[SubmitOp]]:
    """D registered for `expected` WRITEs; P submitted one per batch; none completed here yet."""
    p, d = TransferCore("P", 2, CONFIG), TransferCore("D", 2, CONFIG)
    d.peer_connected("P", 0.0)
    p.peer_connected("D", 0.0)
    (registration,) = messages(
        d.expect(
            Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[1, 2], expected_batches=expected), now=0.0, deadline=5.0
        )
    )
    p.receive("D", registration, 0.1)
    ops: list[SubmitOp] = []
    for i in range(batches):
        last = final and i == batches - 1
        size = 2 // batches
        ids = [7 + i * size + j for j in range(size)]
        actions = p.kv_ready(
            KvReady(KEY, block_ids=ids, first_position=i * size, final=last, peer="D"), now=0.2, deadline=30.0
        )
        ops += [a for a in actions if isinstance(a, SubmitOp)]
    for op in ops:
        p.op_submitted(op.op_id, 0.3)
    return p, d, ops


def test_decodes_done_before_the_writes_local_completion_is_kept() -> None:
    """D counts the notification and answers Done before P's loop sees its own WRITE complete
    (shared memory): the Done is neither a violation nor lost, and the blocks stay held until
    the WRITE completes here; then P succeeds as if the Done had come after."""
    p, d, (op,) = writing_push()
    (done,) = messages(d.notification("P", op.notification, 0.35))
    early = p.receive("D", done, 0.36)
    assert early == [] and p.stats.protocol_violations == 0
    assert p.machine(KEY, Role.PREFILL).state is State.CONFIRMED
    assert p.ledger.held_blocks == 2  # the transport may still hold the WRITE
    finished = p.op_finished(op.op_id, 0.4)
    assert verdicts(finished) == [(Role.PREFILL, Outcome.SUCCEEDED)]
    assert ReleaseBlocks(KEY, Role.PREFILL, (7, 8), Outcome.SUCCEEDED) in finished
    assert p.machine(KEY, Role.PREFILL).state is State.DONE and p.ledger.held_blocks == 0
    assert p.timer(40.0) == []  # no stale "no verdict" failure later


def test_done_waits_for_every_batchs_local_completion() -> None:
    """Two batches, two WRITEs: D's Done (after both notifications) reaches P while both are
    still in flight here; the first completion releases nothing, the last one finishes."""
    p, d, (first, second) = writing_push(expected=2, batches=2)
    d.notification("P", first.notification, 0.35)
    (done,) = messages(d.notification("P", second.notification, 0.36))
    assert p.receive("D", done, 0.37) == []
    assert p.op_finished(first.op_id, 0.4) == [] and p.ledger.held_blocks == 2
    finished = p.op_finished(second.op_id, 0.5)
    assert verdicts(finished) == [(Role.PREFILL, Outcome.SUCCEEDED)]
    assert ReleaseBlocks(KEY, Role.PREFILL, (7, 8), Outcome.SUCCEEDED) in finished


def test_done_before_the_last_unwanted_batch() -> None:
    """D registered one block for one WRITE; P's second batch covers positions D holds.  D's
    Done comes before P's WRITE completes and before P's prefill finished: P finishes on the
    completion, and the late batch goes straight back."""
    p, d = TransferCore("P", 2, CONFIG), TransferCore("D", 2, CONFIG)
    d.peer_connected("P", 0.0)
    p.peer_connected("D", 0.0)
    (registration,) = messages(d.expect(Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[1]), now=0.0, deadline=5.0))
    p.receive("D", registration, 0.1)
    (op,) = [
        a for a in p.kv_ready(KvReady(KEY, block_ids=[7], final=False, peer="D"), now=0.2) if isinstance(a, SubmitOp)
    ]
    p.op_submitted(op.op_id, 0.3)
    (done,) = messages(d.notification("P", op.notification, 0.35))
    assert p.receive("D", done, 0.36) == [] and p.stats.protocol_violations == 0
    assert verdicts(p.op_finished(op.op_id, 0.4)) == [(Role.PREFILL, Outcome.SUCCEEDED)]
    late = p.kv_ready(KvReady(KEY, block_ids=[9], first_position=1), now=0.5)
    assert ReleaseBlocks(KEY, Role.PREFILL, (9,), Outcome.SUCCEEDED) in late and p.ledger.held_blocks == 0


def test_decodes_failure_while_writing_waits_for_the_drain() -> None:
    """D gave up while P's WRITE is in flight: P fails at once but keeps its blocks until the
    WRITE completes, then fences D."""
    p, _, (op,) = writing_push()
    failed = p.receive("D", Notice(KEY, Outcome.FAILED, "boom"), 0.35)
    assert verdicts(failed) == [(Role.PREFILL, Outcome.FAILED)] and p.ledger.held_blocks == 2
    drained = p.op_finished(op.op_id, 0.4)
    assert Quiesced(KEY) in messages(drained) and p.ledger.held_blocks == 0


@pytest.mark.asyncio
async def test_between_engines_decodes_done_before_the_writes_completion() -> None:
    """The loopback fabric reports P's WRITE complete only after D answered: P takes D's Done
    while still writing, keeps its blocks until the completion comes, then succeeds."""
    config = EngineConfig(core=CONFIG, transfer_timeout=30.0, drain_timeout=0.5)
    fabric = LoopbackFabric(faults=FaultPlan(late_completions=True))
    pair = await EnginePair(fabric, config=config).start()
    try:
        pair.p_kv.fill([9, 10], seed=5)
        waiting = await pair.d.expect("r", 1, peer="P", block_ids=[1, 2])
        await eventually(lambda: pair.p.stats()["live_transfers"] == 1, "P heard D's registration")
        sending = await pair.p.kv_ready("r", 1, block_ids=[9, 10])
        assert (await waiting.wait(5)).ok and same_kv(pair.p_kv, [9, 10], pair.d_kv, [1, 2])
        machine = pair.p.core.machine(KEY, Role.PREFILL)
        await eventually(
            lambda: machine.state is State.CONFIRMED or pair.p.stats()["protocol_violations"] > 0,
            "P heard D's Done",
        )
        assert pair.p.stats()["held_blocks"] == 2  # the WRITE's completion has not come yet
        assert fabric.release_completions() == 1
        result = await sending.wait(5)
        assert result.ok, result
        assert pair.p.stats()["protocol_violations"] == 0 and pair.p.stats()["held_blocks"] == 0
    finally:
        await pair.close()


def test_a_peer_event_the_table_refuses_in_this_state_changes_nothing_and_is_counted() -> None:
    """The inbox asks the table before it changes anything of a machine: a Ready reaching a
    pull D in a state whose row refuses it (here: failing, with no remote blocks yet) leaves
    the machine as it was, instead of recording P's blocks and then failing in the table."""
    from kvflow.protocol.core import TransferCore
    from kvflow.protocol.messages import Ready, TransferKey
    from kvflow.protocol.state import Mode, Role, State

    d = TransferCore("D", num_layers=2)
    d.peer_connected("P", 0.0)
    key = TransferKey("t", 1)
    d.expect(Expect(key, peer="P", mode=Mode.PULL, block_ids=[3, 4]), now=0.0, deadline=60.0)
    m = d.machine(key, Role.DECODE)
    m.state = State.FAILING  # a state no reachable path gives it without P's blocks: forced
    assert d.receive("P", Ready(key, (7, 8)), 1.0) == []
    assert d.stats.protocol_violations == 1
    assert m.state is State.FAILING and m.remote_blocks is None and m.batches == []
