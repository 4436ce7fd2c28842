"""`kvflow bench serve`'s figures: a turn's summary, the results file, the tables and the plots.

Why apart from the run: everything people read is computed from the per-request results and
the counters sampled around each turn, with no server running, so the statistics and the
tables are tested on hand-made data, and a results.json can be drawn again later.  The
percentiles are `kvflow bench pd`'s (`contract.percentiles`), so a p99 means the same in both.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvflow.errors import ConfigError
from kvflow_tools.pd.contract import percentiles

__all__ = ("RESULTS_FILE", "markdown_table", "plot", "render_table", "spread_lines", "summarise", "write")

RESULTS_FILE = "results.json"
SYSTEM_ORDER = ("kvflow", "kvflow-first", "kvflow-spin", "kvflow-pull", "vllm-pull", "vllm-push")
COLOURS = {"kvflow": "#1f77b4", "kvflow-first": "#2ca02c", "kvflow-spin": "#9467bd", "kvflow-pull": "#17becf",
           "vllm-pull": "#d62728", "vllm-push": "#ff7f0e"}  # fmt: skip
MiB = 2**20


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    return {k: None if v is None else round(v, 3) for k, v in percentiles(values).items()}


def summarise(
    system: str,
    phase: int,
    qps: float,
    rows: Sequence[Mapping[str, Any]],
    duration_s: float,
    counters: Mapping[str, float],
    cpu: Mapping[str, Mapping[str, float]],
    kv_bytes_per_token: int,
) -> dict[str, Any]:
    """One (system, phase, rate) cell from its requests' `rows` (`client.Result.row`), the
    metric `counters` that moved during the turn (D's ``external``/``local`` prompt tokens and
    every connector's ``bytes_transferred`` sum, P's and D's) and `cpu`: per role (``p``,
    ``d``) its ``idle_s``/``idle_cpu_s`` and ``load_s``/``load_cpu_s`` windows."""
    ok = [r for r in rows if not r["error"]]

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in ok if r[key] is not None]

    external = int(counters.get("external_tokens", 0))
    tokens = sum(int(r["tokens"]) for r in ok)

    def cores(role: str, window: str) -> float | None:
        seconds = cpu.get(role, {}).get(f"{window}_s", 0.0)
        return round(cpu[role][f"{window}_cpu_s"] / seconds, 4) if seconds > 0 else None

    load_cpu = sum(cpu.get(role, {}).get("load_cpu_s", 0.0) for role in ("p", "d"))

    def p_mean_ms(key: str) -> float | None:  # from P's vLLM histogram: what a first token from P can reach
        count = counters.get(f"{key}_count", 0.0)
        return round(counters[f"{key}_s_sum"] * 1e3 / count, 1) if count > 0 else None

    return {
        "system": system,
        "phase": phase,
        "qps": qps,
        "requests": len(rows),
        "completed": len(ok),
        "failed": len(rows) - len(ok),
        "errors": sorted({str(r["error"]) for r in rows if r["error"]})[:5],
        "duration_s": round(duration_s, 3),
        "output_tokens_per_s": round(tokens / duration_s, 2) if duration_s > 0 else None,
        "ttft_ms": _stats(values("ttft_ms")),
        "p_ttft_ms_mean": p_mean_ms("p_ttft"),  # P's own: arrival at P to its token
        "p_prefill_ms_mean": p_mean_ms("p_prefill"),  # P's prefill alone
        "tpot_ms": _stats(values("tpot_ms")),
        "e2e_ms": _stats(values("e2e_ms")),
        "kv": {
            "prompt_tokens": sum(int(r["prompt"]) for r in rows),
            "external_tokens": external,  # D: prompt tokens whose KV came by transfer
            "local_tokens": int(counters.get("local_tokens", 0)),  # D: prompt tokens D computed itself
            "bytes_by_tokens": external * kv_bytes_per_token,
            "connector_bytes": {k: int(v) for k, v in counters.items() if k.endswith("_bytes")},
        },
        "cpu_cores": {
            "idle": {role: cores(role, "idle") for role in ("p", "d")},
            "load": {role: cores(role, "load") for role in ("p", "d")},
        },
        "cpu_ms_per_request": round(load_cpu * 1e3 / len(rows), 2) if rows else None,
        "per_request": list(rows),
    }


def order(cells: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """By phase, run, rate, then the systems' usual order."""

    def key(c: Mapping[str, Any]) -> tuple[int, int, float, int, str]:
        s = str(c["system"])
        return int(c["phase"]), _run(c), float(c["qps"]), SYSTEM_ORDER.index(s) if s in SYSTEM_ORDER else 99, s

    return sorted(cells, key=key)


