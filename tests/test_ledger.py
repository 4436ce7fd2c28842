"""The block ledger's sharing rule: destination holds of one share group (a request's pair
transfers from several tensor-parallel ranks) may hold the same blocks; no one else may."""

from __future__ import annotations

import pytest

from kvflow.errors import BlockConflict
from kvflow.protocol.ledger import BlockLedger


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
