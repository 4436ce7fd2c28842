"""`kvflow bench pd`'s output: its results file, its tables and its plots.

Why its own module: the emulation (which drives vLLM's schedulers over a QPS sweep) writes one
document (`contract`); everything people read is computed from that document alone, here.  So a
long run's results can be re-rendered (`kvflow bench pd-report`) without running it again, and
the tables and plots are tested on a hand-made document without starting a scheduler.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvflow.errors import ConfigError
from kvflow_tools.pd.contract import (
    BASELINES,
    OURS,
    RESULTS_FILE,
    SPLIT_PARTS,
    cell,
    load,
    percentiles,
    qps_points,
    scale_text,
    systems,
    validate,
)

if TYPE_CHECKING:
    from rich.console import Console

__all__ = (
    "header_lines",
    "load",
    "markdown_table",
    "percentiles",
    "plot",
    "ratio",
    "ratio_line",
    "render_table",
    "rerender",
    "validate",
    "warnings",
    "write",
)


def write(results: dict[str, Any], folder: str | Path) -> list[Path]:
    """Write ``results.json`` and the plots (`plot`) into `folder`, created if missing.

    :returns: the paths written, results.json first.
    :raises ConfigError: `results` breaks the contract (the key is named), or holds a NaN (not
        JSON) beyond it, or matplotlib is missing; in the first two cases nothing is written.
    :raises OSError: a file cannot be written.
    """
    validate(results)
    folder = Path(folder)
    target = folder / RESULTS_FILE
    try:
        text = json.dumps(results, indent=1, sort_keys=True, allow_nan=False)
    except ValueError as error:  # a NaN or infinity outside the contract's keys: not JSON
        raise ConfigError(f"results cannot be written as JSON: {error}") from error
    folder.mkdir(parents=True, exist_ok=True)
    target.write_text(text + "\n")
    return [target, *plot(results, folder)]


def plot(results: dict[str, Any], folder: str | Path) -> list[Path]:
    """Draw the PNGs of `kvflow_tools.pd.plots` into `folder` (created if missing).

    :raises ConfigError: `results` breaks the contract, or matplotlib (the ``bench`` extra) is missing.
    :raises OSError: a file cannot be written.
    """
    validate(results)
    try:
        from kvflow_tools.pd import plots
    except ModuleNotFoundError as error:
        raise ConfigError(f"plots need the bench extra (pip install 'kvflow[bench]'): {error}") from error
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return plots.save_all(results, folder)


def ratio(results: Mapping[str, Any], qps: float, metric: str, baseline: str, ours: str = OURS) -> float | None:
    """``ours``'s p50 of `metric` (``ttft_ms``, ``tpot_ms``) over `baseline`'s at `qps`; None without both."""
    mine, theirs = cell(results, ours, qps), cell(results, baseline, qps)
    if mine is None or theirs is None:
        return None
    top, bottom = mine[metric]["p50"], theirs[metric]["p50"]
    if top is None or not bottom:
        return None
    return float(top) / float(bottom)


def header_lines(results: Mapping[str, Any]) -> list[str]:
    """What was emulated, on what, and where the step model's constants come from (one source a line)."""
    config = results["config"]
    model, gpu, step = config["model"], config["gpu"], config["step_model"]
    capacity, workload = config["capacity"], config["workload"]
    lines = [
        f"model {model['name']}: {model['layers']} layers, {model['kv_heads']} KV heads x head_dim "
        f"{model['head_dim']}, {model['dtype']}, {model['block_size']} tokens/block, "
        f"KV {_bytes(model['kv_bytes_per_token'])}/token; emulated {_bytes(model['emulated_bytes_per_token'])}"
        f"/token (KV bytes {scale_text(model['scale'])})",
        f"GPU {gpu['name']}: {gpu['hbm_gb']:g} GB HBM, {gpu['bw_tb_s']:g} TB/s, {gpu['tflops']:g} TFLOPS, "
        f"TP {gpu['tp']}",
        f"step model: t_base {step['t_base_ms']:g} ms, eta_mem {step['eta_mem']:g}, MFU {step['mfu']:g}, "
        f"budget {step['budget_tokens']} tokens/step",
        *([f"  {step['notes']}"] if step["notes"] else []),
        *(f"  source: {source}" for source in dict.fromkeys([*gpu["sources"], *step["sources"]])),
        f"capacity: P {capacity['p_blocks']:,} blocks, D {capacity['d_blocks']:,} blocks of "
        f"{capacity['tokens_per_block']} tokens; the real engines hold {capacity['real_tokens']:,} tokens",
        f"workload: Poisson arrivals at QPS {', '.join(f'{q:g}' for q in workload['qps'])}; "
        f"{workload['requests_per_point']} requests per point; prompt {_dist(workload['prompt'])} tokens; "
        f"output {_dist(workload['output'])} tokens; seed {workload['seed']}",
        f"transport {config['transport']} on {config['machine']}",
    ]
    if "vllm" in config:  # which vLLM each system's engines ran, and how vLLM's NIXL agents polled
        delay = config.get("nixl_progress_delay_us")
        polling = "stock, polling without pause" if delay is None else f"sleeping {delay} µs between polls"
        runs = ", ".join(f"{system} {release}" for system, release in config["vllm"].items())
        lines.append(f"vLLM: {runs}; vLLM's NIXL progress threads {polling}")
    return lines