def write(results: Mapping[str, Any], folder: Path) -> list[Path]:
    """results.json and the plots in `folder` (created); the paths, results.json first.

    :raises ConfigError: a figure is not JSON (a NaN), nothing written.
    """
    try:
        text = json.dumps(results, indent=1, sort_keys=True, allow_nan=False)
    except ValueError as error:
        raise ConfigError(f"results cannot be written as JSON: {error}") from error
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RESULTS_FILE).write_text(text + "\n")
    return [folder / RESULTS_FILE, *plot(results, folder)]


def _run(cell: Mapping[str, Any]) -> int:
    return int(cell.get("repeat", 1))  # results written before runs were repeated had one


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _cores(pair: Mapping[str, float | None]) -> str:
    return "/".join("—" if pair[r] is None else f"{pair[r]:.2f}" for r in ("p", "d"))


def _mib(value: float) -> str:
    return f"{value / MiB:.1f}"


def _row(c: Mapping[str, Any]) -> list[str]:
    kv = c["kv"]
    moved = sum(kv["connector_bytes"].values())
    return [
        c["system"],
        f"{c['completed']}/{c['failed']}",
        *(_ms(c["ttft_ms"][k]) for k in ("p50", "p90", "p99")),
        _ms(c.get("p_ttft_ms_mean")),
        *(_ms(c["tpot_ms"][k]) for k in ("p50", "p90", "p99")),
        *(_ms(c["e2e_ms"][k]) for k in ("p50", "p90", "p99")),
        f"{kv['external_tokens']}/{kv['prompt_tokens']}",
        _mib(kv["bytes_by_tokens"]),
        _mib(moved) if moved else "—",
        _cores(c["cpu_cores"]["idle"]),
        _cores(c["cpu_cores"]["load"]),
    ]


_LATENCY = tuple(f"{m} {q}" if q == "p50" else q for m in ("TTFT", "TPOT", "E2E") for q in ("p50", "p90", "p99"))
COLUMNS = ("system", "done/failed", *_LATENCY[:3], "P's TTFT mean", *_LATENCY[3:], "KV tokens xfer/prompt",
           "KV MiB", "connector MiB", "CPU idle P/D", "CPU load P/D")  # fmt: skip


def _progress(delay_us: int | None) -> str:
    return "stock, polling without pause" if delay_us is None else f"sleeping {delay_us} µs between polls"


def header_lines(results: Mapping[str, Any]) -> list[str]:
    config = results["config"]
    m, w = config["model"], config["workload"]
    lines = [
        f"model: tiny Llama, {m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_heads']} heads, "
        f"{m['num_kv_heads']} KV heads x head_dim {m['head_dim']}, {m['dtype']}: "
        f"KV {m['kv_bytes_per_token'] / 1024:g} KiB/token, {m['kv_mib_per_request']:g} MiB for a mean prompt",
        f"workload: Poisson arrivals (open loop) at {', '.join(f'{q:g}' for q in w['qps'])} req/s, "
        f"{w['requests_per_point']} requests each; prompt {w['prompt']['dist']} {w['prompt']['min']}.."
        f"{w['prompt']['max']} tokens, output {w['output']['dist']} {w['output']['min']}..{w['output']['max']}; "
        f"seed {w['seed']}",
        f"order: {config['order']}",
        f"machine: {config['machine']}; load {config['load_before']} before, {config['load_after']} after",
        f"vLLM's NIXL progress threads: {_progress(config.get('nixl_progress_delay_us'))}",
        f"runs: {config.get('repeats', 1)} of every phase, the first system at each rate rotating between them",
    ]
    lines += [f"left out: {s}: {why}" for s, why in config.get("left_out", {}).items()]
    lines += [
        f"FAILED phase {f['phase']} ({', '.join(f['systems'])}): {f['error']}" for f in config.get("failed_phases", [])
    ]
    if config.get("complete") is False:
        lines.append("INCOMPLETE: the run was still going when this was written")
    return lines


