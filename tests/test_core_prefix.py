"""D holds a prefix of the KV already (vLLM's prefix cache): the core moves only the rest.

D registers the blocks after its hit and says where they start; P's batches still count
positions from 0.  P writes exactly the registered positions (per batch: a prefill may hand
its KV over chunk by chunk), skips the others without a WRITE, and an empty registration (D
holds everything P would send) releases P at once with no WRITE at all.
"""

from __future__ import annotations

import pytest

from kvflow.errors import InvalidBatch
from kvflow.protocol.actions import Action, ReleaseBlocks, Resolve, SendMessage, SubmitOp
from kvflow.protocol.core import TransferCore
from kvflow.protocol.messages import MAX_BLOCKS, Done, Message, Registration, TransferKey
from kvflow.protocol.requests import Expect, KvReady
from kvflow.protocol.state import Mode, Outcome, Role, State
from kvflow.protocol.transfer_tables import TERMINAL

KEY = TransferKey("t", 1)


def pair() -> tuple[TransferCore, TransferCore]:
    p, d = TransferCore("P", num_layers=2), TransferCore("D", num_layers=2)
    p.peer_connected("D", 0.0)
    d.peer_connected("P", 0.0)
    return p, d


def sent(actions: list[Action]) -> list[Message]:
    return [a.message for a in actions if isinstance(a, SendMessage)]


def ops(actions: list[Action]) -> list[SubmitOp]:
    return [a for a in actions if isinstance(a, SubmitOp)]


def test_a_partial_hit_writes_only_the_positions_after_it() -> None:
    p, d = pair()
    (registration,) = sent(
        d.expect(Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[20, 21], first_position=2), now=0.0, deadline=9.0)
    )
    assert registration == Registration(KEY, (20, 21), 1, 9.0, first_position=2)
    p.receive("D", registration, 0.0)
    (op,) = ops(p.kv_ready(KvReady(KEY, block_ids=[10, 11, 12, 13]), now=0.0, deadline=9.0))
    assert (op.local_blocks, op.remote_blocks) == ((12, 13), (20, 21))  # positions 0 and 1 move no byte
    p.op_submitted(op.op_id, 0.1)
    done = p.op_finished(op.op_id, 0.2)
    assert ReleaseBlocks(KEY, Role.PREFILL, (10, 11, 12, 13), Outcome.SUCCEEDED) in done
    landed = d.notification("P", op.notification, 0.3)
    assert Resolve(KEY, Role.DECODE, Outcome.SUCCEEDED, "ok") in landed


def test_batches_before_the_hit_are_skipped_and_the_writes_are_counted_per_batch() -> None:
    """P hands its KV over chunk by chunk; D's hit ends inside the second chunk: the first
    chunk needs no WRITE, the second and third are written from D's first position on, and D
    counts two WRITEs (numbered 0 and 1 in its notifications)."""
    p, d = pair()
    (registration,) = sent(
        d.expect(
            Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[20, 21, 22], expected_batches=2, first_position=3),
            now=0.0,
            deadline=9.0,
        )
    )
    p.receive("D", registration, 0.0)
    assert ops(p.kv_ready(KvReady(KEY, block_ids=[10, 11], final=False), now=0.0, deadline=9.0)) == []
    (second,) = ops(p.kv_ready(KvReady(KEY, block_ids=[12, 13], final=False, first_position=2), now=0.1))
    assert (second.local_blocks, second.remote_blocks) == ((13,), (20,))
    (third,) = ops(p.kv_ready(KvReady(KEY, block_ids=[14, 15], final=True, first_position=4), now=0.2))
    assert (third.local_blocks, third.remote_blocks) == ((14, 15), (21, 22))
    for op in (second, third):
        p.op_submitted(op.op_id, 0.3)
        p.op_finished(op.op_id, 0.4)
    assert p.ledger.held_blocks == 0 and p.machine(KEY, Role.PREFILL).state is State.WRITTEN
    d.notification("P", third.notification, 0.5)
    actions = d.notification("P", second.notification, 0.5)
    assert Resolve(KEY, Role.DECODE, Outcome.SUCCEEDED, "ok") in actions
    assert d.stats.protocol_violations == 0