def warnings(results: Mapping[str, Any], qps: float) -> list[str]:
    """Cells at `qps` whose figures cannot be trusted as they stand: failed requests, wrong pages."""
    out = []
    for system in systems(results):
        found = cell(results, system, qps)
        if found is not None and (found["failed"] or found["bad_pages"]):
            out.append(
                f"WARNING {system} at QPS {qps:g}: {found['failed']} of {found['requests']} requests failed, "
                f"{found['bad_pages']} pages arrived wrong"
            )
    return out


def ratio_line(results: Mapping[str, Any], qps: float) -> str:
    """kvflow push against each of vLLM's connectors at `qps`: TTFT p50 and TPOT p50 ratios."""
    parts = []
    for metric, name in (("ttft_ms", "TTFT p50"), ("tpot_ms", "TPOT p50")):
        each = ", ".join(f"{_times(ratio(results, qps, metric, b))} {b}" for b in BASELINES)
        parts.append(f"{name} {each}")
    return f"{OURS}/vLLM at QPS {qps:g}: " + "; ".join(parts)


_WIDTH = 200  # the widest table, so that no figure is ever wrapped or cut
_COLUMNS = (
    "system",
    "done/failed",
    "TTFT p50",
    "p90",
    "p99",
    "from P p50",
    "TPOT p50",
    "p90",
    "p99",
    "e2e p50",
    "p99",
    "P queue",
    "prefill",
    "xfer wait",
    "D queue",
    "peak blocks P/D",
    "stall s P/D",
    "over budget P/D",
)


def _row(c: Mapping[str, Any]) -> list[str]:
    ttft, tpot, e2e, split = c["ttft_ms"], c["tpot_ms"], c["e2e_ms"], c["ttft_split_ms"]
    return [
        c["system"],
        f"{c['completed']}/{c['failed']}",
        *(_ms(ttft[k]) for k in ("p50", "p90", "p99")),
        _ms(c["ttft_from_p_ms"]["p50"]),
        *(_ms(tpot[k]) for k in ("p50", "p90", "p99")),
        _ms(e2e["p50"]),
        _ms(e2e["p99"]),
        *(_ms(split[k]) for k in SPLIT_PARTS),
        f"{c['blocks_peak']['p']}/{c['blocks_peak']['d']}",
        f"{c['admission_stall_s']['p']:.2f}/{c['admission_stall_s']['d']:.2f}",
        f"{c['over_budget_steps']['p']}/{c['over_budget_steps']['d']}",
    ]


