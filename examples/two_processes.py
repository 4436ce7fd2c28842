"""A prefill engine and a decode engine in two processes: ZeroMQ control plane, shared memory.

The script is the decode side; it starts the prefill side as a child process (the same script
with ``--role prefill``) and tells it, over the child's stdin, which transfers to produce.  Both
share a freshly generated secret (KVFLOW_SECRET), so every control frame is authenticated.

    python examples/two_processes.py [--transfers 20] [--blocks 8]

Prints, per mode, how long D waited from registering its blocks to holding P's KV, and checks
the bytes with a digest computed in each process.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import secrets
import subprocess
import sys
import time

import numpy as np

from kvflow.control.zeromq import ZmqControl
from kvflow.layout import KVLayout, KVSpec
from kvflow.layout.buffers import region_of
from kvflow.protocol.state import Mode
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.runtime.loop import run
from kvflow.runtime.meter import quantile
from kvflow.transports.shm import ShmTransport

SPEC = KVSpec(num_layers=8, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
NUM_BLOCKS = 64


def make_engine(name: str) -> tuple[Engine, list[np.ndarray]]:
    transport = ShmTransport(name)
    layers = [
        transport.allocate(2 * NUM_BLOCKS * SPEC.block_len).reshape(2, NUM_BLOCKS, SPEC.block_len)
        for _ in range(SPEC.num_layers)
    ]
    layout = KVLayout.per_layer_regions(SPEC, NUM_BLOCKS, [region_of(a.reshape(-1)) for a in layers])
    return Engine(name, layout, transport, ZmqControl(name), config=EngineConfig(transfer_timeout=10.0)), layers


def digest(layers: list[np.ndarray], blocks: list[int]) -> str:
    h = hashlib.sha256()
    for layer in layers:
        for block in blocks:
            h.update(layer[:, block].tobytes())
    return h.hexdigest()


async def prefill_side() -> None:
    """Child process: produce KV when told, report its digest."""
    engine, layers = make_engine("prefill-0")
    async with engine:
        print(json.dumps({"address": engine.control.address}), flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = json.loads(line)
            blocks = cmd["blocks"]
            rng = np.random.default_rng(cmd["seed"])
            for layer in layers:
                layer[:, blocks] = rng.integers(0, 256, (2, len(blocks), SPEC.block_len), dtype=np.uint8)
            await engine.kv_ready(cmd["tid"], 1, block_ids=blocks, mode=Mode(cmd["mode"]), peer="decode-0")
            print(json.dumps({"tid": cmd["tid"], "digest": digest(layers, blocks)}), flush=True)


def start_prefill_process() -> subprocess.Popen[str]:
    """The prefill side, sharing this process's secret (a fresh one unless KVFLOW_SECRET is set)."""
    os.environ.setdefault("KVFLOW_SECRET", secrets.token_hex(32))
    command = [sys.executable, __file__, "--role", "prefill"]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


async def decode_side(args: argparse.Namespace, child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None and child.stdout is not None
    engine, layers = make_engine("decode-0")
    try:
        async with engine:
            address = json.loads(child.stdout.readline())["address"]
            await engine.connect("prefill-0", address)
            print(f"decode-0 (pid {os.getpid()}) connected to prefill-0 (pid {child.pid}) at {address}, authenticated")
            print(f"{'mode':<5} {'transfers':>9} {'MiB each':>8} {'p50 ms':>8} {'p90 ms':>8}  bytes")
            per_block = SPEC.block_len * 2 * SPEC.num_layers
            for mode in (Mode.PUSH, Mode.PULL):
                waits, equal = [], 0
                for i in range(args.transfers):
                    tid = f"{mode.value}-{i}"
                    d_blocks = list(range(args.blocks))
                    p_blocks = list(range(args.blocks, 2 * args.blocks))
                    started = time.perf_counter()
                    waiting = await engine.expect(tid, 1, peer="prefill-0", block_ids=d_blocks, mode=mode)
                    child.stdin.write(
                        json.dumps({"tid": tid, "blocks": p_blocks, "mode": mode.value, "seed": i}) + "\n"
                    )
                    child.stdin.flush()
                    result = await waiting.wait(10)
                    waits.append((time.perf_counter() - started) * 1e3)
                    reported = json.loads(await asyncio.to_thread(child.stdout.readline))
                    equal += result.ok and reported["digest"] == digest(layers, d_blocks)
                p90 = quantile(waits, 0.9)
                mib = args.blocks * per_block / 2**20
                print(
                    f"{mode.value:<5} {len(waits):>9} {mib:>8.2f} {quantile(waits, 0.5):>8.2f} {p90:>8.2f}  "
                    f"{equal}/{len(waits)} equal"
                )
            stats = engine.stats()
            rejected = engine.control.counters["rejected"] if isinstance(engine.control, ZmqControl) else 0
            print(
                f"decode-0: held blocks {stats['held_blocks']}, crashed {stats['crashed']}, frames rejected {rejected}"
            )
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        child.stdout.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["decode", "prefill"], default="decode")
    parser.add_argument("--transfers", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=8)
    arguments = parser.parse_args()
    if arguments.role == "prefill":
        run(prefill_side())
    else:
        run(decode_side(arguments, start_prefill_process()))
