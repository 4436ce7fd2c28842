"""`kvflow bench vllm`'s figures: the per-cell record, its summary, the table and the verdict.

Why its own module: the benchmark's runner (`bench`) drives engine processes and plays the
router; what is computed from its records, and how it is printed, changes with each new figure.
Kept apart, each new cell or figure touches one small module, and the summary can be tested
without starting an engine.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from kvflow.runtime.meter import quantile

__all__ = ("Cell", "render", "render_hooks", "summarize", "verdict")


@dataclass
class Cell:
    connector: str
    tokens: int
    concurrency: int
    step_ms: float
    repeat: int
    requests: int
    chunks: int = 1  # P's token budget is tokens / chunks: its prefill takes this many steps
    fin_to_recv_ms: list[float] = field(default_factory=list)
    kv_to_recv_ms: list[float] = field(default_factory=list)
    start_to_recv_ms: list[float] = field(default_factory=list)  # from the start of P's last prefill step
    d_steps: list[int] = field(default_factory=list)
    fin_to_sent_ms: list[float] = field(default_factory=list)
    p_free_steps: list[int] = field(default_factory=list)  # P's steps from request_finished to finished_sending
    p_hooks_us: list[float] = field(default_factory=list)  # per P step: time inside connector hooks
    d_hooks_us: list[float] = field(default_factory=list)
    p_hooks_cpu_us: list[float] = field(default_factory=list)  # ... of it, the model runner thread's CPU
    d_hooks_cpu_us: list[float] = field(default_factory=list)
    p_prefill_hooks_us: list[float] = field(default_factory=list)  # per P step that computed prompt tokens
    p_prefill_hooks_cpu_us: list[float] = field(default_factory=list)
    p_prefill_step_ms: list[float] = field(default_factory=list)  # ... the step's length
    p_hook_us: dict[str, list[float]] = field(default_factory=dict)  # per hook name, per P step it ran in
    d_hook_us: dict[str, list[float]] = field(default_factory=dict)
    bytes_verified: int = 0
    bad_pages: int = 0
    failed: int = 0
    vllm: str = ""  # the vLLM release its engines ran


def summarize(cells: list[Cell]) -> list[dict[str, Any]]:
    """One row per (connector, tokens, chunks, concurrency, pacing): medians over repeats of
    each repeat's p50 and p90, and totals; the bytes each request moved (its pages D checked)."""
    groups: dict[tuple[str, int, int, int, float], list[Cell]] = {}
    for cell in cells:
        key = (cell.connector, cell.tokens, cell.chunks, cell.concurrency, cell.step_ms)
        groups.setdefault(key, []).append(cell)
    rows = []
    for (connector, n_tokens, chunks, conc, pace), group in groups.items():

        def med(metric: str, q: float, group: list[Cell] = group) -> float:
            return round(statistics.median(quantile(getattr(c, metric), q) for c in group), 2)

        rows.append(
            {
                "connector": connector,
                "vllm": group[0].vllm,
                "tokens": n_tokens,
                "chunks": chunks,
                "concurrency": conc,
                "step_ms": pace,
                "fin_to_recv_p50_ms": med("fin_to_recv_ms", 0.5),
                "fin_to_recv_p90_ms": med("fin_to_recv_ms", 0.9),
                "kv_to_recv_p50_ms": med("kv_to_recv_ms", 0.5),
                "start_to_recv_p50_ms": med("start_to_recv_ms", 0.5),
                "start_to_recv_p90_ms": med("start_to_recv_ms", 0.9),
                "d_steps_p50": med("d_steps", 0.5),
                "d_steps_p90": med("d_steps", 0.9),
                "fin_to_sent_p50_ms": med("fin_to_sent_ms", 0.5),
                "p_free_steps_p50": med("p_free_steps", 0.5),
                "p_free_steps_p90": med("p_free_steps", 0.9),
                "p_hooks_p50_us": med("p_hooks_us", 0.5),
                "p_hooks_p99_us": med("p_hooks_us", 0.99),
                "d_hooks_p50_us": med("d_hooks_us", 0.5),
                "d_hooks_p99_us": med("d_hooks_us", 0.99),
                "p_hooks_cpu_p99_us": med("p_hooks_cpu_us", 0.99),
                "p_prefill_hooks_p50_us": med("p_prefill_hooks_us", 0.5),
                "p_prefill_hooks_p99_us": med("p_prefill_hooks_us", 0.99),
                "p_prefill_hooks_cpu_p50_us": med("p_prefill_hooks_cpu_us", 0.5),
                "p_prefill_step_p50_ms": med("p_prefill_step_ms", 0.5),
                "d_hooks_cpu_p99_us": med("d_hooks_cpu_us", 0.99),
                "p_hook_us": _per_hook(group, "p_hook_us"),
                "d_hook_us": _per_hook(group, "d_hook_us"),
                "requests": sum(c.requests for c in group),
                "bytes_verified": sum(c.bytes_verified for c in group),
                "bytes_per_request": _per_request(group),
                "bad_pages": sum(c.bad_pages for c in group),
                "failed": sum(c.failed for c in group),
            }
        )
    return rows


