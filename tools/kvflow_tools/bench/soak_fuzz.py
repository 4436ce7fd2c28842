"""`kvflow soak --fuzz`: control-port attacks on P while the soak's transfers run, and what they cost.

Why apart from the soak: the soak drives transfers and faults; this starts the attacker
(`python -m kvflow_tools.testing.fuzz_process`, a process of its own, with its own descriptors),
follows each attack's window from the lines it prints, reads P's control counters when each
window opens and closes, and, once the run is over, tells per attack: frames (parts,
connections) sent and refused, what P rejected per second, the duration, and the latency of
the real transfers that ran during the window, against those that ran outside every window.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvflow.runtime.meter import quantile
from kvflow_tools.children import PIPE, spawn

__all__ = ("Fuzzer", "latency", "render_fuzz", "window_counts")

PStats = Callable[[], Awaitable[dict[str, Any]]]


@dataclass
class Fuzzer:
    """Runs the attacker `argv` (with `env`) and records each attack's window and P's counters."""

    argv: list[str]
    env: dict[str, str]
    p_stats: PStats
    attacks: list[dict[str, Any]] = field(default_factory=list)
    failure: str = ""

    async def run(self) -> None:
        """Until the attacker exits.  Never raises: a failure is kept in `failure`."""
        try:
            process = await spawn(self.argv, env=self.env, stdout=True, stderr=PIPE)
        except OSError as exc:
            self.failure = f"the attacker did not start: {exc}"
            return
        assert process.stdout is not None and process.stderr is not None  # both piped
        before: dict[str, int] = {}
        async for raw in process.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            counters = await self._counters()
            if event.get("event") == "begin":
                before = counters
                continue
            event["p_counters"], event["p_restarted"] = window_counts(before, counters)
            self.attacks.append(event)
            self._check(event)
        error = (await process.stderr.read()).decode(errors="replace").strip()
        if await process.wait() != 0:
            self.failure = f"the attacker exited with {process.returncode}: {error[-500:]}"

    def _check(self, event: dict[str, Any]) -> None:
        """An attack that could not run, or neither sent anything nor was refused (a try P turned
        down, as CURVE turns a stranger's, counts), did not do what the run claims: the first
        such is the fuzz's failure."""
        name = event.get("attack", "?")
        if "error" in event:
            why = f"attack {name} could not run: {event['error']}"
        elif not event.get("sent") and not event.get("refused"):
            why = f"attack {name} sent nothing"
        else:
            return
        self.failure = self.failure or why

    async def _counters(self) -> dict[str, int]:
        try:
            control = (await self.p_stats()).get("control", {})
        except Exception:  # P is gone (a fault): no counters for this window
            return {}
        return {k: v for k, v in control.items() if isinstance(v, int) and k != "connections_open"}

    def report(self, timeline: list[tuple[float, float, str]], p_end: dict[str, Any]) -> dict[str, Any]:
        """Per attack its figures and the latency of transfers overlapping its window; the
        latency of those outside every window; P's RSS and descriptors at the end."""
        windows = []
        for event in self.attacks:
            end = float(event["t"])
            start = end - float(event.get("duration", 0.0))
            windows.append((start, end))
            rejected = event["p_counters"].get("rejected", 0)
            duration = float(event.get("duration", 0.0))
            event["p_rejected_per_s"] = round(rejected / duration, 1) if duration > 0 else 0.0
            during = [t for t in timeline if t[0] < end and t[1] > start]
            event["transfers"] = latency(during)
        outside = [t for t in timeline if not any(t[0] < end and t[1] > start for start, end in windows)]
        return {"attacks": self.attacks, "outside": latency(outside), "p_end": p_end, "failure": self.failure}


def window_counts(before: dict[str, int], after: dict[str, int]) -> tuple[dict[str, int], bool]:
    """What P's counters grew by over a window (those that moved), and whether P restarted
    within it: then a counter is lower than at the window's start, and what it holds is what
    the new process counted, a lower bound; a difference would go negative."""
    restarted = any(after.get(k, 0) < v for k, v in before.items())
    base = {} if restarted else before
    return {k: v - base.get(k, 0) for k, v in after.items() if v != base.get(k, 0)}, restarted


def latency(transfers: list[tuple[float, float, str]]) -> dict[str, Any]:
    """Count, failures and p50 / p99 / max latency (ms) of (start, end, D's outcome) records."""
    if not transfers:
        return {"n": 0}
    ms = sorted((end - start) * 1000 for start, end, _ in transfers)
    failed = sum(1 for *_, outcome in transfers if outcome != "succeeded")
    return {
        "n": len(ms),
        "failed": failed,
        "p50_ms": round(quantile(ms, 0.5), 1),
        "p99_ms": round(quantile(ms, 0.99), 1),
        "max_ms": round(ms[-1], 1),
    }


def render_fuzz(fuzz: dict[str, Any]) -> list[str]:
    lines = []
    for a in fuzz["attacks"]:
        if "error" in a:
            lines.append(f"  fuzz {a['attack']:<20} could not run: {a['error']}")
            continue
        lines.append(
            f"  fuzz {a['attack']:<20} sent {a['sent']} refused {a['refused']} in {a['duration']:.2f} s "
            f"({a['rate']:.0f}/s); P rejected {a['p_rejected_per_s']}/s, counters {a['p_counters']}"
            f"{' (P restarted: since then)' if a.get('p_restarted') else ''}; "
            f"transfers meanwhile {a['transfers']}"
        )
    lines.append(f"  fuzz transfers outside the attacks {fuzz['outside']}")
    lines.append(f"  fuzz P at the end {fuzz['p_end']}")
    if fuzz["failure"]:
        lines.append(f"  fuzz FAILED: {fuzz['failure']}")
    return lines
