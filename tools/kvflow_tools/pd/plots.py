"""The plots of `kvflow bench pd`: latency against load, the TTFT distribution and split, blocks.

Why its own module: each plot is a function of the results document returning its `Figure`, so
tests inspect what was drawn (lines, bars) rather than pixels, and `report` stays about tables.
Figures are drawn on matplotlib's Agg canvas directly, never through pyplot: no display, no
global figure state, safe in any process.  Each system keeps one colour in every plot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvflow_tools.pd.contract import SPLIT_PARTS, cell, qps_points, scale_text, systems

__all__ = (
    "FIGURES",
    "LOG_SPREAD",
    "blocks",
    "colour",
    "save_all",
    "system_lines",
    "title",
    "tpot_vs_qps",
    "ttft_cdf",
    "ttft_split",
    "ttft_vs_qps",
)

COLOURS = {
    "kvflow": "#1f77b4",
    "kvflow-pull": "#17becf",
    "vllm-pull": "#d62728",
    "vllm-push": "#ff7f0e",
    "vllm-push-0.33": "#8c564b",
}
_OTHERS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
LOG_SPREAD = 20.0  # a y axis spanning more than this factor is drawn on a log scale
_SPLIT_LABELS = {
    "p_queue": "queue on P",
    "prefill": "prefill",
    "transfer_wait": "transfer wait",
    "d_queue": "queue on D",
}
_SPLIT_COLOURS = {"p_queue": "#c6dbef", "prefill": "#6baed6", "transfer_wait": "#fd8d3c", "d_queue": "#969696"}


def colour(results: Mapping[str, Any], system: str) -> str:
    """`system`'s colour: fixed for the known systems, by order of appearance for the others."""
    if system in COLOURS:
        return COLOURS[system]
    others = [s for s in systems(results) if s not in COLOURS]
    return _OTHERS[others.index(system) % len(_OTHERS)]


def title(results: Mapping[str, Any], what: str, qps: float | None = None) -> str:
    """What the plot shows, on which model, GPU, TP and KV scale, at which load."""
    model, gpu = results["config"]["model"], results["config"]["gpu"]
    points = qps_points(results)
    load = f"QPS {qps:g}" if qps is not None else f"QPS {points[0]:g}–{points[-1]:g}"
    return f"{what}\n{model['name']} on {gpu['name']}, TP {gpu['tp']}, KV bytes {scale_text(model['scale'])}, {load}"


def _latency_vs_qps(results: Mapping[str, Any], metric: str, name: str) -> Figure:
    figure = _figure()
    ax = figure.add_subplot()
    drawn: list[float] = []
    for system in systems(results):
        for q, style in (("p50", "-"), ("p90", "--")):
            points = [
                (qps, found[metric][q])
                for qps in qps_points(results)
                if (found := cell(results, system, qps)) is not None and found[metric][q] is not None
            ]
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, style, marker="o", color=colour(results, system), label=f"{system} {q}")
            drawn += ys
    _log_if_spread(ax, drawn)
    ax.set_xlabel("offered load (requests/s, Poisson)")
    ax.set_ylabel(f"{name} (ms)")
    ax.set_title(title(results, f"{name} p50 (solid) and p90 (dashed) against load"))
    _legend(ax)
    return figure


def ttft_vs_qps(results: Mapping[str, Any]) -> Figure:
    """TTFT p50 (solid) and p90 (dashed) per system against QPS: two lines per system."""
    return _latency_vs_qps(results, "ttft_ms", "TTFT")


def tpot_vs_qps(results: Mapping[str, Any]) -> Figure:
    """TPOT p50 (solid) and p90 (dashed) per system against QPS: two lines per system."""
    return _latency_vs_qps(results, "tpot_ms", "TPOT")


