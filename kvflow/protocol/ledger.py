"""The block ledger: which transfer holds which KV blocks, and the rule that each hold ends once.

Why a ledger separate from the state machine: the table decides *when* a transfer releases;
the ledger makes sure that a release happens exactly once and that no destination block is
handed to two transfers at the same time, including a block still quarantined because a
peer's WRITE might land in it.  A violation raises here instead of silently corrupting KV.

Destination blocks (the ones a WRITE or READ lands in) are held *exclusively*.  Source blocks
may be shared: with prefix caching two prefill requests can hold the same physical block, so
source holds only count.  One exception: holds that name the same *share* group may hold the
same destination blocks: transfers from several tensor-parallel ranks of a peer each write
their own KV heads into one request's blocks (disjoint bytes, planned by `kvflow.layout.plan`).

Pure code: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from kvflow.errors import BlockConflict, LedgerError

__all__ = ("BlockLedger",)


@dataclass(slots=True)
class _Hold:
    exclusive: bool
    blocks: dict[int, None] = field(default_factory=dict)  # insertion-ordered set
    quarantined: bool = False
    share: str = ""  # holds with the same non-empty share group may hold the same blocks


class BlockLedger:
    """Holds keyed by an opaque hashable (the core uses (transfer key, role))."""

    def __init__(self) -> None:
        self._holds: dict[Hashable, _Hold] = {}
        self._exclusive_owner: dict[int, Hashable] = {}
        self._co_owners: dict[int, list[Hashable]] = {}  # a shared block's other holders

    def open(self, owner: Hashable, *, exclusive: bool) -> None:
        """Start an (empty) hold for `owner`.

        :raises LedgerError: `owner` already has a hold.
        """
        if owner in self._holds:
            raise LedgerError(f"{owner!r} already holds blocks")
        self._holds[owner] = _Hold(exclusive)

    def check_free(self, blocks: Iterable[int], share: str = "") -> None:
        """:raises BlockConflict: a block is held exclusively by someone outside the share group
        `share` (nothing changes)."""
        for block in blocks:
            holder = self._exclusive_owner.get(block)
            if holder is not None and not (share and self._holds[holder].share == share):
                state = "quarantined" if self._holds[holder].quarantined else "held"
                raise BlockConflict(f"block {block} is {state} by transfer {holder!r}")

    def add(self, owner: Hashable, blocks: Iterable[int], share: str = "") -> None:
        """Add blocks to `owner`'s hold (a source block listed twice is held once); `share`
        names the group whose exclusive holds may hold the same blocks (the first add decides).

        :raises LedgerError: `owner` has no hold.
        :raises BlockConflict: an exclusive hold would share a block (nothing changes).
        """
        hold = self._hold(owner)
        blocks = list(blocks)
        if hold.exclusive:
            hold.share = hold.share or share
            self.check_free(blocks, hold.share)
            if len(set(blocks)) != len(blocks):
                raise BlockConflict(f"block list for {owner!r} names a block twice")
            for block in blocks:
                if self._exclusive_owner.setdefault(block, owner) != owner:
                    self._co_owners.setdefault(block, []).append(owner)
        hold.blocks.update(dict.fromkeys(blocks))

    def quarantine(self, owner: Hashable) -> None:
        """Mark `owner`'s blocks as waiting for a peer's fence.

        :raises LedgerError: `owner` has no hold.
        """
        self._hold(owner).quarantined = True

    def release(self, owner: Hashable) -> tuple[int, ...]:
        """End `owner`'s hold and return its blocks.

        :raises LedgerError: `owner` has no hold (never opened, or already released).
        """
        hold = self._holds.pop(owner, None)
        if hold is None:
            raise LedgerError(f"{owner!r} released blocks it does not hold (double release?)")
        if hold.exclusive:
            for block in hold.blocks:
                others = self._co_owners.get(block, [])
                if owner in others:
                    others.remove(owner)
                elif others:
                    self._exclusive_owner[block] = others.pop(0)
                else:
                    del self._exclusive_owner[block]
                if not others:
                    self._co_owners.pop(block, None)
        return tuple(hold.blocks)

    def holds(self, owner: Hashable) -> bool:
        return owner in self._holds

    def blocks_of(self, owner: Hashable) -> tuple[int, ...]:
        return tuple(self._hold(owner).blocks)

    def holder_of(self, block: int) -> Hashable | None:
        """The exclusive holder of a destination block, if any."""
        return self._exclusive_owner.get(block)

    @property
    def held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._holds.values())

    @property
    def quarantined_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._holds.values() if h.quarantined)

    def __len__(self) -> int:
        return len(self._holds)

    def _hold(self, owner: Hashable) -> _Hold:
        try:
            return self._holds[owner]
        except KeyError:
            raise LedgerError(f"{owner!r} holds no blocks") from None
