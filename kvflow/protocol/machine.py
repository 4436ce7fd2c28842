"""Per-transfer data the table does not hold: blocks, batches, counters, deadlines.

Why separate from `state.py`: the table is about states and inputs only.  What an input *means*
for a particular transfer (is this notification the last expected one?  do P's batches cover
exactly what D registered?) depends on data kept here.  The core reads it to refine raw events
into table inputs.  Pure code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import assert_never

from kvflow.errors import InvalidBatch
from kvflow.protocol.messages import OPEN_BATCHES, TransferKey
from kvflow.protocol.state import Condition, Mode, Outcome, Role, State, initial_state

__all__ = ("Batch", "Machine", "check_block_ids", "next_batch")


def check_block_ids(block_ids: Sequence[int], what: str, *, unique: bool) -> tuple[int, ...]:
    """Validate a block id list supplied by a caller or a peer.

    :raises InvalidBatch: empty, non-integer, negative, or (with `unique`) repeated ids.
    """
    ids = tuple(block_ids)
    if not ids:
        raise InvalidBatch(f"{what}: block list is empty")
    for block in ids:
        if type(block) is not int or block < 0:
            raise InvalidBatch(f"{what}: block id {block!r} is not a non-negative int")
    if unique and len(set(ids)) != len(ids):
        raise InvalidBatch(f"{what}: block list names a block twice")
    return ids


@dataclass(slots=True)
class Batch:
    """Some of P's KV: block positions [first, first+len) for layers [layers[0], layers[1])."""

    index: int
    first: int
    block_ids: tuple[int, ...]
    layers: tuple[int, int]
    submitted: bool = False

    @property
    def stop(self) -> int:
        return self.first + len(self.block_ids)

    def overlaps(self, other: Batch) -> bool:
        return (
            self.first < other.stop
            and other.first < self.stop
            and self.layers[0] < other.layers[1]
            and other.layers[0] < self.layers[1]
        )

    @property
    def area(self) -> int:
        return len(self.block_ids) * (self.layers[1] - self.layers[0])


def next_batch(
    key: object, batches: Sequence[Batch], first: int, block_ids: tuple[int, ...], layers: tuple[int, int]
) -> Batch:
    """The batch that would follow `batches`, checked against them.

    :raises InvalidBatch: it overlaps an earlier batch.
    """
    batch = Batch(len(batches), first, block_ids, layers)
    for other in batches:
        if batch.overlaps(other):
            raise InvalidBatch(
                f"{key}: batch at positions {batch.first}..{batch.stop} layers {batch.layers} "
                f"overlaps batch {other.index}"
            )
    return batch


@dataclass(slots=True)
class Machine:
    key: TransferKey
    role: Role
    mode: Mode
    peer: str | None
    deadline: float  # the transfer's own deadline
    created: float = 0.0  # when this side opened the transfer: lease renewals stop at created + max_hold
    state: State = field(init=False)
    # decode side: own destination blocks and how many WRITE notifications complete them
    # (`OPEN_BATCHES`: as many as P's last notification says, kept in `total` once it came)
    block_ids: tuple[int, ...] = ()
    expected_batches: int = 1
    landed: set[int] = field(default_factory=set)
    total: int | None = None
    # prefill side: batches of ready KV
    batches: list[Batch] = field(default_factory=list)
    final_seen: bool = False
    # the peer's blocks: push P from D's registration, pull D from P's ready message
    remote_blocks: tuple[int, ...] | None = None
    remote_expected: int = 1
    started_locally: bool = True
    inflight: set[int] = field(default_factory=set)
    released: set[int] = field(default_factory=set)  # every block this machine gave back
    outcome: Outcome | None = None
    reason: str = ""
    timer_at: float | None = None
    timer_gen: int = 0
    finished_at: float | None = None

    def __post_init__(self) -> None:
        self.state = initial_state(self.role)

    @property
    def owner(self) -> tuple[TransferKey, Role]:
        """The ledger key of this machine's blocks."""
        return (self.key, self.role)

    def holds(self, condition: Condition) -> bool:
        """Whether `condition` of a state-triggered hop is true of this machine now."""
        if condition is Condition.NOTHING_IN_FLIGHT:
            return not self.inflight
        assert_never(condition)

    def push_mismatch(self, num_layers: int, extra: Batch | None = None, *, final: bool = False) -> str | None:
        """Why P's batches cannot fill D's registration, or None if they can (so far).

        Checked whenever either side's information changes: D registered `remote_blocks` and
        expects `remote_expected` WRITEs (`OPEN_BATCHES`: any number); P's batches (plus
        `extra`, not yet added) must tile positions x layers exactly once the last one is in
        (`final`).  Batches never overlap (`next_batch`) and stay within the registration, so
        covering the registered area is covering every block of every layer once.
        """
        if self.remote_blocks is None:
            return None
        batches = self.batches + ([extra] if extra is not None else [])
        registered = len(self.remote_blocks)
        counted = self.remote_expected != OPEN_BATCHES
        if counted and len(batches) > self.remote_expected:
            return f"P has {len(batches)} batches but D expects {self.remote_expected} writes"
        for batch in batches:
            if batch.stop > registered:
                return f"P's KV reaches block position {batch.stop} but D registered {registered} blocks"
        if final or self.final_seen:
            if counted and len(batches) != self.remote_expected:
                return f"P produced {len(batches)} batches but D expects {self.remote_expected} writes"
            if sum(b.area for b in batches) != registered * num_layers:
                return (
                    f"P's KV covers {sum(b.area for b in batches)} block-layers, D registered {registered * num_layers}"
                )
        return None

    def pull_source_blocks(self) -> tuple[int, ...]:
        """P's block ids in position order, for the pull-mode ready message."""
        blocks: list[int] = []
        for batch in sorted(self.batches, key=lambda b: b.first):
            blocks.extend(batch.block_ids)
        return tuple(blocks)
