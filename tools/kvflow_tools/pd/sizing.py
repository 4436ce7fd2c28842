"""How big the emulated engines are: the stand-in's KV geometry and each engine's block count.

Why: a P or D engine of the real model on its GPUs holds millions of tokens of KV; this machine
holds a few GiB.  The stand-in keeps the model's layers, the block size and one GPU's share of
the KV heads (so a request's pages and descriptors are as many as on one GPU of the real
engine) and shrinks only the bytes of a page by a printed factor.  Each engine gets the blocks
the real GPU would hold (HBM·0.9 − weights/TP − a reserve), unless the workload can never use
them all, in which case it gets what the workload could use at most and the results say that
the real capacity does not bind.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.errors import ConfigError
from kvflow_tools.standin.model import ModelShape
from kvflow_tools.standin.timing import StepModel

__all__ = ("BLOCK_SIZE", "STANDIN_BLOCK", "Sizing", "size")

BLOCK_SIZE = 16  # vLLM's default block size on CUDA: the real engines' capacity is in these
# the stand-in's blocks: vLLM's NIXL connectors on the CPU platform use its CPU attention backend,
# whose kernels need multiples of 32 (so a request has half the descriptors it has on a GPU)
STANDIN_BLOCK = 32
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization
RESERVE_GB = 4.0  # activations, CUDA graphs, NCCL buffers: an assumption, printed


@dataclass(frozen=True)
class Sizing:
    """The stand-in geometry and the engines' blocks."""

    shape: ModelShape
    scale: float  # real KV bytes per token on one GPU / the stand-in's
    real_blocks: int  # what one engine of the real model on its GPUs holds, in `STANDIN_BLOCK`s
    p_blocks: int
    d_blocks: int
    binds: bool  # the workload could need more blocks than the real engines hold

    @property
    def emulated_bytes_per_token(self) -> int:
        s = self.shape
        return 2 * s.layers * s.kv_heads * s.head_dim * 2

    def resident_bytes(self) -> int:
        return (self.p_blocks + self.d_blocks) * STANDIN_BLOCK * self.emulated_bytes_per_token


def size(
    model: StepModel, scale: int, needed_blocks: int, p_blocks: int = 0, d_blocks: int = 0, budget_gib: float = 3.0
) -> Sizing:
    """The stand-in for `model` with its page bytes divided by `scale`; `needed_blocks`: the most
    the workload could hold at once (in `STANDIN_BLOCK`s); `p_blocks`/`d_blocks` (0: as sized)
    squeeze an engine.

    :raises ConfigError: a scale that leaves no whole 8-byte row, or engines over `budget_gib`.
    """
    m = model.model
    heads = max(1, m.kv_heads // model.tp)  # one GPU's KV heads
    if scale < 1 or m.head_dim % scale or (m.head_dim // scale) * 2 % 8:
        raise ConfigError(f"scale {scale} must divide head_dim {m.head_dim} and leave rows of whole 8 bytes")
    shape = ModelShape(family="qwen3", layers=m.layers, kv_heads=heads, head_dim=m.head_dim // scale)
    real = model.capacity_blocks(GPU_MEMORY_UTILIZATION, RESERVE_GB, STANDIN_BLOCK)
    real_per_token = m.kv_bytes_per_token / model.tp
    default = min(real, needed_blocks)
    if min(p_blocks, d_blocks) < 0:
        raise ConfigError("p_blocks and d_blocks must be >= 0")
    sizing = Sizing(
        shape,
        real_per_token / (2 * shape.layers * shape.kv_heads * shape.head_dim * 2),
        real,
        p_blocks or default,
        d_blocks or default,
        needed_blocks > real,
    )
    if sizing.resident_bytes() > budget_gib * 2**30:
        raise ConfigError(
            f"the engines' KV would take {sizing.resident_bytes() / 2**30:.1f} GiB (> {budget_gib} GiB): "
            "raise --scale or lower --p-blocks/--d-blocks"
        )
    return sizing
