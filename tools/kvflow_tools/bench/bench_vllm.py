"""`kvflow bench vllm`: kvflow's connector against vLLM's NixlPushConnector and NixlConnector.

Why this shape: the number that matters in P/D disaggregation is how long D waits for the KV
once P has it.  Each connector runs inside vLLM's real Scheduler and worker hooks (`runner`), P
and D as two processes, over the same transport (NIXL with UCX, DRAM KV caches), on the same
workload, in the same run.  The pair and the router between them (`runner_pair`) are shared
with the other benchmarks of vLLM's connectors; this module runs each connector's pair over the
grid of cells (prompt length, requests in flight, step pacing) and reports them.

Measured per request (clocks are CLOCK_MONOTONIC, shared by the processes):

* ``fin→recv``: from P's scheduler calling ``request_finished`` to D's worker reporting the
  request in ``finished_recving`` (vLLM then schedules it for decode);
* ``kv→recv``: from the end of P's forward that computed the last prompt token (the moment
  the KV exists) to the same point; connectors that start sending before ``request_finished``
  are not flattered by this one;
* ``start→recv``: from the start of that step of P (its hooks, the forward and P's own
  connector work in it included) to the same point;
* D's engine steps from P's ``request_finished`` to ``finished_recving``, P's time to free its
  blocks (``finished_sending``) and P's steps until then (1: the first step boundary vLLM
  allows, the end of the step after ``request_finished``), and every page D received, checked
  byte for byte.

Measured per engine step: the time the model runner spends inside the connector's hooks on P
and on D (every hook call of the step summed: what the connector adds to each step of the
batch, whatever the transfer does in the background), in all and per hook name.

Timings are printed and written as JSON, never asserted.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvflow.errors import ConfigError
from kvflow.runtime.meter import quantile
from kvflow_tools.bench.bench_report import Cell, render, render_costs, render_hooks, summarize, verdict
from kvflow_tools.bench.runner_pair import Pair, start_pair
from kvflow_tools.bench.systems import CONNECTORS

__all__ = ("CONNECTORS", "Cell", "main", "run")

MIN_BUDGET = 64  # vLLM's token budget is at least its max_num_seqs (the stand-in's 64)


def run(
    connectors: list[str],
    tokens: list[int],
    concurrency: list[int],
    step_ms: list[float],
    requests: int = 20,
    repeats: int = 2,
    warmup: int = 2,
    options: dict[str, Any] | None = None,
    progress: Any = None,
    long_tokens: int = 0,
    long_chunks: int = 4,
) -> list[Cell]:
    """Every connector on every (tokens, concurrency, pacing) cell, `repeats` times; with
    `long_tokens`, also a long prompt that P prefills in `long_chunks` chunks (its token budget
    is the prompt / `long_chunks`), on every (concurrency, pacing).

    Connectors take turns within each repeat (fresh engine processes for each), so slow drift
    of the machine falls on all of them alike.
    :raises ConfigError: an unknown connector or a bad count.
    :raises BenchError: an engine died or a request stalled.
    """
    unknown = [c for c in connectors if c not in CONNECTORS]
    if unknown:
        raise ConfigError(f"unknown connectors {unknown}; choose from {sorted(CONNECTORS)}")
    if requests < 1 or repeats < 1 or warmup < 0 or min(tokens, default=1) < 1 or min(concurrency) < 1:
        raise ConfigError("requests, repeats, tokens and concurrency must be positive; warmup non-negative")
    budget = -(-long_tokens // long_chunks) if long_tokens > 0 and long_chunks > 0 else 0
    if long_tokens < 0 or (long_tokens and not MIN_BUDGET <= budget < long_tokens):
        raise ConfigError(
            f"a long prompt of {long_tokens} tokens in {long_chunks} chunks needs a token budget of "
            f"{MIN_BUDGET}..{long_tokens - 1} tokens per chunk, not {budget}"
        )
    cells: list[Cell] = []
    for repeat in range(repeats):
        for connector in connectors:
            grid = (repeat, concurrency, step_ms, requests, warmup, progress)
            if tokens:
                pair = start_pair(connector, max(tokens), max(concurrency), options or {})
                cells += _run_cells(pair, tokens, 1, *grid)
            if long_tokens:
                pair = start_pair(connector, long_tokens, max(concurrency), options or {}, budget=budget)
                cells += _run_cells(pair, [long_tokens], long_chunks, *grid)
    return cells


def _run_cells(
    pair: Pair,
    tokens: list[int],
    chunks: int,
    repeat: int,
    concurrency: list[int],
    step_ms: list[float],
    requests: int,
    warmup: int,
    progress: Any,
) -> list[Cell]:
    """One connector's cells on its `pair`, which is closed after them; `chunks`: how many steps
    P's token budget makes each prefill.

    :raises BenchError: an engine died or a request stalled.
    """
    cells = []
    try:
        for n_tokens in tokens:
            for conc in concurrency:
                for pace in step_ms:
                    cell = Cell(pair.connector, n_tokens, conc, pace, repeat, requests, chunks=chunks, vllm=pair.vllm)
                    pair.run_cell(cell, warmup)
                    cells.append(cell)
                    if progress is not None:
                        progress(cell)
    finally:
        pair.close()
    return cells


def main(argv_options: dict[str, Any]) -> int:
    """Run, print the table and the per-cell verdict, and write JSON when asked."""
    o = argv_options

    def progress(cell: Cell) -> None:
        p50 = quantile(cell.fin_to_recv_ms, 0.5)
        pace = f"{cell.step_ms:g}ms" if cell.step_ms else "fast"
        sys.stderr.write(
            f"  {cell.connector:<11} {cell.tokens:>5} tok/{cell.chunks}  c{cell.concurrency}  {pace:>5}  "
            f"repeat {cell.repeat}: "
            f"fin→recv p50 {p50:.1f} ms, failed {cell.failed}\n"
        )

    cells = run(
        o["connectors"],
        o["tokens"],
        o["concurrency"],
        o["step_ms"],
        requests=o["requests"],
        repeats=o["repeats"],
        warmup=o["warmup"],
        options={
            "keep_vllm_affinity": o["keep_vllm_affinity"],
            "nixl_progress_delay_us": o["nixl_progress_delay_us"],
            "kvflow_settings": dict(o.get("kvflow_settings") or {}),
        },
        progress=progress,
        long_tokens=o.get("long_tokens", 0),
        long_chunks=o.get("long_chunks", 4),
    )
    rows = summarize(cells)
    sys.stdout.write(
        render(rows)
        + "\n\n"
        + render_costs(rows)
        + "\n\n"
        + render_hooks(rows)
        + "\n\n"
        + "\n".join(verdict(rows))
        + "\n"
    )
    if o.get("json"):
        Path(o["json"]).write_text(
            json.dumps({"options": o, "summary": rows, "cells": [asdict(c) for c in cells]}, indent=1)
        )
        sys.stdout.write(f"\nwrote {o['json']}\n")
    return 1 if any(r["failed"] for r in rows) else 0
