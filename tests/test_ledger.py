"""Sharing D's blocks between a request's pair transfers: the block ledger's share groups
(destination holds of one group may hold the same blocks; no one else may), and P positions
filling D blocks that hold several of P's (`Machine.push_mismatch` with a block ratio)."""

from __future__ import annotations

import pytest

from kvflow.errors import BlockConflict
from kvflow.protocol.ledger import BlockLedger
from kvflow.protocol.machine import Batch, Machine
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Mode, Role


def test_holds_of_one_share_group_share_blocks_and_the_last_release_frees_them() -> None:
    ledger = BlockLedger()
    for owner in ("a", "b"):
        ledger.open(owner, exclusive=True)
        ledger.add(owner, [1, 2], share="req#1")
    ledger.open("other", exclusive=True)
    with pytest.raises(BlockConflict, match="block 1 is held"):
        ledger.add("other", [1], share="req#2")
    with pytest.raises(BlockConflict):
        ledger.check_free([2])  # no group: a block held by anyone is not free
    assert ledger.release("a") == (1, 2)
    assert ledger.holder_of(1) == "b"  # still held by the group's other hold
    with pytest.raises(BlockConflict):
        ledger.add("other", [2])
    assert ledger.release("b") == (1, 2)
    assert ledger.holder_of(1) is None
    ledger.add("other", [1, 2])  # free again


def test_p_positions_fill_ds_larger_blocks_ratio_at_a_time() -> None:
    """Push with D's blocks twice P's: 5 P blocks fill 3 D blocks, also in batches that meet
    inside a D block (a chunk of P's ending there); 7 overrun them; a tiling that leaves D's
    last block out is refused."""
    m = Machine(TransferKey("t", 1), Role.PREFILL, Mode.PUSH, "d", 10.0)
    m.remote_blocks, m.remote_expected, m.span = (7, 8, 9), 2, (0, 2)
    half = [Batch(0, 0, (0, 1, 2, 3, 4), (0, 1)), Batch(1, 0, (0, 1, 2, 3, 4), (1, 2))]
    m.batches = half[:1]
    assert m.push_mismatch(half[1], final=True, ratio=2) is None
    assert "D registered 3 blocks" in str(m.push_mismatch(half[1], final=True))  # ratio 1: too many
    m.batches = [Batch(0, 0, tuple(range(7)), (0, 2))]
    assert "reaches block position 7" in str(m.push_mismatch(ratio=2))
    m.batches, m.remote_expected = [Batch(0, 0, (0,), (0, 2))], 2
    assert m.push_mismatch(Batch(1, 1, (1, 2, 3, 4), (0, 2)), final=True, ratio=2) is None
    assert "covers" in str(m.push_mismatch(Batch(1, 2, (2, 3, 4), (0, 2)), final=True, ratio=2))  # 1 missing
    m.batches, m.remote_expected = [Batch(0, 0, (0, 1, 2, 3), (0, 2))], 1
    assert "D registered 3 blocks" in str(m.push_mismatch(final=True, ratio=2))  # D's third block unfilled
