"""What the GPU check moves and how long it waits: KV geometries, phase B's transfers, time limits.

Why a module of its own: the parent, which plans each phase and checks its bytes, and the
engine children, which build their KV caches, must agree on every number here; neither side
imports the other's code (a child loads no parent machinery, the parent no torch).
"""

from __future__ import annotations

from typing import Any

__all__ = (
    "BLOCKS_B",
    "B_TRANSFERS",
    "DEFAULT_SIZES_MIB",
    "PHASE_LIMITS",
    "PHASE_ORDER",
    "READY_S",
    "SPEC_B",
    "SPEC_D",
    "STALE",
    "TRANSFER_S",
    "UCX_LINES",
    "block_len",
)

# The check's KV geometry: bfloat16, 16 tokens x 8 heads x 128 dims = 32 KiB per block per array.
SPEC_B: dict[str, Any] = {"num_layers": 4, "block_size": 16, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}
BLOCKS_B = 64  # 4 layers x K,V x 64 blocks x 32 KiB = 16 MiB per side
SPEC_D: dict[str, Any] = {"num_layers": 2, "block_size": 16, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}
# phase B's transfers: (mode, P's blocks, D's blocks, seed); D's blocks are scattered
B_TRANSFERS: tuple[tuple[str, list[int], list[int], int], ...] = (
    ("push", [0, 1, 2, 3, 4], [3, 17, 18, 40, 61], 11),
    ("push", [10, 20, 30, 31, 32, 50, 63], [63, 0, 7, 8, 9, 22, 45], 12),
    ("push", list(range(5, 13)), [40, 42, 44, 46, 48, 50, 52, 54], 13),
    ("pull", [33, 34, 35], [1, 30, 60], 14),
)
STALE = 0xA5  # phase C: P's blocks hold this byte before the pattern is copied in
UCX_LINES = 200  # of each child's stderr kept in ucx.log
READY_S = 45.0  # a child not ready by then (torch, CUDA, NIXL/UCX set up) will not be
TRANSFER_S = 15.0  # a transfer's deadline: even 256 MiB over TCP takes far less; a hang fails fast
PHASE_ORDER = "ABEGVICDF"  # the phases, in the order a full run takes them
# seconds, before --limit-scale
PHASE_LIMITS = {"A": 60, "B": 90, "E": 60, "G": 90, "V": 90, "I": 60, "C": 90, "D": 150, "F": 60}
DEFAULT_SIZES_MIB = (1, 4, 16, 64, 256)  # phase D's


def block_len(spec: dict[str, Any]) -> int:
    """Bytes of one block of one K or V array (bfloat16: 2 bytes an element).  Never raises."""
    return int(spec["block_size"] * spec["num_kv_heads"] * spec["head_dim"] * 2)
