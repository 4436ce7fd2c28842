"""Quickstart: a prefill engine pushes one request's KV blocks into a decode engine's cache.

Run it with `python examples/quickstart.py`; it prints what decode-0 received.
"""

from __future__ import annotations

import numpy as np

import kvflow
from kvflow.transports.loopback import LoopbackFabric

SPEC = kvflow.KVSpec(num_layers=4, block_size=16, num_kv_heads=8, head_dim=128, dtype="float16")
NUM_BLOCKS = 16
P_BLOCKS, D_BLOCKS = [0, 1, 2], [4, 9, 10]  # where the request's KV sits on P, and where D wants it


def paged_cache() -> list[np.ndarray]:
    """Per layer: K blocks then V blocks, as bytes (CPU or CUDA torch tensors work the same way)."""
    return [np.zeros((2, NUM_BLOCKS, SPEC.block_len), np.uint8) for _ in range(SPEC.num_layers)]


async def main() -> None:
    fabric, hub = LoopbackFabric(), kvflow.LocalControlHub()  # in-process data plane and control plane
    caches = {name: paged_cache() for name in ("prefill-0", "decode-0")}
    prefill, decode = (
        kvflow.Engine(
            name,
            kvflow.KVLayout.per_layer_regions(SPEC, NUM_BLOCKS, [kvflow.region_of(a) for a in caches[name]]),
            fabric.endpoint(name),
            hub.channel(name),
        )
        for name in caches
    )
    async with prefill, decode:
        await decode.connect("prefill-0")  # handshake: the layouts must match, field by field
        # D allocated blocks for request "req-17" (epoch 1) and registers them with P at once ...
        waiting = await decode.expect("req-17", 1, peer="prefill-0", block_ids=D_BLOCKS)
        # ... P's prefill computes the KV; when it is ready, P WRITEs it into D's blocks.
        rng = np.random.default_rng(17)
        for layer in caches["prefill-0"]:
            layer[:, P_BLOCKS] = rng.integers(0, 256, layer[:, P_BLOCKS].shape, np.uint8)
        await prefill.kv_ready("req-17", 1, block_ids=P_BLOCKS)
        result = await waiting.wait(timeout=5)
        result.raise_for_outcome()
    fabric.close()
    pairs = list(zip(caches["prefill-0"], caches["decode-0"], strict=True))
    same = all(np.array_equal(p[:, P_BLOCKS], d[:, D_BLOCKS]) for p, d in pairs)
    nbytes = sum(d[:, D_BLOCKS].nbytes for _, d in pairs)
    print(f"{result.outcome.value}: decode-0 blocks {D_BLOCKS} hold {nbytes} bytes, equal to prefill-0's: {same}")


if __name__ == "__main__":
    kvflow.run(main())