def _per_hook(group: list[Cell], side: str) -> dict[str, dict[str, float]]:
    """Per hook name: the median over repeats of each repeat's p50 and p99 (µs per step)."""
    names = sorted({name for c in group for name in getattr(c, side)})
    out = {}
    for name in names:
        samples = [getattr(c, side).get(name, []) for c in group]
        out[name] = {
            f"p{round(q * 100)}": round(statistics.median(quantile(v, q) for v in samples), 1) for q in (0.5, 0.99)
        }
    return out


def _per_request(group: list[Cell]) -> int:
    """The bytes one request moved (every request of a cell moves the same prompt)."""
    landed = sum(c.requests - c.failed for c in group)
    return sum(c.bytes_verified for c in group) // landed if landed else 0


def render(rows: list[dict[str, Any]]) -> str:
    runs = {r["connector"]: r.get("vllm", "") for r in rows}
    releases = ", ".join(f"{connector} on {release or '?'}" for connector, release in sorted(runs.items()))
    header = (
        f"{'connector':<14} {'tokens':>6} {'chunks':>6} {'conc':>4} {'step':>5} | {'fin→recv p50':>12} {'p90':>7} "
        f"{'kv→recv p50':>11} {'start→recv':>10} {'p90':>6} | {'D steps p50':>11} {'p90':>5} | "
        f"{'P free p50':>10} {'steps':>5} {'p90':>3} | "
        f"{'P hooks µs p50':>14} {'p99':>6} {'CPU p99':>7} {'D p50':>6} {'p99':>6} {'CPU p99':>7} | "
        f"{'KiB/req':>8} {'verified':>9} {'bad':>4} {'failed':>6}"
    )
    lines = [f"vLLM: {releases}", header, "-" * len(header)]
    for r in sorted(rows, key=lambda r: (r["tokens"], r["chunks"], r["concurrency"], r["step_ms"], r["connector"])):
        pace = f"{r['step_ms']:g}ms" if r["step_ms"] else "fast"
        lines.append(
            f"{r['connector']:<14} {r['tokens']:>6} {r['chunks']:>6} {r['concurrency']:>4} {pace:>5} | "
            f"{r['fin_to_recv_p50_ms']:>12.1f} {r['fin_to_recv_p90_ms']:>7.1f} {r['kv_to_recv_p50_ms']:>11.1f} "
            f"{r['start_to_recv_p50_ms']:>10.1f} {r['start_to_recv_p90_ms']:>6.1f} | "
            f"{r['d_steps_p50']:>11.0f} {r['d_steps_p90']:>5.0f} | {r['fin_to_sent_p50_ms']:>10.1f} "
            f"{r['p_free_steps_p50']:>5.0f} {r['p_free_steps_p90']:>3.0f} | "
            f"{r['p_hooks_p50_us']:>14.0f} {r['p_hooks_p99_us']:>6.0f} {r['p_hooks_cpu_p99_us']:>7.0f} "
            f"{r['d_hooks_p50_us']:>6.0f} {r['d_hooks_p99_us']:>6.0f} {r['d_hooks_cpu_p99_us']:>7.0f} | "
            f"{r['bytes_per_request'] / 2**10:>8.0f} "
            f"{r['bytes_verified'] / 2**20:>7.0f}Mi {r['bad_pages']:>4} {r['failed']:>6}"
        )
    return "\n".join(lines)


