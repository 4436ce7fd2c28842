"""Descriptor planning: the byte ranges that move a set of blocks from one layout to another.

Why its own module: this is the step that runs on the writer thread for every batch, so it is
vectorised with numpy, and it is where the byte count per RDMA op is decided.  `plan_transfer`
turns (local blocks, remote blocks, layers) into descriptors and **coalesces** runs that are
contiguous on both sides into one descriptor: with vLLM's block size of 16 a long prompt
otherwise becomes tens of thousands of small RDMA ops.

Heterogeneous peers (different tensor parallelism, block sizes that are multiples): the ranks
move the KV heads both hold, and a block of the side with the smaller block size ("fine") lands
at a token offset in a block of the other ("coarse"): fine block ``i`` is tokens
``[(i % k) * fine, (i % k + 1) * fine)`` of coarse block ``i // k``, ``k`` the ratio, as vLLM
maps blocks of different sizes.  A batch of fine blocks may start inside a coarse block (P's
token budget ends a chunk there): `fine_start` says where, and the first coarse block is then
filled from that token on, the rest of it by the batch before.  Each (layer, head, fine block)
is then one run of bytes on each side (the layout keeps a head's tokens together), planned
vectorised like whole blocks and coalesced the same way.  A Mamba / linear-attention state page
between ranks of different tensor parallelism moves the runs both ranks hold
(`kvflow.layout.states`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvflow.errors import InvalidBatch, LayoutMismatch
from kvflow.layout.groups import group_of
from kvflow.layout.heads import head_runs, shared_heads
from kvflow.layout.spec import KVLayout
from kvflow.layout.states import parse_split, state_runs

__all__ = ("Descriptor", "DescriptorPlan", "plan_transfer")


@dataclass(frozen=True, slots=True)
class Descriptor:
    local_region: int
    local_offset: int
    remote_region: int
    remote_offset: int
    length: int


@dataclass(frozen=True)
class DescriptorPlan:
    """Byte ranges to move, one row per descriptor, as parallel int64 arrays."""

    local_region: npt.NDArray[np.int64]
    local_offset: npt.NDArray[np.int64]
    remote_region: npt.NDArray[np.int64]
    remote_offset: npt.NDArray[np.int64]
    length: npt.NDArray[np.int64]
    uncoalesced: int  # how many descriptors there were before coalescing

    def __len__(self) -> int:
        return int(self.length.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())

    def __iter__(self) -> Iterator[Descriptor]:
        for row in zip(
            self.local_region.tolist(),
            self.local_offset.tolist(),
            self.remote_region.tolist(),
            self.remote_offset.tolist(),
            self.length.tolist(),
            strict=True,
        ):
            yield Descriptor(*row)


def _as_block_ids(
    blocks: Sequence[int] | npt.NDArray[np.integer[Any]], num_blocks: int, side: str
) -> npt.NDArray[np.int64]:
    ids = np.asarray(blocks, dtype=np.int64).reshape(-1)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise InvalidBatch(f"{side} block id out of range 0..{num_blocks - 1}")
    return ids


def plan_transfer(
    local: KVLayout,
    remote: KVLayout,
    local_blocks: Sequence[int] | npt.NDArray[np.integer[Any]],
    remote_blocks: Sequence[int] | npt.NDArray[np.integer[Any]],
    layers: tuple[int, int] | None = None,
    *,
    coalesce: bool = True,
    fine_start: int = 0,
) -> DescriptorPlan:
    """Descriptors that move local block ``local_blocks[i]`` to/from remote block
    ``remote_blocks[i]`` in every array of every layer in ``range(*layers)`` (all layers when
    None).  With `coalesce`, runs contiguous on both sides become one descriptor.  Block sizes
    that differ: the fine blocks fill the coarse ones in order, the first at fine position
    `fine_start` of the first coarse block (0 .. ratio - 1; 0 with equal block sizes).

    :raises InvalidBatch: the block lists differ in length (or do not fill each other), are
        empty, or name a block outside its layout; `layers` is outside the model; or
        `fine_start` is outside the first coarse block.
    :raises LayoutMismatch: the two layouts' block lengths or array counts differ.
    """
    lids = _as_block_ids(local_blocks, local.num_blocks, "local")
    rids = _as_block_ids(remote_blocks, remote.num_blocks, "remote")
    first, stop = layers if layers is not None else (0, local.spec.num_layers)
    if not 0 <= first < stop <= min(local.spec.num_layers, remote.spec.num_layers):
        raise InvalidBatch(f"layers {first}..{stop} outside the model's {local.spec.num_layers} layers")
    ls, rs = local.spec, remote.spec
    group = group_of(ls.groups, (first, stop))
    if group is not None and group.state and ls.tp_size != rs.tp_size:
        return _plan_state(local, remote, lids, rids, (first, stop))
    if ls.heads != rs.heads or ls.block_size != rs.block_size:
        return _plan_sliced(local, remote, lids, rids, (first, stop), coalesce, fine_start)
    if fine_start:
        raise InvalidBatch(f"fine_start {fine_start} with equal block sizes ({ls.block_size} tokens)")
    if local.block_len != remote.block_len:
        raise LayoutMismatch("block_len", local.block_len, remote.block_len)
    if local.spec.arrays_per_layer != remote.spec.arrays_per_layer:
        raise LayoutMismatch("arrays_per_layer", local.spec.arrays_per_layer, remote.spec.arrays_per_layer)
    if lids.size != rids.size or lids.size == 0:
        raise InvalidBatch(f"need equal, non-empty block lists, got {lids.size} local and {rids.size} remote")

    pairs = [
        (la, ra)
        for layer in range(first, stop)
        for la, ra in zip(local.layer_arrays(layer), remote.layer_arrays(layer), strict=True)
    ]
    n = lids.size
    local_region = np.repeat(np.array([la.region for la, _ in pairs], dtype=np.int64), n)
    remote_region = np.repeat(np.array([ra.region for _, ra in pairs], dtype=np.int64), n)
    local_offset = np.concatenate([la.offset + lids * la.stride for la, _ in pairs])
    remote_offset = np.concatenate([ra.offset + rids * ra.stride for _, ra in pairs])
    return _coalesced(local_region, local_offset, remote_region, remote_offset, local.block_len, coalesce)


def _coalesced(
    local_region: npt.NDArray[np.int64],
    local_offset: npt.NDArray[np.int64],
    remote_region: npt.NDArray[np.int64],
    remote_offset: npt.NDArray[np.int64],
    block: int,
    coalesce: bool,
) -> DescriptorPlan:
    """Runs of `block` bytes as a plan; with `coalesce`, runs contiguous on both sides merged."""
    uncoalesced = int(local_offset.size)
    if not coalesce or uncoalesced == 1:
        length = np.full(local_offset.shape, block, dtype=np.int64)
        return DescriptorPlan(local_region, local_offset, remote_region, remote_offset, length, uncoalesced)

    order = np.lexsort((local_offset, local_region))
    local_region, local_offset = local_region[order], local_offset[order]
    remote_region, remote_offset = remote_region[order], remote_offset[order]
    continues = (
        (local_region[1:] == local_region[:-1])
        & (remote_region[1:] == remote_region[:-1])
        & (local_offset[1:] == local_offset[:-1] + block)
        & (remote_offset[1:] == remote_offset[:-1] + block)
    )
    starts = np.concatenate(([0], np.flatnonzero(~continues) + 1))
    merged_length = np.diff(np.concatenate((starts, [uncoalesced]))).astype(np.int64) * block
    return DescriptorPlan(
        local_region[starts],
        local_offset[starts],
        remote_region[starts],
        remote_offset[starts],
        merged_length,
        uncoalesced,
    )


def _plan_state(
    local: KVLayout,
    remote: KVLayout,
    lids: npt.NDArray[np.int64],
    rids: npt.NDArray[np.int64],
    layers: tuple[int, int],
) -> DescriptorPlan:
    """`plan_transfer` of state pages between ranks of different tensor parallelism: in each
    layer and block pair, the runs of the page both ranks hold (not coalesced: they are a few
    per page, and pages of one request are not side by side).

    :raises InvalidBatch: block lists of different lengths or empty, or ranks that share no
        shard of the state.
    :raises LayoutMismatch: the state cannot be sliced (no split, a split the ranks do not
        divide, several arrays per page, or a state larger than a side's page).
    """
    ls, rs = local.spec, remote.spec
    split = parse_split(ls.state_split)
    if split is None or ls.state_split != rs.state_split:
        raise LayoutMismatch("state_split", ls.state_split, rs.state_split, detail="a state page that cannot be sliced")
    if ls.arrays_per_layer != 1 or rs.arrays_per_layer != 1:
        raise LayoutMismatch(
            "arrays_per_layer", ls.arrays_per_layer, rs.arrays_per_layer, detail="a state page must be one array"
        )
    for spec in (ls, rs):
        if split.rank_bytes(spec.tp_size) > spec.block_len:
            raise LayoutMismatch("page_bytes", ls.page_bytes, rs.page_bytes, detail="the state does not fit a page")
    if lids.size != rids.size or lids.size == 0:
        raise InvalidBatch(f"need equal, non-empty block lists, got {lids.size} local and {rids.size} remote")
    runs = state_runs(split, (ls.tp_rank, ls.tp_size), (rs.tp_rank, rs.tp_size))
    if not runs:
        raise InvalidBatch(
            f"rank {ls.tp_rank} of {ls.tp_size} and rank {rs.tp_rank} of {rs.tp_size} share no shard of the state"
        )
    per_page = lids.size * len(runs)  # rows per layer, in (block, run) order

    def rows(layout: KVLayout, ids: npt.NDArray[np.int64], at: list[int]) -> tuple[Any, Any]:
        """(region, offset) of each (layer, block, run): a page's start plus the run's offset."""
        arrays = [layout.layer_arrays(layer)[0] for layer in range(*layers)]
        base = np.array([a.offset for a in arrays], dtype=np.int64)[:, None, None]
        stride = np.array([a.stride for a in arrays], dtype=np.int64)[:, None, None]
        offset = base + stride * ids[None, :, None] + np.array(at, dtype=np.int64)[None, None, :]
        region = np.repeat(np.array([a.region for a in arrays], dtype=np.int64), per_page)
        return region, offset.reshape(-1)

    local_region, local_offset = rows(local, lids, [run.local for run in runs])
    remote_region, remote_offset = rows(remote, rids, [run.remote for run in runs])
    length = np.tile(np.array([run.length for run in runs], dtype=np.int64), (layers[1] - layers[0]) * lids.size)
    return DescriptorPlan(local_region, local_offset, remote_region, remote_offset, length, int(length.size))


def _plan_sliced(
    local: KVLayout,
    remote: KVLayout,
    lids: npt.NDArray[np.int64],
    rids: npt.NDArray[np.int64],
    layers: tuple[int, int],
    coalesce: bool,
    fine_start: int,
) -> DescriptorPlan:
    """`plan_transfer` between ranks that hold different heads or use different block sizes.

    :raises InvalidBatch: the ranks share no head, the block lists do not cover each other, or
        `fine_start` is not a fine position inside a coarse block.
    :raises LayoutMismatch: block sizes that are not multiples, or layouts that cannot be sliced.
    """
    ls, rs = local.spec, remote.spec
    heads = shared_heads(ls, rs)
    if not heads:
        raise InvalidBatch(f"the ranks share no KV head (heads {ls.heads} here, {rs.heads} there)")
    fine_size, coarse_size = sorted((ls.block_size, rs.block_size))
    ratio, rest = divmod(coarse_size, fine_size)
    if rest:
        raise LayoutMismatch("block_size", ls.block_size, rs.block_size, detail="not a multiple of each other")
    local_fine = ls.block_size == fine_size
    fine_ids, coarse_ids = (lids, rids) if local_fine else (rids, lids)
    if type(fine_start) is not int or not 0 <= fine_start < ratio:
        raise InvalidBatch(f"fine_start {fine_start!r} is not a position of a {fine_size}-token block in {ratio}")
    if fine_ids.size == 0 or -(-(fine_start + fine_ids.size) // ratio) != coarse_ids.size:
        raise InvalidBatch(
            f"{fine_ids.size} blocks of {fine_size} tokens from position {fine_start} do not fill "
            f"{coarse_ids.size} blocks of {coarse_size}"
        )
    whole = ls.heads == rs.heads
    lu, ru = head_runs(local, layers, heads, whole), head_runs(remote, layers, heads, whole)
    if lu.token_bytes != ru.token_bytes or lu.base.size != ru.base.size:
        raise LayoutMismatch(
            "arrays_per_layer", ls.arrays_per_layer, rs.arrays_per_layer, detail="a head's runs differ in shape"
        )
    index = np.arange(fine_start, fine_start + fine_ids.size, dtype=np.int64)  # fine positions in coarse blocks
    token_offset = (index % ratio) * fine_size * lu.token_bytes  # where a fine block starts in its coarse one
    fine, coarse = (lu, ru) if local_fine else (ru, lu)
    fine_offset = (fine.base[:, None] + fine.stride[:, None] * fine_ids[None, :]).reshape(-1)
    coarse_offset = (
        coarse.base[:, None] + coarse.stride[:, None] * coarse_ids[index // ratio][None, :] + token_offset[None, :]
    ).reshape(-1)
    n = fine_ids.size
    fine_region, coarse_region = np.repeat(fine.region, n), np.repeat(coarse.region, n)
    if local_fine:
        return _coalesced(fine_region, fine_offset, coarse_region, coarse_offset, fine_size * lu.token_bytes, coalesce)
    return _coalesced(coarse_region, coarse_offset, fine_region, fine_offset, fine_size * lu.token_bytes, coalesce)
