"""`kvflow bench integrity`: what the opt-in end-to-end integrity check costs.

Why: with `EngineConfig(integrity=True)` every byte a WRITE moves is hashed twice, by P before it
posts the WRITE and by D before the batch counts (`kvflow.runtime.integrity`); an operator turns
it on at a cost read off this table.  Per prompt length, for a model shaped by `--layers`,
`--heads` and `--head-dim` (block size 16, float16): the time P takes to seal one WRITE of the
whole prompt and D to check it (the digests alone; best and median of `--runs`), as GiB/s of KV,
and the P→D latency of that push between two engines over the loopback fabric with the check off
and on, after a push not counted, and the mean over `--sample` pushes with `integrity_sample`
`--sample` (P seals each, D checks the ones its secret picks, one in `--sample` on average: what a
sampled deployment pays; the table says how many D checked), run in turns (off, on, sampled,
off, ...) so that whatever else loads the machine falls on each alike.  The load average at the
start and the end is printed with the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.layout import KVSpec
from kvflow.protocol.actions import OpKind, SubmitOp
from kvflow.protocol.messages import TransferKey, encode_notification
from kvflow.runtime.engine import EngineConfig
from kvflow.runtime.integrity import Integrity
from kvflow.transports.loopback import LoopbackFabric
from kvflow_tools.errors import BenchError
from kvflow_tools.testing import EnginePair, KVBuffers

__all__ = ("add_arguments", "main", "measure", "render")

GIB = 1 << 30


def _spec(layers: int, heads: int, head_dim: int) -> KVSpec:
    return KVSpec(num_layers=layers, block_size=16, num_kv_heads=heads, head_dim=head_dim, dtype="float16")


def _digests(spec: KVSpec, blocks: int, runs: int) -> dict[str, list[float]]:
    """Seconds P takes to seal, and D to check, one WRITE of `blocks` blocks, `runs` times."""
    p, d = KVBuffers(spec, blocks), KVBuffers(spec, blocks)
    p.fill(range(blocks), seed=1)
    for src, dst in zip(p.layers, d.layers, strict=True):
        np.copyto(dst, src)
    sealer, checker = Integrity("P", p.layout), Integrity("D", d.layout)
    key, ids = TransferKey("bench", 1), tuple(range(blocks))
    op = SubmitOp(1, key, "D", OpKind.WRITE, ids, ids, None, encode_notification(key, 0, True))
    seal_s, check_s = [], []
    for _ in range(runs):
        began = time.perf_counter()
        note = sealer.seal(op, d.layout)
        sealed = time.perf_counter()
        problem = checker.check("P", note, p.layout, lambda key: ids)
        seal_s.append(sealed - began)
        check_s.append(time.perf_counter() - sealed)
        if problem is not None:
            raise BenchError(f"bench integrity: D's check failed on bytes P wrote itself: {problem}")
    return {"seal_s": seal_s, "check_s": check_s}


async def _pushes(spec: KVSpec, blocks: int, config: EngineConfig, transfers: list[str]) -> tuple[list[float], int]:
    """Seconds from P's kv_ready to D's outcome for a push of `blocks` blocks per transfer id,
    one after the other between the same two engines, after one push not counted (the first
    faults D's fresh memory in); and how many of the counted WRITEs D's integrity check hashed."""
    pair = await EnginePair(LoopbackFabric(), spec=spec, num_blocks=blocks, config=config).start()
    try:
        checked_warm_up = 0
        ids, seconds = list(range(blocks)), []  # (what the blocks hold costs nothing to move or hash: as made)
        for transfer in ["warm-up", *transfers]:
            waiting = await pair.d.expect(transfer, 1, peer="P", block_ids=ids, timeout=120.0)
            began = time.perf_counter()
            await pair.p.kv_ready(transfer, 1, block_ids=ids, peer="D", timeout=120.0)
            result = await waiting.wait(120.0)
            seconds.append(time.perf_counter() - began)
            if not result.ok:
                raise BenchError(f"bench integrity: the push failed: {result.reason}")
            if transfer == "warm-up":
                checked_warm_up = pair.d.stats()["integrity_checks"]
        return seconds[1:], pair.d.stats()["integrity_checks"] - checked_warm_up
    finally:
        await pair.close()


def measure(tokens: list[int], layers: int, heads: int, head_dim: int, runs: int, every: int = 4) -> dict[str, Any]:
    """The rows of the table (see the module docstring).

    :raises BenchError: a setting is out of range, or a check or a push failed.
    """
    if not tokens or min(tokens) < 16 or min(layers, heads, head_dim, runs) < 1 or every < 2:
        raise BenchError(
            "bench integrity: --tokens of at least 16 each, --layers/--heads/--head-dim/--runs >= 1, --sample >= 2"
        )
    configs = {
        "off": EngineConfig(transfer_timeout=120.0),
        "on": EngineConfig(transfer_timeout=120.0, integrity=True),
        "sampled": EngineConfig(transfer_timeout=120.0, integrity=True, integrity_sample=every),
    }
    transfers = {"off": ["r"], "on": ["r"], "sampled": [f"r{i}" for i in range(every)]}
    spec, load = _spec(layers, heads, head_dim), os.getloadavg()
    rows = []
    for count in tokens:
        blocks = -(-count // spec.block_size)
        kv_bytes = blocks * layers * spec.arrays_per_layer * spec.block_len
        times = _digests(spec, blocks, runs)
        latency: dict[str, list[float]] = {name: [] for name in configs}
        checked = 0
        for _ in range(runs):
            for name, config in configs.items():  # in turns: what else loads the machine falls on each
                seconds, checks = asyncio.run(_pushes(spec, blocks, config, transfers[name]))
                latency[name].append(statistics.mean(seconds))
                checked += checks if name == "sampled" else 0
        off, on, some = (statistics.median(latency[name]) for name in configs)
        rows.append(
            {
                "tokens": count,
                "kv_bytes": kv_bytes,
                "kv_mib": round(kv_bytes / (1 << 20), 1),
                "seal_ms": _best_median(times["seal_s"]),
                "check_ms": _best_median(times["check_s"]),
                "seal_gib_s": round(kv_bytes / GIB / min(times["seal_s"]), 2),
                "check_gib_s": round(kv_bytes / GIB / min(times["check_s"]), 2),
                "push_off_ms": round(off * 1e3, 2),
                "push_on_ms": round(on * 1e3, 2),
                "added_ms": round((on - off) * 1e3, 2),
                "push_sampled_ms": round(some * 1e3, 2),
                "sampled_checked": [checked, runs * every],
            }
        )
    shape = {"layers": layers, "heads": heads, "head_dim": head_dim, "block_size": 16, "dtype": "float16"}
    end = os.getloadavg()
    return {"model": shape, "runs": runs, "sample": every, "rows": rows, "load": {"start": load, "end": end}}


def _best_median(seconds: list[float]) -> list[float]:
    return [round(min(seconds) * 1e3, 2), round(statistics.median(seconds) * 1e3, 2)]


def render(report: dict[str, Any]) -> str:
    m = report["model"]
    lines = [
        f"kvflow bench integrity: {m['layers']} layers x {m['heads']} KV heads x {m['head_dim']}, "
        f"{m['dtype']}, blocks of {m['block_size']}; best/median of {report['runs']}",
        f"{'tokens':>7} {'KV MiB':>8} {'seal ms':>15} {'check ms':>15} {'seal GiB/s':>10} {'check GiB/s':>11}"
        f" {'push off ms':>11} {'push on ms':>10} {'added ms':>9} {'1 in ' + str(report['sample']) + ' ms':>10}"
        f" {'checked':>8}",
    ]
    for r in report["rows"]:
        seal, check = "/".join(map(str, r["seal_ms"])), "/".join(map(str, r["check_ms"]))
        lines.append(
            f"{r['tokens']:>7} {r['kv_mib']:>8} {seal:>15} {check:>15} {r['seal_gib_s']:>10} {r['check_gib_s']:>11}"
            f" {r['push_off_ms']:>11} {r['push_on_ms']:>10} {r['added_ms']:>9} {r['push_sampled_ms']:>10}"
            f" {'/'.join(map(str, r['sampled_checked'])):>8}"
        )
    start, end = report["load"]["start"], report["load"]["end"]
    lines.append(f"load average (1, 5, 15 min): {start[0]:.2f} {start[1]:.2f} {start[2]:.2f} at the start, "
                 f"{end[0]:.2f} {end[1]:.2f} {end[2]:.2f} at the end")  # fmt: skip
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Print the table; also write it as JSON with `--json`.  :raises BenchError: see `measure`."""
    report = measure(args.tokens, args.layers, args.heads, args.head_dim, args.runs, args.sample)
    sys.stdout.write(render(report) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    def tokens(text: str) -> list[int]:
        return [int(part) for part in text.split(",") if part]

    parser.add_argument("--tokens", type=tokens, default=[1024, 4096, 16384], help="prompt lengths (1024,4096,16384)")
    parser.add_argument("--layers", type=int, default=8, help="layers of the model shape (default 8)")
    parser.add_argument("--heads", type=int, default=8, help="KV heads (default 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head size (default 128)")
    parser.add_argument("--runs", type=int, default=5, help="runs of each measurement (default 5)")
    parser.add_argument("--sample", type=int, default=4, help="the sampled column's integrity_sample (default 4)")
    parser.add_argument("--json", help="also write the report to this file")
