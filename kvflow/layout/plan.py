"""Descriptor planning: the byte ranges that move a set of blocks from one layout to another.

Why its own module: this is the step that runs on the writer thread for every batch, so it is
vectorised with numpy, and it is where the byte count per RDMA op is decided.  `plan_transfer`
turns (local blocks, remote blocks, layers) into descriptors and **coalesces** runs that are
contiguous on both sides into one descriptor: with vLLM's block size of 16 a long prompt
otherwise becomes tens of thousands of small RDMA ops.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvflow.errors import InvalidBatch, LayoutMismatch
from kvflow.layout.spec import KVLayout

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
) -> DescriptorPlan:
    """Descriptors that move local block ``local_blocks[i]`` to/from remote block
    ``remote_blocks[i]`` in every array of every layer in ``range(*layers)`` (all layers when
    None).  With `coalesce`, runs contiguous on both sides become one descriptor.

    :raises InvalidBatch: the block lists differ in length, are empty, or name a block outside
        its layout; or `layers` is outside the model.
    :raises LayoutMismatch: the two layouts' block lengths or array counts differ.
    """
    if local.block_len != remote.block_len:
        raise LayoutMismatch("block_len", local.block_len, remote.block_len)
    if local.spec.arrays_per_layer != remote.spec.arrays_per_layer:
        raise LayoutMismatch("arrays_per_layer", local.spec.arrays_per_layer, remote.spec.arrays_per_layer)
    lids = _as_block_ids(local_blocks, local.num_blocks, "local")
    rids = _as_block_ids(remote_blocks, remote.num_blocks, "remote")
    if lids.size != rids.size or lids.size == 0:
        raise InvalidBatch(f"need equal, non-empty block lists, got {lids.size} local and {rids.size} remote")
    first, stop = layers if layers is not None else (0, local.spec.num_layers)
    if not 0 <= first < stop <= min(local.spec.num_layers, remote.spec.num_layers):
        raise InvalidBatch(f"layers {first}..{stop} outside the model's {local.spec.num_layers} layers")

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
    length = np.full(local_offset.shape, local.block_len, dtype=np.int64)
    uncoalesced = int(length.size)
    if not coalesce or uncoalesced == 1:
        return DescriptorPlan(local_region, local_offset, remote_region, remote_offset, length, uncoalesced)

    order = np.lexsort((local_offset, local_region))
    local_region, local_offset = local_region[order], local_offset[order]
    remote_region, remote_offset = remote_region[order], remote_offset[order]
    block = local.block_len
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