def render_table(results: dict[str, Any], console: Console | None = None) -> str:
    """The header (geometry, GPU, step model and their sources), then per QPS point a table of
    every system and the line of kvflow/vLLM ratios ("—" where a system or a figure is missing).

    :returns: the text; it is also printed to `console` when one is given.
    :raises ConfigError: `results` breaks the contract, or rich (the ``bench`` extra) is missing.
    """
    validate(results)
    try:
        from rich import box
        from rich.console import Console, Group
        from rich.table import Table
        from rich.text import Text
    except ModuleNotFoundError as error:
        raise ConfigError(f"the table needs the bench extra (pip install 'kvflow[bench]'): {error}") from error
    parts: list[Any] = []
    for qps in qps_points(results):
        title = f"QPS {qps:g} (times in ms; TTFT split: means)"
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for i, name in enumerate(_COLUMNS):
            table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
        for system in systems(results):
            found = cell(results, system, qps)
            table.add_row(*(_row(found) if found else [system, "—", *("—" for _ in _COLUMNS[2:])]))
        parts += [Text(""), table, *(Text(line) for line in [ratio_line(results, qps), *warnings(results, qps)])]
    group = Group(*parts)
    capture = Console(file=io.StringIO(), width=_WIDTH, color_system=None, force_terminal=False)
    with capture.capture() as captured:
        capture.print(group)
    lines = [*header_lines(results), *captured.get().splitlines()]  # the header unwrapped, however long
    text = "\n".join(line.rstrip() for line in lines) + "\n"
    if console is not None:  # as laid out here, whatever the console's width: rows never wrap
        console.print(text, end="", markup=False, highlight=False, soft_wrap=True)
    return text


def markdown_table(results: dict[str, Any]) -> str:
    """The main figures per QPS point and system as a GitHub Markdown table, then the ratios'.

    :raises ConfigError: `results` breaks the contract.
    """
    validate(results)
    head = (
        "| QPS | system | done/failed | TTFT p50 ms | p90 | p99 | TPOT p50 ms | p90 | p99 | e2e p50 ms | p99 "
        "| peak blocks P/D |"
    )
    lines = [head, "|---:|---|" + "---:|" * 10]
    for qps in qps_points(results):
        for system in systems(results):
            c = cell(results, system, qps)
            if c is None:
                continue
            row = _row(c)
            lines.append(f"| {qps:g} | " + " | ".join([*row[:10], row[14]]) + " |")
    names = [f"{m} vs {b}" for m in ("TTFT p50", "TPOT p50") for b in BASELINES]
    lines += ["", f"| QPS | {OURS}: " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for qps in qps_points(results):
        cells = [_times(ratio(results, qps, m, b)) for m in ("ttft_ms", "tpot_ms") for b in BASELINES]
        lines.append(f"| {qps:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def rerender(path: str | Path, markdown: bool = False, console: Console | None = None) -> int:
    """`kvflow bench pd-report`: the table (and the Markdown table) of a results.json, and its plots
    written beside it.  A document that breaks the contract is reported on stderr, naming the key.

    :returns: the exit status: 0, or 2 for results that cannot be read.
    :raises OSError: a plot cannot be written.
    """
    try:
        results = load(path)
        console = console or _console()
        render_table(results, console)
        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        written = plot(results, folder)
    except ConfigError as error:
        sys.stderr.write(f"kvflow bench pd-report: {error}\n")
        return 2
    if markdown:
        console.print(markdown_table(results), markup=False, highlight=False, soft_wrap=True)
    console.print("plots: " + ", ".join(str(p) for p in written), markup=False, highlight=False, soft_wrap=True)
    return 0


def _console() -> Console:
    try:
        from rich.console import Console
    except ModuleNotFoundError as error:
        raise ConfigError(f"the table needs the bench extra (pip install 'kvflow[bench]'): {error}") from error
    return Console()


def _times(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _bytes(value: float) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:g} {unit}"
    return f"{value:g} B"


def _dist(d: Mapping[str, Any]) -> str:
    return f"{d['dist']} {d['min']:g}..{d['max']:g} (mean {d['mean']:g})"