def render_hooks(rows: list[dict[str, Any]]) -> str:
    """Per row, each hook's time per engine step on P and on D: p50/p99 µs, the hooks that ran."""
    lines = ["connector hook time per step, µs p50/p99:"]
    for r in sorted(rows, key=lambda r: (r["tokens"], r["chunks"], r["concurrency"], r["step_ms"], r["connector"])):
        pace = f"{r['step_ms']:g}ms" if r["step_ms"] else "fast"
        lines.append(f"  {r['connector']} {r['tokens']} tok/{r['chunks']} c{r['concurrency']} {pace}:")
        for side in ("p", "d"):
            hooks = r.get(f"{side}_hook_us", {})
            shown = ", ".join(f"{name} {v['p50']:.0f}/{v['p99']:.0f}" for name, v in hooks.items())
            lines.append(f"    {side.upper()}: {shown or '-'}")
    return "\n".join(lines)


def render_costs(rows: list[dict[str, Any]]) -> str:
    """Per cell, every connector side by side: what P's hooks cost per step and per prefill
    step (wall and CPU, µs p50), P's prefill step (ms p50), and P's finish to D's receipt."""
    header = (
        f"{'cell':<22} {'connector':<14} | {'P hooks/step p50':>16} {'p99':>6} | {'per prefill step p50':>20} "
        f"{'p99':>6} {'CPU p50':>7} | {'prefill step ms p50':>19} | {'fin→recv p50':>12} {'p90':>6}"
    )
    lines = ["what P's hooks cost, cell by cell (µs unless said):", header, "-" * len(header)]
    order = sorted(rows, key=lambda r: (r["tokens"], r["chunks"], r["concurrency"], r["step_ms"], r["connector"]))
    for r in order:
        pace = f"{r['step_ms']:g}ms" if r["step_ms"] else "fast"
        cell = f"{r['tokens']}/{r['chunks']} c{r['concurrency']} {pace}"
        lines.append(
            f"{cell:<22} {r['connector']:<14} | {r['p_hooks_p50_us']:>16.0f} {r['p_hooks_p99_us']:>6.0f} | "
            f"{r.get('p_prefill_hooks_p50_us', 0.0):>20.0f} {r.get('p_prefill_hooks_p99_us', 0.0):>6.0f} "
            f"{r.get('p_prefill_hooks_cpu_p50_us', 0.0):>7.0f} | {r.get('p_prefill_step_p50_ms', 0.0):>19.2f} | "
            f"{r['fin_to_recv_p50_ms']:>12.1f} {r['fin_to_recv_p90_ms']:>6.1f}"
        )
    return "\n".join(lines)


def _ratio(row: dict[str, Any], theirs: dict[str, Any], metric: str) -> str:
    return f"{row[metric] / theirs[metric]:.2f}x" if theirs[metric] else "-"


def verdict(rows: list[dict[str, Any]], ours: str = "kvflow") -> list[str]:
    """Per cell: our p50 against the best of vLLM's connectors measured; for a chunked prefill,
    from the end of P's last step (``kv→recv``), where pushing earlier chunks pays off."""
    out = []
    keyed = {(r["connector"], r["tokens"], r["chunks"], r["concurrency"], r["step_ms"]): r for r in rows}
    for (connector, n_tokens, chunks, conc, pace), row in sorted(keyed.items(), key=lambda kv: kv[0][1:]):
        if connector != ours:
            continue
        theirs = [
            r for key, r in keyed.items() if key[0].startswith("vllm-") and key[1:] == (n_tokens, chunks, conc, pace)
        ]
        if not theirs:
            continue
        metric, name = ("kv_to_recv_p50_ms", "kv→recv") if chunks > 1 else ("fin_to_recv_p50_ms", "fin→recv")
        best = min(theirs, key=lambda r: r[metric])
        ratio = row[metric] / best[metric] if best[metric] else float("nan")
        pace_name = f"{pace:g} ms steps" if pace else "fast steps"
        prompt = f"{n_tokens} tokens in {chunks} chunks" if chunks > 1 else f"{n_tokens} tokens"
        start = min(theirs, key=lambda r: r["start_to_recv_p50_ms"])
        out.append(
            f"{prompt}, {conc} in flight, {pace_name}: {ours} {name} p50 {row[metric]:.1f} ms vs "
            f"{best['connector']} {best[metric]:.1f} ms ({ratio:.2f}x); from the start of P's last step "
            f"p50 {_ratio(row, start, 'start_to_recv_p50_ms')}, p90 {_ratio(row, start, 'start_to_recv_p90_ms')} "
            f"of {start['connector']}'s"
        )
    return out