def ttft_cdf(results: Mapping[str, Any]) -> Figure:
    """The CDF of every completed request's TTFT per system at the highest QPS: one line each."""
    qps = qps_points(results)[-1]
    figure = _figure()
    ax = figure.add_subplot()
    drawn: list[float] = []
    for system in systems(results):
        found = cell(results, system, qps)
        ttfts = sorted(r["ttft_ms"] for r in (found or {}).get("per_request", []) if r["ttft_ms"] is not None)
        if not ttfts:
            continue
        shares = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        ax.plot(ttfts, shares, drawstyle="steps-post", color=colour(results, system), label=system)
        drawn += ttfts
    if drawn and min(drawn) > 0 and max(drawn) / min(drawn) > LOG_SPREAD:
        ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(title(results, "TTFT distribution", qps))
    _legend(ax)
    return figure


def ttft_split(results: Mapping[str, Any]) -> Figure:
    """Stacked bars per system at the highest QPS: mean queue on P, prefill, transfer wait and
    queue on D (one bar container per part, one bar per system)."""
    qps = qps_points(results)[-1]
    found = [c for s in systems(results) if (c := cell(results, s, qps)) is not None]
    names = [c["system"] for c in found]
    figure = _figure()
    ax = figure.add_subplot()
    bottoms = [0.0] * len(names)
    for part in SPLIT_PARTS:
        heights = [float(c["ttft_split_ms"][part] or 0.0) for c in found]  # a split of no request: 0
        ax.bar(names, heights, bottom=bottoms, color=_SPLIT_COLOURS[part], label=_SPLIT_LABELS[part])
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_xlabel("system")
    ax.set_ylabel("mean TTFT share (ms)")
    ax.set_title(title(results, "where TTFT goes (means)", qps))
    _legend(ax)
    return figure


def blocks(results: Mapping[str, Any]) -> Figure:
    """Blocks in use over time at the highest QPS: P above, D below, one line per system each."""
    qps = qps_points(results)[-1]
    capacity = results["config"]["capacity"]
    figure = _figure(height=7.0)
    top, bottom = figure.subplots(2, 1, sharex=True)
    for ax, side, limit in ((top, "p", capacity["p_blocks"]), (bottom, "d", capacity["d_blocks"])):
        for system in systems(results):
            found = cell(results, system, qps)
            series = found["blocks"][side] if found else []
            if not series:
                continue
            xs, ys = zip(*series, strict=True)
            ax.plot(xs, ys, drawstyle="steps-post", color=colour(results, system), label=system)
        ax.axhline(limit, color="black", linewidth=0.8, linestyle=":")  # not a system: see `system_lines`
        ax.set_ylim(bottom=0)
        ax.set_ylabel(f"blocks used on {side.upper()} (of {limit})")
        _legend(ax)
    bottom.set_xlabel("time since the point started (s)")
    top.set_title(title(results, "KV blocks in use", qps))
    return figure


def system_lines(ax: Axes) -> int:
    """The lines of `ax` that draw a system (the capacity rule is not one)."""
    return sum(1 for line in ax.get_lines() if not str(line.get_label()).startswith("_"))


FIGURES: dict[str, Callable[[Mapping[str, Any]], Figure]] = {
    "ttft_vs_qps.png": ttft_vs_qps,
    "tpot_vs_qps.png": tpot_vs_qps,
    "ttft_cdf.png": ttft_cdf,
    "ttft_split.png": ttft_split,
    "blocks.png": blocks,
}


def save_all(results: Mapping[str, Any], folder: Path) -> list[Path]:
    """Every figure of `FIGURES` as a PNG in `folder` (which must exist); the paths written.

    :raises OSError: a file cannot be written.
    """
    written = []
    for name, build in FIGURES.items():
        figure = build(results)
        path = folder / name
        figure.savefig(path, dpi=110)
        written.append(path)
    return written


def _figure(height: float = 5.0) -> Figure:
    figure = Figure(figsize=(8.0, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _log_if_spread(ax: Axes, values: list[float]) -> None:
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > LOG_SPREAD:
        ax.set_yscale("log")


def _legend(ax: Axes) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
