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

from kvflow.errors import ConfigError, InvalidBatch
from kvflow.layout.groups import KVGroup, group_of
from kvflow.protocol.actions import OpKind
from kvflow.protocol.messages import (
    MAX_BLOCK_ID,
    MAX_BLOCKS,
    MAX_POSITION,
    OPEN_BATCHES,
    TransferKey,
    encode_notification,
)
from kvflow.protocol.state import Condition, Mode, Outcome, Role, State, initial_state

__all__ = (
    "Batch",
    "Machine",
    "check_block_ids",
    "check_registration",
    "next_batch",
    "ready_batch",
    "transfer_layers",
)


# an op a machine calls for: its kind, local and remote blocks, layers, notification, fine start
DueOp = tuple[OpKind, tuple[int, ...], tuple[int, ...], tuple[int, int] | None, bytes, int]


def check_block_ids(block_ids: Sequence[int], what: str, *, unique: bool, allow_empty: bool = False) -> tuple[int, ...]:
    """Validate a block id list supplied by a caller or a peer.

    :raises InvalidBatch: empty (unless `allow_empty`), more than `MAX_BLOCKS`, non-integer,
        negative or above `MAX_BLOCK_ID` (what the wire carries), or (with `unique`) repeated ids.
    """
    ids = tuple(block_ids)
    if not ids and not allow_empty:
        raise InvalidBatch(f"{what}: block list is empty")
    if len(ids) > MAX_BLOCKS:
        raise InvalidBatch(f"{what}: {len(ids)} blocks, more than one message carries ({MAX_BLOCKS})")
    for block in ids:
        if type(block) is not int or not 0 <= block <= MAX_BLOCK_ID:
            raise InvalidBatch(f"{what}: block id {block!r} is not an int in 0..{MAX_BLOCK_ID}")
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


def transfer_layers(
    what: str, groups: Sequence[KVGroup], layers: tuple[int, int], mode: Mode, first_position: int = 0
) -> tuple[int, int]:
    """The layers of the transfer that moves `layers`: their KV cache group's (a transfer moves
    one group's layers with that group's blocks; a model without vLLM's hybrid manager has one
    group of every layer).  Pull moves whole groups.

    :raises InvalidBatch: `layers` is empty, outside the model or crosses groups; pull with
        part of a group; a negative first position.
    """
    group = group_of(groups, layers)
    if group is None:
        raise InvalidBatch(f"{what}: layers {layers} cross KV cache groups or lie outside the model")
    if first_position < 0:
        raise InvalidBatch(f"{what}: position {first_position} out of range")
    if mode is Mode.PULL and layers != group.layers:
        raise InvalidBatch(f"{what}: pull mode moves whole KV cache groups (layers {group.layers}), not {layers}")
    return group.layers