@pytest.mark.parametrize("registered_first", [True, False], ids=["registered-first", "ready-first"])
def test_a_full_hit_releases_p_at_once_without_a_write(registered_first: bool) -> None:
    """D holds every position: its registration names no block and is its verdict (no Done
    follows).  P, whichever came first, releases its blocks as soon as its KV is final, with
    no WRITE, and both sides succeed; nothing waits for a deadline."""
    p, d = pair()
    d_actions = d.expect(
        Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[], expected_batches=0, first_position=4), now=0.0, deadline=9.0
    )
    assert sent(d_actions) == [Registration(KEY, (), 0, 9.0, first_position=4)]  # and no Done
    assert Resolve(KEY, Role.DECODE, Outcome.SUCCEEDED, "ok") in d_actions
    (registration,) = sent(d_actions)
    if registered_first:
        assert p.receive("D", registration, 0.0) == []
        actions = p.kv_ready(KvReady(KEY, block_ids=[10, 11], final=False), now=0.1, deadline=9.0)
        actions += p.kv_ready(KvReady(KEY, block_ids=[12, 13], first_position=2), now=0.1)
    else:
        actions = p.kv_ready(KvReady(KEY, block_ids=[10, 11, 12, 13]), now=0.1, deadline=9.0)
        assert p.ledger.held_blocks == 4
        actions = p.receive("D", registration, 0.2)
    assert ops(actions) == []
    released = [a for a in actions if isinstance(a, ReleaseBlocks)]
    assert [set(a.block_ids) for a in released] == [{10, 11, 12, 13}]
    assert Resolve(KEY, Role.PREFILL, Outcome.SUCCEEDED, "ok") in actions
    assert p.machine(KEY, Role.PREFILL).state is State.DONE and p.ledger.held_blocks == 0
    assert d.machine(KEY, Role.DECODE).state is State.NOTIFIED
    assert Done(KEY) not in sent(d.delivered(KEY, 0.3)) and d.machine(KEY, Role.DECODE).state in TERMINAL
    assert p.stats.protocol_violations == d.stats.protocol_violations == 0


def test_an_empty_registration_is_push_only_and_expects_no_write() -> None:
    _, d = pair()
    with pytest.raises(InvalidBatch, match="empty"):
        d.expect(Expect(KEY, peer="P", mode=Mode.PULL, block_ids=[], expected_batches=0), now=0.0, deadline=9.0)
    with pytest.raises(InvalidBatch, match="empty"):
        d.expect(Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[]), now=0.0, deadline=9.0)
    for position in (-1, 2**31):  # a position travels as an int32
        with pytest.raises(InvalidBatch, match="first position"):
            d.expect(
                Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[1], first_position=position), now=0.0, deadline=9.0
            )
    with pytest.raises(InvalidBatch, match="more than one message carries"):
        d.expect(Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=range(MAX_BLOCKS + 1)), now=0.0, deadline=9.0)
    assert d.machines() == [] and d.ledger.held_blocks == 0


def test_pull_reads_only_the_blocks_after_the_hit() -> None:
    p, d = TransferCore("P", num_layers=2), TransferCore("D", num_layers=2)
    d.expect(Expect(KEY, peer="P", mode=Mode.PULL, block_ids=[20], first_position=2), now=0.0, deadline=9.0)
    (ready,) = sent(p.kv_ready(KvReady(KEY, block_ids=[10, 11, 12], mode=Mode.PULL, peer="D"), now=0.0, deadline=9.0))
    (op,) = ops(d.receive("P", ready, 0.1))
    assert (op.local_blocks, op.remote_blocks) == ((20,), (12,))


def test_pull_refuses_a_ready_that_does_not_reach_past_the_hit() -> None:
    p, d = TransferCore("P", num_layers=2), TransferCore("D", num_layers=2)
    d.expect(Expect(KEY, peer="P", mode=Mode.PULL, block_ids=[20], first_position=2), now=0.0, deadline=9.0)
    (ready,) = sent(p.kv_ready(KvReady(KEY, block_ids=[10, 11], mode=Mode.PULL, peer="D"), now=0.0, deadline=9.0))
    d.receive("P", ready, 0.1)
    m = d.machine(KEY, Role.DECODE)
    assert m.outcome is Outcome.FAILED and "D expects 2..3" in m.reason
