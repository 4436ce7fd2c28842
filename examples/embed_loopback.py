"""Two kvflow engines in one process move real KV bytes over the loopback transport.

A prefill engine (P) and a decode engine (D) each own a paged KV cache made of CPU tensors (the
vLLM FlashAttention shape: per layer, K blocks then V blocks).  The example runs:

1. push: D registers destination blocks first, P's KV becomes ready later, P WRITEs;
2. push, layer by layer: P hands over one layer at a time, D counts one WRITE per layer;
3. pull (vLLM's default flow): P reports ready, D READs, D tells P to release;
4. a WRITE that fails: D is told at once, and its blocks come back only after P's fence;
5. D aborts while P is still prefilling: nothing is written, every block comes back.

Each case checks D's bytes against P's and prints the outcome, timing and block accounting.

    python examples/embed_loopback.py [--layers 8] [--blocks 64] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

import numpy as np

from kvflow.control.channel import LocalControlHub
from kvflow.layout import KVLayout, KVSpec
from kvflow.layout.buffers import region_of
from kvflow.protocol.state import Mode, Role
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.runtime.loop import loop_name, run
from kvflow.transports.loopback import FaultPlan, LinkModel, LoopbackFabric

try:
    import torch

    HAVE_TORCH = True
except ImportError:  # numpy buffers work the same way
    HAVE_TORCH = False


@dataclass
class Cache:
    layers: list[np.ndarray]  # per layer: (2, num_blocks, block_bytes) as raw bytes
    layout: KVLayout

    def block(self, layer: int, kv: int, block: int) -> np.ndarray:
        view: np.ndarray = self.layers[layer][kv, block]
        return view


def make_cache(spec: KVSpec, num_blocks: int, rng: np.random.Generator, fill: bool) -> Cache:
    layers = []
    regions = []
    for _ in range(spec.num_layers):
        if HAVE_TORCH:
            shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
            tensor = torch.zeros(shape, dtype=torch.float16)
            regions.append(region_of(tensor))
            raw = tensor.view(torch.uint8).numpy().reshape(2, num_blocks, spec.block_len)
        else:
            raw = np.zeros((2, num_blocks, spec.block_len), dtype=np.uint8)
            regions.append(region_of(raw))
        if fill:
            raw[:] = rng.integers(0, 256, raw.shape, dtype=np.uint8)
        layers.append(raw)
    return Cache(layers, KVLayout.per_layer_regions(spec, num_blocks, regions))


def same_bytes(p: Cache, d: Cache, p_blocks: list[int], d_blocks: list[int], layers: range) -> bool:
    return all(
        np.array_equal(p.block(layer, kv, pb), d.block(layer, kv, db))
        for layer in layers
        for kv in (0, 1)
        for pb, db in zip(p_blocks, d_blocks, strict=True)
    )


def report(case: str, mode: str, blocks: int, nbytes: int, outcome: str, ms: float, verified: str) -> None:
    print(f"{case:<34} {mode:<5} {blocks:>6} {nbytes / 2**20:>8.2f} {outcome:<10} {ms:>9.2f} {verified}")


async def main(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    spec = KVSpec(num_layers=args.layers, block_size=16, num_kv_heads=8, head_dim=128, dtype="float16")
    p_cache = make_cache(spec, args.blocks, rng, fill=True)
    d_cache = make_cache(spec, args.blocks, rng, fill=False)
    faults = FaultPlan(seed=args.seed, fail_ops=set())
    fabric = LoopbackFabric(LinkModel(latency=20e-6, bandwidth=20e9), faults)
    hub = LocalControlHub()
    config = EngineConfig(transfer_timeout=10.0)
    prefill = Engine("prefill-0", p_cache.layout, fabric.endpoint("prefill-0"), hub.channel("prefill-0"), config=config)
    decode = Engine("decode-0", d_cache.layout, fabric.endpoint("decode-0"), hub.channel("decode-0"), config=config)
    block_kib = spec.block_len * 2 * spec.num_layers / 1024
    print(
        f"kvflow loopback demo: {spec.num_layers} layers, {args.blocks} blocks of {block_kib:.0f} KiB (K+V, all layers)"
    )
    buffers = "torch CPU tensors" if HAVE_TORCH else "numpy arrays"
    print(f"buffers: {buffers}, event loop: {loop_name(asyncio.get_running_loop())}")
    async with prefill, decode:
        await decode.connect("prefill-0")
        for mode in (Mode.PUSH, Mode.PULL):  # warm up: first-use costs stay out of the table
            warm = await decode.expect(f"warm-{mode.value}", 1, peer="prefill-0", block_ids=[0], mode=mode)
            await prefill.kv_ready(f"warm-{mode.value}", 1, block_ids=[1], mode=mode, peer="decode-0")
            await warm.wait(10)
        await asyncio.sleep(0.01)
        print(f"\n{'case':<34} {'mode':<5} {'blocks':>6} {'MiB':>8} {'outcome':<10} {'ms':>9} bytes")
        n = args.blocks // 4
        per_block = spec.block_len * 2 * spec.num_layers
        all_layers = range(spec.num_layers)

        # 1. push, registration first
        d_blocks, p_blocks = list(range(n)), list(range(n, 2 * n))
        t0 = time.perf_counter()
        waiting = await decode.expect("req-push", 1, peer="prefill-0", block_ids=d_blocks)
        await prefill.kv_ready("req-push", 1, block_ids=p_blocks)
        result = await waiting.wait(10)
        ms = (time.perf_counter() - t0) * 1e3
        ok = same_bytes(p_cache, d_cache, p_blocks, d_blocks, all_layers)
        report("push", "push", n, n * per_block, result.outcome.value, ms, "equal" if ok else "DIFFERENT")

        # 2. push, one WRITE per layer as each layer finishes
        d_blocks, p_blocks = list(range(n, 2 * n)), list(range(2 * n, 3 * n))
        t0 = time.perf_counter()
        waiting = await decode.expect(
            "req-layers", 1, peer="prefill-0", block_ids=d_blocks, expected_batches=spec.num_layers
        )
        for layer in all_layers:
            await asyncio.sleep(0.001)  # the next layer's attention runs
            await prefill.kv_ready(
                "req-layers", 1, block_ids=p_blocks, layers=(layer, layer + 1), final=layer == spec.num_layers - 1
            )
        result = await waiting.wait(10)
        ms = (time.perf_counter() - t0) * 1e3
        ok = same_bytes(p_cache, d_cache, p_blocks, d_blocks, all_layers)
        verdict = "equal" if ok else "DIFFERENT"
        report("push, layer by layer", "push", n, n * per_block, result.outcome.value, ms, verdict)

        # 3. pull
        d_blocks, p_blocks = list(range(2 * n, 3 * n)), list(range(3 * n, 4 * n))
        t0 = time.perf_counter()
        waiting = await decode.expect("req-pull", 1, peer="prefill-0", block_ids=d_blocks, mode=Mode.PULL)
        await prefill.kv_ready("req-pull", 1, block_ids=p_blocks, mode=Mode.PULL, peer="decode-0")
        result = await waiting.wait(10)
        ms = (time.perf_counter() - t0) * 1e3
        ok = same_bytes(p_cache, d_cache, p_blocks, d_blocks, all_layers)
        report("pull", "pull", n, n * per_block, result.outcome.value, ms, "equal" if ok else "DIFFERENT")

        # 4. the next WRITE fails: D hears of it at once, not at its deadline
        faults.fail_ops.add(fabric.op_count + 1)
        d_blocks, p_blocks = list(range(3 * n, 4 * n)), list(range(n))
        t0 = time.perf_counter()
        waiting = await decode.expect("req-fail", 1, peer="prefill-0", block_ids=d_blocks)
        await prefill.kv_ready("req-fail", 1, block_ids=p_blocks)
        result = await waiting.wait(10)
        ms = (time.perf_counter() - t0) * 1e3
        report("push, WRITE fails", "push", n, n * per_block, result.outcome.value, ms, f"({result.reason})")

        # 5. D gives up while P is still prefilling
        d_blocks = list(range(n))
        t0 = time.perf_counter()
        waiting = await decode.expect("req-abort", 1, peer="prefill-0", block_ids=d_blocks)
        await asyncio.sleep(0.005)
        await decode.abort("req-abort", 1, Role.DECODE, "client went away")
        result = await waiting.wait(10)
        ms = (time.perf_counter() - t0) * 1e3
        report("decode aborts during prefill", "push", n, 0, result.outcome.value, ms, "-")
        late = await prefill.kv_ready("req-abort", 1, block_ids=list(range(n, 2 * n)))
        print(f"  late prefill result on P: {(await late.wait(10)).outcome.value}")

        await asyncio.sleep(0.05)  # let the last fences and acknowledgements arrive
        for engine in (prefill, decode):
            s = engine.stats()
            returned = sum(len(r.block_ids) for r in engine.released)
            print(
                f"\n{engine.engine_id}: completed={s['completed']} failed={s['failed']} "
                f"blocks returned={returned} held={s['held_blocks']} quarantined={s['quarantined_blocks']} "
                f"late messages absorbed={s['ignored']}"
            )
    fabric.close()
    print("\nboth engines closed with every block returned")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    run(main(parser.parse_args()))