@dataclass(slots=True)
class Machine:
    key: TransferKey
    role: Role
    mode: Mode
    peer: str | None
    deadline: float  # the transfer's own deadline
    created: float = 0.0  # when this side opened the transfer: lease renewals stop at created + max_hold
    state: State = field(init=False)
    # decode side: own destination blocks, the block position of the first (D holds the KV of
    # the positions before: a prefix-cache hit), and how many WRITE notifications complete them
    # (`OPEN_BATCHES`: as many as P's last notification says, kept in `total` once it came)
    block_ids: tuple[int, ...] = ()
    first_position: int = 0
    expected_batches: int = 1
    landed: set[int] = field(default_factory=set)
    total: int | None = None
    # prefill side: batches of ready KV
    batches: list[Batch] = field(default_factory=list)
    final_seen: bool = False
    # the peer's blocks: push P from D's registration, pull D from P's ready message
    remote_blocks: tuple[int, ...] | None = None
    remote_first: int = 0  # push P: the block position of D's first registered block
    remote_expected: int = 1
    started_locally: bool = True
    inflight: set[int] = field(default_factory=set)
    released: set[int] = field(default_factory=set)  # every block this machine gave back
    outcome: Outcome | None = None
    reason: str = ""
    timer_at: float | None = None
    timer_gen: int = 0
    finished_at: float | None = None
    # the layers this transfer moves (one KV cache group's); None: not known yet (P, before its
    # first batch), and then the transfer has no batch whose layers would count
    span: tuple[int, int] | None = None

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
        if condition is Condition.NOTHING_WANTED:
            if self.role is Role.DECODE:
                return not self.block_ids
            return self.remote_blocks == ()
        if condition is Condition.UNCLAIMED:
            return self.peer is None
        assert_never(condition)

    def wanted(self, batch: Batch, ratio: int = 1) -> tuple[int, int] | None:
        """Push P: the block positions ``[start, stop)`` of `batch` that D registered, or None
        when D wants none of them (D holds them already, or needs nothing).  Only what D's
        registration names is ever written: P's batches count positions from 0; D's blocks
        (and its first position) hold `ratio` of P's positions each."""
        if not self.remote_blocks:
            return None
        start = max(batch.first, self.remote_first * ratio)
        stop = min(batch.stop, (self.remote_first + len(self.remote_blocks)) * ratio)
        return (start, stop) if start < stop else None

    def push_mismatch(self, extra: Batch | None = None, *, final: bool = False, ratio: int = 1) -> str | None:
        """Why P's batches cannot fill D's registration, or None if they can (so far).

        Checked whenever either side's information changes: D registered `remote_blocks` for
        positions ``remote_first..`` and expects `remote_expected` WRITEs (`OPEN_BATCHES`: any
        number), one per batch of P's (plus `extra`, not yet added) that reaches those
        positions (`wanted`); once the last batch is in (`final`), those parts must tile D's
        positions x layers exactly (the layers of the transfer's `span`).  Batches never overlap
        (`next_batch`) and stay within the registration and the span, so covering the registered
        area is covering every block of every layer once.  An empty registration wants nothing,
        so nothing of P's can mismatch it.
        `ratio`: P blocks per D block (D's block size a multiple of P's): P's positions fill
        D's blocks `ratio` at a time; a batch may start inside a D block (P's token budget ends
        a chunk there: the WRITE lands at that token offset, the batch before filled the rest),
        and D's last block may be filled in part.  The reason says it is about the two sides'
        blocks, and their ratio, so that the line logging the failure tells where to look.
        """
        layers = self.span[1] - self.span[0] if self.span is not None else 0  # no span yet: no batch
        problem = self._tiling_problem(layers, extra, final, ratio)
        if problem is None:
            return None
        sizes = f"D's blocks hold {ratio} of P's each" if ratio > 1 else "blocks of one size"
        return f"P's KV does not fill D's registered blocks ({sizes}): {problem}"

    def _tiling_problem(self, num_layers: int, extra: Batch | None, final: bool, ratio: int) -> str | None:
        """`push_mismatch`'s checks, the reason without its context."""
        if not self.remote_blocks:
            return None
        batches = self.batches + ([extra] if extra is not None else [])
        registered = len(self.remote_blocks)
        stop = self.remote_first + registered
        spans = [(b, span) for b in batches if (span := self.wanted(b, ratio)) is not None]
        counted = self.remote_expected != OPEN_BATCHES
        if counted and len(spans) > self.remote_expected:
            return f"P has {len(spans)} batches for D's blocks but D expects {self.remote_expected} writes"
        for batch in batches:
            if batch.stop > stop * ratio:
                return (
                    f"P's KV reaches block position {batch.stop} but D registered {registered} blocks "
                    f"(positions up to {stop * ratio})"
                )
        if final or self.final_seen:
            if counted and len(spans) != self.remote_expected:
                return f"P produced {len(spans)} batches for D's blocks but D expects {self.remote_expected} writes"
            reached = max((hi for _, (_, hi) in spans), default=self.remote_first * ratio)
            covered = sum((hi - lo) * (b.layers[1] - b.layers[0]) for b, (lo, hi) in spans)
            if -(-reached // ratio) != stop or covered != (reached - self.remote_first * ratio) * num_layers:
                return (
                    f"P's KV covers {covered} block-layers up to position {reached}, D registered {registered} blocks"
                )
        return None

    def due_ops(self, ratio: int, num_layers: int) -> list[DueOp]:
        """The ops this machine's batches call for that were not submitted yet, each batch then
        marked submitted: push P, a WRITE of each batch's positions D registered (`ratio`: P's
        blocks per D block), with the notification D counts it by; pull D, its READ of its
        registered blocks (of its KV cache group's layers).  None before the peer's blocks are
        known.  Layers are None when they are all `num_layers` of the model."""
        remote_blocks, due = self.remote_blocks, []
        if remote_blocks is None:
            return []
        writes = 0  # push: the WRITEs of the batches before; D counts them by this ordinal
        for batch in self.batches:
            span = self.wanted(batch, ratio) if self.mode is Mode.PUSH else (batch.first, batch.stop)
            if span is None:  # D holds these positions already: no bytes, no WRITE
                batch.submitted = True
                continue
            writes += 1
            if batch.submitted:
                continue
            batch.submitted = True
            if self.mode is Mode.PUSH:
                start, stop = span  # P positions; D's blocks hold `ratio` of them each
                local = batch.block_ids[start - batch.first : stop - batch.first]
                remote = remote_blocks[start // ratio - self.remote_first : -(-stop // ratio) - self.remote_first]
                layers = None if batch.layers == (0, num_layers) else batch.layers
                note = encode_notification(self.key, writes - 1, self.final_seen and batch is self.batches[-1])
                due.append((OpKind.WRITE, local, remote, layers, note, start % ratio))
            else:
                layers = None if self.span in (None, (0, num_layers)) else self.span
                due.append((OpKind.READ, self.block_ids, remote_blocks, layers, b"", 0))
        return due

    def pull_source_blocks(self) -> tuple[tuple[int, ...], int]:
        """P's block ids in position order, and the position of the first, for the pull-mode
        ready message (a sliding-window group holds only the positions in its window)."""
        batches = sorted(self.batches, key=lambda b: b.first)
        blocks: list[int] = []
        for batch in batches:
            blocks.extend(batch.block_ids)
        return tuple(blocks), batches[0].first if batches else 0


def check_registration(
    key: TransferKey, block_ids: Sequence[int], mode: Mode, expected_batches: int, first_position: int, max_batches: int
) -> tuple[int, ...]:
    """D's registration checked before anything changes: its block ids.

    :raises InvalidBatch: the block list is empty in pull mode (or with WRITEs expected),
        repeats a block, or has a bad id; a first position outside 0..`MAX_POSITION`.
    :raises ConfigError: a bad batch count.
    """
    ids = check_block_ids(block_ids, f"expect {key}", unique=True, allow_empty=mode is Mode.PUSH)
    if type(first_position) is not int or not 0 <= first_position <= MAX_POSITION:
        raise InvalidBatch(f"expect {key}: first position {first_position!r} is not an int in 0..{MAX_POSITION}")
    if not ids and expected_batches != 0:
        raise InvalidBatch(f"expect {key}: block list is empty, but {expected_batches} WRITEs are expected")
    open_count = expected_batches == OPEN_BATCHES and mode is Mode.PUSH
    if ids and (
        not (open_count or 1 <= expected_batches <= max_batches) or (mode is Mode.PULL and expected_batches != 1)
    ):
        raise ConfigError(
            f"expected_batches must be 1..{max_batches} or OPEN_BATCHES (push), 1 in pull mode; got {expected_batches}"
        )
    return ids


def ready_batch(
    key: TransferKey,
    m: Machine | None,
    block_ids: tuple[int, ...],
    first: int,
    layers: tuple[tuple[int, int], tuple[int, int]],
    max_batches: int,
    pull_final: bool,
) -> Batch:
    """P's next batch of transfer `key` (`m`: its machine, if it has one), checked against the
    batches before it.  `layers`: the batch's, and its KV cache group's; `pull_final`: the
    batch completes a pull transfer's KV.

    :raises InvalidBatch: the layers are in another group than the transfer's; more than
        `max_batches` batches; it overlaps an earlier one; a pull transfer's batches leave a gap.
    """
    span, group = layers
    if m is not None and m.span not in (None, group):
        raise InvalidBatch(f"kv_ready {key}: layers {span} are not in the transfer's KV cache group {m.span}")
    batches = m.batches if m is not None else []
    if len(batches) >= max_batches:
        raise InvalidBatch(f"kv_ready {key}: more than {max_batches} batches")
    batch = next_batch(key, batches, first, block_ids, span)
    if pull_final:
        staged = sorted([*batches, batch], key=lambda b: b.first)
        if any(a.stop != b.first for a, b in zip(staged, staged[1:], strict=False)):
            raise InvalidBatch(f"kv_ready {key}: pull batches must cover their positions without gaps")
    return batch
