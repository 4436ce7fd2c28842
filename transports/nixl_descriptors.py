"""NIXL descriptor lists: kvflow's regions and transfer plans as the rows NIXL's calls take.

The NIXL transport (`kvflow.transports.nixl`) posts an op one of two ways:

* ``direct`` (default): descriptor lists built from kvflow's coalesced plan for each op
  (`initialize_xfer`), so a run of contiguous blocks is one descriptor (`descriptor_rows`);
* ``prepped``: per-granule descriptor lists prepared once per region and per peer
  (`prep_xfer_dlist` over `granule_rows`), ops by index (`make_prepped_xfer`); the plan's runs
  become index ranges (`granule_indices`).

Why a module of its own: this is arithmetic on arrays, with no agent, thread or lock in it:
every range checked against the region it falls in, rows built as a list or as an array,
whichever costs less on every op's path (`LIST_ROWS`), and runs turned into granule indices
without a Python loop.  The transport only hands the rows to NIXL.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvflow.errors import TransportError
from kvflow.layout import DescriptorPlan, MemoryType, Region
from kvflow.transports.base import region_address

__all__ = ("LIST_ROWS", "MEM_NAMES", "descriptor_rows", "granule_indices", "granule_rows")

MEM_NAMES = {MemoryType.DRAM: "DRAM", MemoryType.VRAM: "VRAM"}  # NIXL's name of each memory type
LIST_ROWS = 128  # descriptor rows built as a list of tuples, not an array (see `descriptor_rows`)


def descriptor_rows(
    regions: Sequence[Region],
    index: npt.NDArray[np.int64],
    offset: npt.NDArray[np.int64],
    length: npt.NDArray[np.int64],
    side: str,
) -> npt.NDArray[np.uint64] | list[tuple[int, int, int]]:
    """(address, length, device) rows, every range checked against its region: a list for up
    to `LIST_ROWS` rows (cheapest for NIXL's wrapper, and below that many rows numpy's
    per-call cost exceeds a Python loop's: 16 rows took 95 µs through numpy), an Nx3 array
    for more (vectorised checks).

    :raises TransportError: a region is not registered, or a range lies outside its region.
    """
    if len(length) <= LIST_ROWS:
        return [
            (region_address(regions, r, o, n, side), n, regions[r].device_id)
            for r, o, n in zip(index.tolist(), offset.tolist(), length.tolist(), strict=True)
        ]
    bases = np.array([r.base for r in regions], dtype=np.int64)
    sizes = np.array([r.length for r in regions], dtype=np.int64)
    devices = np.array([r.device_id for r in regions], dtype=np.int64)
    if index.min() < 0 or index.max() >= len(regions):
        raise TransportError(f"{side} region {int(index.max())} is not registered")
    if (offset < 0).any() or (length <= 0).any() or (offset + length > sizes[index]).any():
        raise TransportError(f"{side} range lies outside region {int(index[0])}")
    return np.stack([bases[index] + offset, length, devices[index]], axis=1).astype(np.uint64)


def granule_rows(regions: Sequence[Region], granule: int) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]:
    """One (address, `granule`, device) row per granule of every region, in order, and the index
    of each region's first row."""
    counts = [r.length // granule for r in regions]
    rows = np.concatenate(
        [
            np.stack(
                [
                    np.arange(c, dtype=np.uint64) * granule + r.base,
                    np.full(c, granule, dtype=np.uint64),
                    np.full(c, r.device_id, dtype=np.uint64),
                ],
                axis=1,
            )
            for r, c in zip(regions, counts, strict=True)
        ]
    )
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    return rows, starts


def granule_indices(
    plan: DescriptorPlan,
    granule: int,
    local_starts: npt.NDArray[np.int64] | None,
    remote_starts: npt.NDArray[np.int64] | None,
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """The plan's runs as indices into the local and the remote granule lists, whose regions'
    first rows are `local_starts` and `remote_starts` (from `granule_rows`).

    :raises TransportError: a run is not aligned to the granule.
    """
    if (plan.local_offset % granule).any() or (plan.remote_offset % granule).any() or (plan.length % granule).any():
        raise TransportError(f"descriptors are not aligned to the {granule}-byte granule")
    assert local_starts is not None and remote_starts is not None  # prepped mode
    counts = plan.length // granule
    steps = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    local = np.repeat(local_starts[plan.local_region] + plan.local_offset // granule, counts) + steps
    remote = np.repeat(remote_starts[plan.remote_region] + plan.remote_offset // granule, counts) + steps
    return local.astype(np.int32), remote.astype(np.int32)
