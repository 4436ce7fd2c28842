"""Where each KV head's tokens sit in a block: one run of bytes per (layer, head, sub-array).

Why its own module: two things read a block head by head.  The planner moves the heads two
ranks of different tensor parallelism both hold, and the block of the side with the smaller
block size at a token offset in the other's (`kvflow.layout.plan`); the integrity check
hashes, on each side, the same heads and tokens from its own memory
(`kvflow.runtime.integrity`).  Both read the geometry here, from the layout's arrays and
the spec's shape, never from a transfer's descriptors.

Pure: layouts in, numpy arrays of offsets out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvflow.errors import LayoutMismatch
from kvflow.layout.spec import KVLayout, KVSpec, heads_outer

__all__ = ("HeadRuns", "head_runs", "shared_heads")


@dataclass(frozen=True)
class HeadRuns:
    """Per (layer, head, sub-array) of one side: where its run of a block starts
    (``base + block * stride``), and the bytes of one token of it."""

    region: npt.NDArray[np.int64]
    base: npt.NDArray[np.int64]
    stride: npt.NDArray[np.int64]
    token_bytes: int


def shared_heads(a: KVSpec, b: KVSpec) -> range:
    """The model's KV heads two ranks both hold (empty: none).  Never raises."""
    return range(max(a.head_start, b.head_start), min(a.heads.stop, b.heads.stop))


def head_runs(layout: KVLayout, layers: tuple[int, int], heads: range, whole: bool) -> HeadRuns:
    """Where each (layer, head in `heads`, sub-array) of `layout` sits in a block, in the same
    order on both sides.  `whole`: both sides hold the same heads, so a tokens-outside-heads
    layout moves every head of a token range at once (one unit per array).

    :raises LayoutMismatch: the layout cannot give a head's tokens as one run of bytes.
    """
    spec = layout.spec
    n_arrays, n_heads, block_len = spec.arrays_per_layer, spec.num_kv_heads, spec.block_len
    places: list[tuple[int, int]]
    if not heads_outer(spec.kv_layout):
        if not whole:
            raise LayoutMismatch(
                "kv_layout", spec.kv_layout, spec.kv_layout, detail="tokens outside heads: a head is no run of bytes"
            )
        places, per_array = [(j, 0) for j in range(n_arrays)], 1  # each array's block is [tokens, ...]
    elif n_arrays % n_heads == 0:  # one or more arrays per head (heads outside blocks: LHBNC, BHLNC)
        per_head = n_arrays // n_heads
        places = [((h - spec.head_start) * per_head + j, 0) for h in heads for j in range(per_head)]
        per_array = 1
    else:  # every array holds all the rank's heads, head-major: [heads, tokens, ...]
        share = block_len // n_heads
        places = [(j, (h - spec.head_start) * share) for h in heads for j in range(n_arrays)]
        per_array = n_heads
    token_bytes, rest = divmod(block_len, per_array * spec.block_size)
    if rest:
        raise LayoutMismatch(
            "block_len", block_len, per_array * spec.block_size, detail="a block does not split into whole tokens"
        )
    rows = [
        (array.region, array.offset + inner, array.stride)
        for layer in range(*layers)
        for array, inner in ((layout.layer_arrays(layer)[j], inner) for j, inner in places)
    ]
    region, base, stride = (np.array(column, dtype=np.int64) for column in zip(*rows, strict=True))
    return HeadRuns(region, base, stride, token_bytes)
