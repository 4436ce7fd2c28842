"""`kvflow bench pd`'s options and its main: the workload, the model, the runs, the results.

Why apart from `kvflow_tools.cli`: the command's many options and its assembly of the results'
JSON (the contract the report reads) belong with the benchmark, not with the command table.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvflow.errors import ConfigError
from kvflow_tools.pd.workload import LengthDist, arrivals

if TYPE_CHECKING:
    from kvflow_tools.standin.timing import StepModel

__all__ = ("Progress", "add_arguments", "main")

SYSTEMS = (
    "kvflow",
    "kvflow-pull",
    "vllm-pull",
    "vllm-push",
    "vllm-push-0.33",
)  # bench_vllm.CONNECTORS says what each runs
DEFAULT_SYSTEMS = SYSTEMS
QUICK = {"qps": [1.0, 4.0], "requests": 24, "prompt_dist": "uniform:128:4096", "output_dist": "uniform:16:64"}


def _floats(text: str) -> list[float]:
    return [float(p) for p in text.split(",") if p.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `kvflow bench pd`."""
    parser.add_argument(
        "--systems", default=",".join(DEFAULT_SYSTEMS), help="comma-separated, of " + ", ".join(SYSTEMS)
    )
    parser.add_argument("--qps", type=_floats, default=[1.0, 4.0, 8.0], help="request rates (comma-separated)")
    parser.add_argument("--requests", type=int, default=40, help="requests per rate")
    parser.add_argument("--duration", type=float, default=0.0, help="instead of --requests: seconds of arrivals")
    parser.add_argument("--prompt-max", type=int, default=16384, help="the longest prompt (tokens)")
    parser.add_argument("--prompt-dist", default="", help="uniform:LOW:HIGH | lognormal:LOW:HIGH[:MEDIAN[:SIGMA]]")
    parser.add_argument("--output-dist", default="uniform:64:512", help="output tokens, as --prompt-dist")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model", default="Qwen3-32B", help="Qwen3-32B (default) or Llama-3.1-8B: geometry only")
    parser.add_argument("--tp", type=int, default=8, help="GPUs per engine (modelled: each stand-in is one GPU)")
    parser.add_argument("--scale", type=int, default=16, help="the stand-in's head_dim is the model's / SCALE")
    parser.add_argument("--p-blocks", type=int, default=0, help="P's KV blocks (default: as the GPU holds)")
    parser.add_argument("--d-blocks", type=int, default=0, help="D's KV blocks (default: as the GPU holds)")
    parser.add_argument(
        "--nixl-progress-delay-us",
        type=int,
        default=1000,
        help="vLLM's connectors: their NIXL agents' progress threads sleep this long between polls "
        "(-1: stock NIXL, a busy poll that takes a core per agent; default 1000)",
    )
    parser.add_argument("--results", default="", help="folder for results.json and plots (default results/pd-<time>)")
    parser.add_argument("--quick", action="store_true", help="a few minutes: qps 1,4, 8 requests, prompts <= 4k")


def _config(args: argparse.Namespace) -> tuple[StepModel, LengthDist, LengthDist, list[float], int]:
    from kvflow_tools.standin.timing import StepModel

    if args.quick:
        args.qps, args.requests = QUICK["qps"], QUICK["requests"]
        args.prompt_dist = args.prompt_dist or QUICK["prompt_dist"]
        if args.output_dist == "uniform:64:512":
            args.output_dist = QUICK["output_dist"]
    prompt = LengthDist.parse(args.prompt_dist or f"lognormal:128:{args.prompt_max}:2048:1.0")
    output = LengthDist.parse(args.output_dist)
    model = StepModel.named(args.model, tp=args.tp)
    count = args.requests
    if args.duration > 0:
        count = max(1, round(max(args.qps) * args.duration))
    return model, prompt, output, args.qps, count