def render_table(results: Mapping[str, Any]) -> str:
    """The header, then one table per phase and rate (times in ms, CPU in cores), and a
    warning line for every cell with failed requests.

    :raises ConfigError: rich is missing.
    """
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ModuleNotFoundError as error:
        raise ConfigError(f"the table needs the bench extra (pip install 'kvflow[bench]'): {error}") from error
    cells = order(results["cells"])
    out = io.StringIO()
    console = Console(file=out, width=220, color_system=None, force_terminal=False)
    for phase, run, qps in dict.fromkeys((int(c["phase"]), _run(c), float(c["qps"])) for c in cells):
        title = f"phase {phase}, run {run}, {qps:g} req/s (ms; CPU in cores)"
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
        for i, name in enumerate(COLUMNS):
            table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
        here = [c for c in cells if (int(c["phase"]), _run(c), float(c["qps"])) == (phase, run, qps)]
        for c in here:
            table.add_row(*_row(c))
        console.print(table)
        for c in here:
            if c["failed"]:
                console.print(f"WARNING {c['system']}: {c['failed']} of {c['requests']} failed: {c['errors']}")
    lines = [*header_lines(results), *out.getvalue().splitlines(), *spread_lines(cells)]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def spread_lines(cells: Sequence[Mapping[str, Any]], first: str = "kvflow") -> list[str]:
    """Per phase and rate: each system's TTFT p50 in every run, and `first`'s ratio to each other
    system run by run (the comparison, and how much it moved between runs)."""
    lines: list[str] = []
    by_point: dict[tuple[int, float], dict[str, dict[int, float | None]]] = {}
    for c in order(cells):
        point = by_point.setdefault((int(c["phase"]), float(c["qps"])), {})
        point.setdefault(str(c["system"]), {})[_run(c)] = c["ttft_ms"]["p50"]
    for (phase, qps), systems in by_point.items():
        runs = sorted({r for p50s in systems.values() for r in p50s})
        parts = [f"{s} {' / '.join(_ms(p50s.get(r)) for r in runs)}" for s, p50s in systems.items()]
        mine = systems.get(first, {})
        for other, theirs in systems.items():
            if other == first or not mine:
                continue
            ratios = [_ratio(mine.get(r), theirs.get(r)) for r in runs]
            parts.append(f"{first}/{other} {' / '.join(ratios)}")
        lines.append(f"TTFT p50 by run, phase {phase}, {qps:g} req/s: " + "; ".join(parts))
    return lines


def _ratio(mine: float | None, theirs: float | None) -> str:
    return "—" if mine is None or not theirs else f"{mine / theirs:.2f}x"


def markdown_table(results: Mapping[str, Any]) -> str:
    """Every cell as one row of a GitHub Markdown table."""
    head = "| phase | run | req/s | " + " | ".join(COLUMNS) + " |"
    lines = [head, "|---:|---:|---:|---|" + "---:|" * (len(COLUMNS) - 1)]
    for c in order(results["cells"]):
        lines.append(f"| {c['phase']} | {_run(c)} | {float(c['qps']):g} | " + " | ".join(_row(c)) + " |")
    return "\n".join(lines) + "\n"


def _series(results: Mapping[str, Any]) -> dict[tuple[str, int, int], list[Mapping[str, Any]]]:
    out: dict[tuple[str, int, int], list[Mapping[str, Any]]] = {}
    for c in order(results["cells"]):
        out.setdefault((str(c["system"]), int(c["phase"]), _run(c)), []).append(c)
    return out


def plot(results: Mapping[str, Any], folder: Path) -> list[Path]:
    """TTFT, TPOT and E2E against the rate (p50 solid, p90 dashed; a line per system and
    phase) and the engines' CPU idle and under load (bars), as PNGs in `folder`.

    :raises ConfigError: matplotlib is missing.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as error:
        raise ConfigError(f"plots need the bench extra (pip install 'kvflow[bench]'): {error}") from error
    model = results["config"]["model"]
    subtitle = f"tiny Llama, KV {model['kv_bytes_per_token'] / 1024:g} KiB/token, real vLLM CPU servers 1P1D"
    written = []
    series = _series(results)
    markers = "osD^v"
    for metric, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        figure = Figure(figsize=(8.0, 5.0), layout="constrained")
        FigureCanvasAgg(figure)
        ax = figure.add_subplot()
        for (system, phase, run), cells in series.items():
            for q, style in (("p50", "-"), ("p90", "--")):
                points = [(float(c["qps"]), c[metric][q]) for c in cells if c[metric][q] is not None]
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, style, marker=markers[(phase - 1) % len(markers)],
                            color=COLOURS.get(system, "#7f7f7f"),
                            label=f"{system} (phase {phase}, run {run}) {q}")  # fmt: skip
        ax.set_xlabel("offered load (requests/s, Poisson)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} p50 (solid) and p90 (dashed) against load\n{subtitle}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small")
        path = folder / f"{metric.removesuffix('_ms')}_vs_qps.png"
        figure.savefig(path, dpi=110)
        written.append(path)
    figure = Figure(figsize=(9.0, 5.0), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    labels, idle, load = [], [], []
    for c in order(results["cells"]):
        labels.append(f"{c['system']}\nph{c['phase']} r{_run(c)} {float(c['qps']):g}/s")
        idle.append(sum(v or 0.0 for v in c["cpu_cores"]["idle"].values()))
        load.append(sum(v or 0.0 for v in c["cpu_cores"]["load"].values()))
    at = list(range(len(labels)))
    ax.bar([x - 0.2 for x in at], idle, width=0.4, label="idle (P+D)", color="#9ecae1")
    ax.bar([x + 0.2 for x in at], load, width=0.4, label="under load (P+D)", color="#3182bd")
    ax.set_xticks(at, labels, fontsize="x-small")
    ax.set_ylabel("CPU (cores) of the engines' process groups")
    ax.set_title(f"engine CPU idle and under load\n{subtitle}")
    ax.legend(fontsize="small")
    path = folder / "cpu.png"
    figure.savefig(path, dpi=110)
    return [*written, path]
