"""Pages of strided arrays: which runs of bytes one block of one layer occupies.

Why this module: an inference engine hands kvflow its KV cache as strided views, one per layer,
whose first dimension is the block.  How the rest of a block's page sits in memory depends on
the engine's layout: with vLLM's block-compact layouts (LBHNC, LBNHC, BLHNC, BLNHC) a page is
one run of bytes whatever its inner order; with LHBNC and BHLNC the heads sit outside the
blocks, so a page is one run per head.  Read from the strides (never from a layout's name), the
runs become kvflow block arrays, and the same description serves every layout, present or
future.

Pure: shapes, strides and offsets in, block arrays out.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.errors import ConfigError
from kvflow.layout.spec import BlockArray

__all__ = ("PageRuns", "StridedPages", "page_runs")


@dataclass(frozen=True, slots=True)
class PageRuns:
    """One block's page: ``len(offsets)`` runs of ``run_bytes`` bytes, at these offsets from the
    page's first byte, in ascending order (the same order on every engine with this layout)."""

    run_bytes: int
    offsets: tuple[int, ...]

    @property
    def page_bytes(self) -> int:
        return self.run_bytes * len(self.offsets)


def page_runs(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> PageRuns:
    """The runs of bytes of one page of a strided array.

    `shape` and `strides` describe the dimensions inside one block (strides in elements, as
    torch reports them), `itemsize` is the bytes of one element.  Dimensions are merged into one
    run from the smallest stride up while each one continues the run exactly; the dimensions
    left over enumerate the runs.

    :raises ConfigError: a dimension is empty, a stride is negative, or two elements share bytes.
    """
    if len(shape) != len(strides):
        raise ConfigError(f"a page's shape {tuple(shape)} and strides {tuple(strides)} differ in length")
    if itemsize <= 0 or any(size <= 0 for size in shape) or any(stride < 0 for stride in strides):
        raise ConfigError(f"a page needs positive sizes and an item size, non-negative strides: {tuple(shape)}")
    dims = sorted((stride * itemsize, size) for size, stride in zip(shape, strides, strict=True) if size > 1)
    run = itemsize
    rest: list[tuple[int, int]] = []
    for stride, size in dims:
        if not rest and stride == run:
            run *= size
        else:
            rest.append((stride, size))
    offsets = sorted(
        sum(index * stride for index, (stride, _) in zip(indices, rest, strict=True))
        for indices in itertools.product(*(range(size) for _, size in rest))
    )
    if any(b - a < run for a, b in itertools.pairwise(offsets)):
        raise ConfigError(f"a page of shape {tuple(shape)} and strides {tuple(strides)} has elements that share bytes")
    return PageRuns(run, tuple(offsets))


@dataclass(frozen=True, slots=True)
class StridedPages:
    """Where one layer's pages are: block ``b``'s page starts ``offset + b * block_stride``
    bytes into region `region`, and is laid out as `runs` say."""

    region: int
    offset: int
    block_stride: int
    runs: PageRuns

    def block_arrays(self, layer: int, num_blocks: int) -> list[BlockArray]:
        """One kvflow block array per run of the page.

        :raises ConfigError: a run of one block overlaps a run of another.
        """
        stride, run = self.block_stride, self.runs.run_bytes
        if stride < run and num_blocks > 1:
            raise ConfigError(f"layer {layer}: blocks {stride} bytes apart overlap their {run}-byte runs")
        for a, b in itertools.combinations(self.runs.offsets, 2):
            distance = b - a  # block k's run a against block 0's run b: |distance - k * stride| >= run
            # with stride <= 0 there is one block (more were refused above): only k = 0 exists
            nearest = {distance // stride, -(-distance // stride)} if stride > 0 else set()
            for k in {0, *nearest}:
                if 0 <= k < num_blocks and abs(distance - k * stride) < run:
                    raise ConfigError(f"layer {layer}: a run of block {k} overlaps another run of block 0")
        return [BlockArray(self.region, self.offset + run, self.block_stride, layer) for run in self.runs.offsets]