def main(args: argparse.Namespace) -> int:
    """Run every system at every rate; write results.json (and the report's plots), print the
    table and the folder.  1 when a request failed or a page arrived wrong.

    :raises ConfigError: a bad option.
    :raises BenchError: an engine died or a request stalled.
    """
    from kvflow_tools.bench.runner_pair import Pair
    from kvflow_tools.pd.run import run_point, start_system
    from kvflow_tools.pd.sizing import STANDIN_BLOCK, size

    model, prompt, output, rates, count = _config(args)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ConfigError(f"--systems: unknown {unknown}; choose from {SYSTEMS}")
    from kvflow_tools.serve.launcher import check_progress_delay

    delay = None if args.nixl_progress_delay_us == -1 else args.nixl_progress_delay_us
    check_progress_delay(delay)  # before any engine starts
    points = [(qps, arrivals(qps, count, prompt, output, args.seed)) for qps in rates]
    per_request = -(-(prompt.high + output.high) // STANDIN_BLOCK)
    needed = max(sum(-(-(a.prompt + a.output) // STANDIN_BLOCK) for a in reqs) for _, reqs in points)
    sizing = size(model, args.scale, max(needed, per_request) + 16, args.p_blocks, args.d_blocks)
    max_model_len = prompt.high + output.high + STANDIN_BLOCK
    folder = Path(args.results or f"results/pd-{time.strftime('%Y%m%d-%H%M%S')}")
    config = _describe(model, sizing, prompt, output, rates, count, args.seed, systems)
    config["nixl_progress_delay_us"] = delay
    sys.stdout.write(_header(config) + "\n")
    total = len(systems) * len(rates) * count
    cells: list[dict[str, Any]] = []
    pairs: dict[str, Pair] = {}
    try:
        with Progress(total) as progress:
            for system in systems:
                progress.label(f"{system}: starting")
                pairs[system] = start_system(system, model, sizing, max_model_len, delay)
            config["vllm"] = {system: pairs[system].vllm for system in systems}
            for index, (qps, requests) in enumerate(points):
                turn = index % len(systems)  # each rate starts with the next system
                for system in systems[turn:] + systems[:turn]:
                    progress.label(f"{system} at QPS {qps:g}")
                    cells.append(run_point(pairs[system], qps, requests, progress.advance))
    finally:
        for pair in pairs.values():
            pair.close()
    cells.sort(key=lambda cell: (systems.index(cell["system"]), rates.index(cell["qps"])))
    results = {"config": config, "cells": cells}
    _publish(results, folder)
    bad = sum(c["failed"] + c["bad_pages"] for c in cells)
    return 1 if bad else 0


def _describe(model: StepModel, sizing: Any, prompt: LengthDist, output: LengthDist, rates: list[float],
              count: int, seed: int, systems: list[str]) -> dict[str, Any]:  # fmt: skip
    from kvflow_tools.pd.sizing import BLOCK_SIZE, GPU_MEMORY_UTILIZATION, RESERVE_GB, STANDIN_BLOCK

    m, g = model.model, model.gpu
    from kvflow_tools.pd.run import transport

    return {
        "model": {
            "name": m.name, "layers": m.layers, "kv_heads": m.kv_heads, "head_dim": m.head_dim, "dtype": m.dtype,
            "block_size": BLOCK_SIZE, "standin_block_size": STANDIN_BLOCK, "kv_bytes_per_token": m.kv_bytes_per_token,
            "emulated_bytes_per_token": sizing.emulated_bytes_per_token, "scale": sizing.scale,
            "emulated_kv_heads": sizing.shape.kv_heads, "emulated_head_dim": sizing.shape.head_dim,
            "page_bytes": sizing.emulated_bytes_per_token // (2 * m.layers) * STANDIN_BLOCK,
        },
        "gpu": {"name": g.name, "hbm_gb": g.hbm_gb, "bw_tb_s": g.bw_tb_s, "tflops": g.tflops, "tp": model.tp,
                "sources": [g.source]},
        "step_model": model.describe(),
        "capacity": {
            "p_blocks": sizing.p_blocks, "d_blocks": sizing.d_blocks, "tokens_per_block": STANDIN_BLOCK,
            "real_tokens": sizing.real_blocks * STANDIN_BLOCK, "real_blocks": sizing.real_blocks,
            "binds": sizing.binds, "gpu_memory_utilization": GPU_MEMORY_UTILIZATION, "reserve_gb": RESERVE_GB,
            "notes": "real capacity: per GPU HBM*0.9 - weights/TP - reserve, over KV bytes/token/TP; "
            + ("the workload can exceed it" if sizing.binds else
               "the workload never holds that much: each engine gets what the workload could hold at most"),
        },
        "workload": {"qps": rates, "requests_per_point": count, "prompt": prompt.describe(),
                     "output": output.describe(), "seed": seed, "arrivals": "poisson (open loop)"},
        "systems": systems,
        "transport": transport(),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs (stand-in engines, modelled GPUs)",
        "order": "every system's pair started first; at each rate the systems take turns (the first rotating "
        "from rate to rate), each stopped with SIGSTOP during the others' turns",
    }  # fmt: skip


def _header(config: dict[str, Any]) -> str:
    s, c, m = config["step_model"], config["capacity"], config["model"]
    lines = [
        f"model {m['name']} ({m['kv_bytes_per_token']} B/token KV), {config['gpu']['name']} x{config['gpu']['tp']}, "
        f"t_base {s['t_base_ms']} ms, eta_mem {s['eta_mem']}, MFU {s['mfu']}, budget {s['budget_tokens']} tokens",
        f"stand-in pages {m['page_bytes']} B (bytes scaled 1/{m['scale']:g}); blocks P {c['p_blocks']} D "
        f"{c['d_blocks']}; real capacity {c['real_tokens']} tokens per engine ({c['notes']})",
        *(f"  source: {src}" for src in [*s["sources"]]),
    ]
    return "\n".join(lines)


def _publish(results: dict[str, Any], folder: Path) -> None:
    """results.json, the plots and the table (`pd.report`), and where they are."""
    from kvflow_tools.pd import report

    paths = report.write(results, folder)
    sys.stdout.write(report.render_table(results) + "\n")
    sys.stdout.write(f"results: {folder}/ ({', '.join(p.name for p in paths)})\n")


class Progress:
    """A rich progress bar on a terminal, plain lines otherwise (`kvflow bench serve`'s too)."""

    def __init__(self, total: int, title: str = "bench pd") -> None:
        self.total, self.done, self.name = total, 0, ""
        self.bar: Any = None
        if sys.stdout.isatty():
            from rich.progress import Progress as Bar

            self.bar = Bar()
            self.task = self.bar.add_task(title, total=total)

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def label(self, name: str) -> None:
        self.name = name
        if self.bar is not None:
            self.bar.update(self.task, description=name)
        else:
            sys.stdout.write(f"{name}\n")
            sys.stdout.flush()

    def advance(self, count: int) -> None:
        self.done += count
        if self.bar is not None:
            self.bar.advance(self.task, count)
        elif self.done % 5 == 0 or self.done == self.total:
            sys.stdout.write(f"  {self.name}: {self.done}/{self.total} requests\n")
            sys.stdout.flush()
