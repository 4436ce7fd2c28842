"""`kvflow bench host`: what a KV connector costs the inference engine it runs in.

Why: a connector's hooks can be cheap while the connector still slows its host down: threads
of its own in the host's interpreter take the GIL (and a core) from the engine's step loop.
So this benchmark measures the host, not the hook.  Each engine (P and D, vLLM's real
Scheduler and worker hooks, `runner`) steps back to back like an engine core busy with other
requests, and every step does a fixed amount of the host's own work (`standin.pacing.HostLoad`):
pure-Python work holding the interpreter, spread over the forward's layers, then a wait with the
interpreter released (the GPU computing).  Alone, a step takes its Python share plus the wait;
whatever a connector takes from the interpreter or the cores shows as longer steps.

Systems, interleaved per transfer rate: each takes `turns` turns of `duration_s` at each rate,
the systems one after the other and the first rotating from turn to turn, and a (system,
rate)'s figures pool its turns (each system's pair of processes is started once and stopped with
SIGSTOP while another is measured, so idle systems cost nothing):

* ``alone``: no KV connector (each engine computes its prompts): the baseline;
* ``kvflow``: kvflow's connector, push, layer group by layer group;
* ``vllm-pull``: vLLM's ``NixlConnector`` (D READs from its own step loop), P's answer relayed
  to D as vLLM's proxy does; ``vllm-push`` can be asked for, and ``kvflow-integrity`` (kvflow
  with the end-to-end integrity check on both sides, every transfer checked).

Where things run: by default anywhere (on a machine with few cores, kvflow's engine processes
then compete with the engines for cores).  With ``--host-cpus`` and ``--engine-cpus`` the
engines' processes run on the first set, kvflow's engine processes and this driver on the
second, as on a GPU server where the engine process has cores of its own; vLLM's connector
threads live in the engines' processes, so they stay on the first.

The KV's bytes move for real, but the host's CPU neither writes a pattern into them (P) nor
checks them (D), as on a GPU host where the forward writes the KV; `kvflow bench vllm` and
`kvflow bench pd` check every page.

Measured per (system, rate) and engine: steps/s (the host's throughput), the step time p50/p99,
the Python share's time p50/p99, the CPU the engine's processes used (the engine, and any process
of its own the connector runs), and per transfer the time from the end of P's forward that made
the KV to D's ``finished_recving``.  Before the rates, each system's pair sits idle for a while
(no steps), and the CPU it uses then is its idle cost.  Derived against ``alone`` at the same
rate: throughput loss and added step time.  Printed and written as JSON, never asserted.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvflow.errors import ConfigError
from kvflow_tools.bench.runner_pair import Flight, Pair, start_pair
from kvflow_tools.bench.systems import CONNECTORS
from kvflow_tools.errors import BenchError
from kvflow_tools.pd.contract import percentiles
from kvflow_tools.standin.pacing import burn

__all__ = ("HostOptions", "calibrate", "main", "render", "run")

SYSTEMS = ("alone", "kvflow", "vllm-pull")
WINDOW_TIMEOUT = 120.0  # seconds the window's last transfers may take after its last arrival


@dataclass(frozen=True)
class HostOptions:
    systems: tuple[str, ...] = SYSTEMS
    rates: tuple[float, ...] = (10.0, 100.0, 1000.0)  # transfers (requests) per second
    duration_s: float = 2.0  # seconds of arrivals per turn of a (system, rate)
    turns: int = 3  # turns of each system per rate, interleaved: slow drift falls on all alike
    python_ms: float = 3.0  # the host's Python work per step, interpreter held
    iterations: int = 0  # that work in `burn` iterations (0: calibrated to python_ms here, now)
    wait_ms: float = 7.0  # the rest of the step, interpreter released
    tokens: int = 64  # prompt length: blocks of 32 tokens, 8 layers
    layer_groups: int = 4  # kvflow: WRITEs per request, each posted once its layers are saved
    idle_s: float = 3.0  # seconds each pair sits idle for its idle CPU
    warmup_s: float = 1.0  # seconds of back-to-back steps before a window is measured
    nixl_progress_delay_us: int | None = None  # NIXL progress-thread delay for vLLM's agents (stock: 0)
    # the CPUs the engines (their host processes) run on, and those kvflow's engine processes and
    # this driver run on; empty: any
    host_cpus: tuple[int, ...] = ()
    engine_cpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        unknown = [s for s in self.systems if s not in CONNECTORS]
        if unknown or not self.systems:
            raise ConfigError(f"unknown systems {unknown}; choose from {sorted(CONNECTORS)}")
        if not self.rates or min(self.rates) <= 0 or self.duration_s <= 0 or self.turns < 1:
            raise ConfigError("rates, the duration and the turns must be positive")
        if self.python_ms < 0 or self.wait_ms < 0 or self.python_ms + self.wait_ms <= 0:
            raise ConfigError("a step needs some work: python_ms and wait_ms non-negative, not both 0")
        if self.iterations < 0:
            raise ConfigError("iterations must be >= 0")
        if self.tokens < 1 or self.layer_groups < 1 or self.idle_s < 0 or self.warmup_s < 0:
            raise ConfigError("tokens and layer groups must be positive, idle and warm-up times non-negative")


def calibrate(python_ms: float, rounds: int = 7) -> int:
    """How many `burn` iterations take `python_ms` on this machine (the fastest of `rounds`: the
    others met whatever else the machine was doing)."""
    if python_ms <= 0:
        return 0
    probe = 200_000
    fastest = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        burn(probe)
        fastest = min(fastest, time.perf_counter() - started)
    return max(1, int(probe / fastest * python_ms / 1e3))


@dataclass
class Window:
    """One (system, rate): what each engine did while transfers arrived."""

    system: str
    rate: float
    steps: dict[str, list[dict[str, float]]] = field(default_factory=lambda: {"P": [], "D": []})
    hooks: dict[str, list[float]] = field(default_factory=lambda: {"P": [], "D": []})  # s per step
    hooks_cpu: dict[str, list[float]] = field(default_factory=lambda: {"P": [], "D": []})
    cpu: dict[str, list[float]] = field(default_factory=dict)  # engine -> [own, children] seconds used
    seconds: float = 0.0
    flights: list[Flight] = field(default_factory=list)


Reading = dict[str, tuple[float, float, float]]  # engine -> (time, own CPU s, children's CPU s)


def _cpu(pair: Pair, timeout: float = 30.0) -> Reading:
    """Each engine's (time, own CPU s, children's CPU s), asked of the engines themselves."""
    for engine in pair.engines.values():
        engine.send(op="cpu")
    readings: Reading = {}
    deadline = time.monotonic() + timeout
    while len(readings) < len(pair.engines):
        name, event = pair.next_event(deadline, "CPU readings")
        if event["ev"] == "cpu":
            readings[name] = (event["t"], event["own"], event["children"])
    return readings


def _cpu_used(before: Reading, after: Reading) -> dict[str, list[float]]:
    return {name: [after[name][1] - before[name][1], after[name][2] - before[name][2]] for name in before}


def _idle(pair: Pair, seconds: float) -> dict[str, Any]:
    """The pair's CPU while it sits idle (no steps, no transfers), in % of one core."""
    before = _cpu(pair)
    time.sleep(seconds)
    after = _cpu(pair)
    wall = max(after["P"][0] - before["P"][0], 1e-9)
    return {
        name: {"own_pct": 100 * own / wall, "children_pct": 100 * kids / wall}
        for name, (own, kids) in _cpu_used(before, after).items()
    }


def _window(pair: Pair, system: str, rate: float, o: HostOptions, load: dict[str, Any]) -> Window:
    """Transfers at `rate` for `o.duration_s` while both engines step back to back."""
    for engine in pair.engines.values():
        engine.send(op="host", load=load, spin=True)
    _drain(pair, time.monotonic() + o.warmup_s)
    before = _cpu(pair)
    window = Window(system, rate)
    count = max(1, round(rate * o.duration_s))
    start = time.perf_counter()
    live: dict[str, Flight] = {}
    sent = 0
    last_arrival = start
    while sent < count or live:
        now = time.perf_counter()
        while sent < count and start + sent / rate <= now:
            flight = Flight(f"h{sent}-{system}-{time.monotonic_ns()}", now, decode_tokens=2)
            live[flight.request_id] = flight
            pair.dispatch(flight, o.tokens)
            sent += 1
            last_arrival = now
        if live and now - min(f.dispatched for f in live.values()) > WINDOW_TIMEOUT:
            stuck = sorted(live)[:8]
            said = "\n".join(pair.describe())
            raise BenchError(f"{system}: transfers {stuck} did not finish within {WINDOW_TIMEOUT:.0f} s\n{said}")
        wait = start + sent / rate - now if sent < count else 0.2
        try:
            name, event = pair.events.get(timeout=max(0.0, min(wait, 0.2)))
        except queue.Empty:
            continue
        _take(pair, name, event, window, live, o.tokens, (start, last_arrival if sent >= count else float("inf")))
    after = _cpu(pair)
    window.seconds = last_arrival - start if count > 1 else 1.0 / rate
    window.cpu = _cpu_used(before, after)
    window.cpu["_wall"] = [after["P"][0] - before["P"][0], 0.0]
    for engine in pair.engines.values():
        engine.send(op="host", load=load, spin=False)
    return window


def _take(
    pair: Pair,
    name: str,
    event: dict[str, Any],
    window: Window,
    live: dict[str, Flight],
    tokens: int,
    span: tuple[float, float],
) -> None:
    kind = event["ev"]
    if kind == "exit":
        raise BenchError(f"{pair.connector}: engine {name} exited (log: {pair.engines[name].log_path})")
    if kind == "hstep":
        if span[0] <= event["t"] <= span[1]:
            window.steps[name].append(event)
        return
    if kind == "hooks":  # the step's time inside the connector's hooks (rank 0), and its CPU
        window.hooks[name].append(event["s"])
        window.hooks_cpu[name].append(event.get("cpu", 0.0))
        return
    flight = live.get(event.get("id", ""))
    if flight is None:
        return
    pair.on_event(name, event, flight, tokens)
    if flight.done:
        window.flights.append(live.pop(flight.request_id))


def _drain(pair: Pair, until: float) -> None:
    """Read (and drop) the pair's events until `until` (time.monotonic)."""
    while (left := until - time.monotonic()) > 0:
        try:
            name, event = pair.events.get(timeout=left)
        except queue.Empty:
            return
        if event["ev"] == "exit":
            raise BenchError(f"{pair.connector}: engine {name} exited (log: {pair.engines[name].log_path})")


def _summary(windows: list[Window]) -> dict[str, Any]:
    """One (system, rate)'s figures over its windows (its turns), samples pooled."""
    window = windows[0]
    engines: dict[str, Any] = {}
    wall = sum(w.cpu.get("_wall", [0.0])[0] for w in windows) or 1e-9
    flights = [f for w in windows for f in w.flights]
    seconds = sum(w.seconds for w in windows)
    for name in window.steps:
        steps = [s for w in windows for s in w.steps[name]]
        hooks = [h for w in windows for h in w.hooks[name]]
        hooks_cpu = [h for w in windows for h in w.hooks_cpu[name]]
        # steps per second of each turn's span between its first and last step
        intervals = sum(max(0, len(w.steps[name]) - 1) for w in windows)
        span = sum(w.steps[name][-1]["t"] - w.steps[name][0]["t"] for w in windows if len(w.steps[name]) > 1)
        own = sum(w.cpu.get(name, [0.0, 0.0])[0] for w in windows)
        kids = sum(w.cpu.get(name, [0.0, 0.0])[1] for w in windows)
        engines[name] = {
            "steps": len(steps),
            "steps_per_s": intervals / span if span > 0 else None,
            "step_ms": _ms(s["dur"] for s in steps),
            "python_ms": _ms(s["py"] for s in steps),
            # the step's work before its wait, split: the host thread's own CPU, its waits for a
            # core, and the rest: waits for the GIL (another thread of its process held it)
            "host_cpu_ms": _ms(s["cpu"] for s in steps),
            "hooks_ms": _ms(hooks),
            "hooks_cpu_ms": _ms(hooks_cpu),
            "core_wait_ms": _ms(s["queued"] for s in steps),
            "gil_wait_ms": _ms(max(0.0, s["busy"] - s["cpu"] - s["queued"]) for s in steps),
            "cpu_pct": 100 * (own + kids) / wall,
            "children_cpu_pct": 100 * kids / wall,
        }
    moves = window.system != "alone"
    failed = sum(1 for f in flights if moves and (f.recving is None or f.recv_failed or f.bad_pages))
    return {
        "system": window.system,
        "rate": window.rate,
        "turns": len(windows),
        "requests": len(flights),
        "achieved_per_s": len(flights) / seconds if seconds > 0 else None,
        "failed": failed,
        "bad_pages": sum(f.bad_pages for f in flights) if moves else 0,
        "kv_to_recv_ms": _ms(_kv_to_recv(f) for f in flights if _kv_to_recv(f) is not None),
        "engines": engines,
    }


def _kv_to_recv(flight: Flight) -> float | None:
    """Seconds from the end of P's forward that made the KV to D's ``finished_recving``."""
    if flight.recving is None or flight.computed is None:
        return None
    return flight.recving - flight.computed


def _ms(seconds: Any) -> dict[str, float | None]:
    return {k: None if v is None else round(v * 1e3, 3) for k, v in percentiles(seconds).items()}


def _relative(rows: list[dict[str, Any]]) -> None:
    """Each row's throughput loss and added step time against ``alone`` at its rate."""
    base = {row["rate"]: row for row in rows if row["system"] == "alone"}
    for row in rows:
        alone = base.get(row["rate"])
        for name, engine in row["engines"].items():
            ref = alone["engines"][name] if alone is not None else None
            if ref is None or row is alone or not ref["steps_per_s"] or not engine["steps_per_s"]:
                engine["loss_pct"] = engine["added_p50_ms"] = engine["added_p99_ms"] = engine["added_cpu_ms"] = None
                continue
            engine["loss_pct"] = round(100 * (1 - engine["steps_per_s"] / ref["steps_per_s"]), 2)
            engine["added_cpu_ms"] = round(engine["host_cpu_ms"]["mean"] - ref["host_cpu_ms"]["mean"], 4)
            engine["added_p50_ms"] = round(engine["step_ms"]["p50"] - ref["step_ms"]["p50"], 3)
            engine["added_p99_ms"] = round(engine["step_ms"]["p99"] - ref["step_ms"]["p99"], 3)


def run(o: HostOptions, progress: Any = None) -> dict[str, Any]:
    """Every system's idle cost, then every rate with the systems interleaved; the results.

    :raises BenchError: an engine died or a transfer stalled.
    """
    iterations = o.iterations or calibrate(o.python_ms)
    load = {"iterations": iterations, "wait_ms": o.wait_ms}
    pairs: dict[str, Pair] = {}
    idle: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    try:
        if o.engine_cpus:
            os.sched_setaffinity(0, o.engine_cpus)
        for system in o.systems:
            settings: dict[str, Any] = {}
            if system.startswith("kvflow"):
                settings = {"push_layer_groups": o.layer_groups, "lease": 600.0}
                if o.engine_cpus:
                    settings["engine_cpus"] = list(o.engine_cpus)
            options = {
                "kvflow_settings": settings,
                "nixl_progress_delay_us": o.nixl_progress_delay_us,
                "cpus": o.host_cpus,
                # the KV's bytes move but are not written or checked by the host's CPU, which on a
                # GPU host does neither (bench vllm and bench pd check every page)
                "engines": {"P": {"verify_pages": False}, "D": {"verify_pages": False}},
            }
            pair = start_pair(system, o.tokens, 1, options)
            pairs[system] = pair
            for engine in pair.engines.values():
                engine.send(op="host", load=load, spin=False)
            _warm(pair, system, o)
            idle[system] = _idle(pair, o.idle_s)
            pair.pause()
            if progress is not None:
                progress(f"{system}: started, idle CPU P {_pct(idle[system]['P'])} D {_pct(idle[system]['D'])}")
        for index, rate in enumerate(o.rates):
            turns: dict[str, list[Window]] = {system: [] for system in o.systems}
            for turn in range(o.turns):  # the systems take turns, the first rotating each time
                first = (index + turn) % len(o.systems)
                for system in o.systems[first:] + o.systems[:first]:
                    pair = pairs[system]
                    pair.resume()
                    turns[system].append(_window(pair, system, rate, o, load))
                    pair.pause()
            for system in o.systems:
                row = _summary(turns[system])
                rows.append(row)
                if progress is not None:
                    p, d = row["engines"]["P"], row["engines"]["D"]
                    progress(
                        f"{system} at {rate:g}/s: P {_num(p['steps_per_s'])} steps/s, D {_num(d['steps_per_s'])}, "
                        f"kv→recv p50 {_num(row['kv_to_recv_ms']['p50'])} ms, failed {row['failed']}"
                    )
    except BaseException:
        for pair in pairs.values():
            pair.failed = True
        raise
    finally:
        for pair in pairs.values():
            pair.close()
    _relative(rows)
    return {"options": asdict(o), "iterations": iterations, "idle": idle, "rows": rows}


def _warm(pair: Pair, system: str, o: HostOptions) -> None:
    """Connections and handshakes: two transfers, not measured."""
    for i in range(2):
        flight = Flight(f"warm{i}-{system}", time.perf_counter(), decode_tokens=2)
        pair.dispatch(flight, o.tokens)
        deadline = time.monotonic() + WINDOW_TIMEOUT
        while not flight.done:
            name, event = pair.next_event(deadline, "the warm-up transfer")
            if event.get("id") == flight.request_id:
                pair.on_event(name, event, flight, o.tokens)


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def _pct(idle: dict[str, float]) -> str:
    return f"{idle['own_pct'] + idle['children_pct']:.1f}%"


def render(results: dict[str, Any]) -> str:
    """The results as tables: idle CPU per system, then per engine each (rate, system) under load."""
    lines = [
        "idle (no steps, no transfers): CPU % of one core (the engine's process and its children;"
        " alone: vLLM's worker set-up without a connector, its gloo group's threads included)"
    ]
    lines.append(f"{'system':<14} {'P':>6} {'D':>6}")
    for system, idle in results["idle"].items():
        lines.append(f"{system:<14} {_pct(idle['P']):>6} {_pct(idle['D']):>6}")
    for name in ("P", "D"):
        lines += [
            "",
            f"{name}: rate/s  system        | done/s failed | kv→recv p50    p99 | steps/s  loss% | step p50    p99"
            "   +p99 | host CPU ms/step  +mean | hooks mean    p99  CPU | GIL wait mean    p99 |"
            " core wait mean    p99 | CPU%",
        ]
        for row in results["rows"]:
            e = row["engines"][name]
            loss = "—" if e.get("loss_pct") is None else f"{e['loss_pct']:.1f}"
            added = "—" if e.get("added_p99_ms") is None else f"{e['added_p99_ms']:+.2f}"
            cpu_added = "—" if e.get("added_cpu_ms") is None else f"{e['added_cpu_ms']:+.3f}"
            lines.append(
                f"   {row['rate']:>6g}  {row['system']:<13} | {_num(row['achieved_per_s']):>6} {row['failed']:>6} |"
                f" {_num(row['kv_to_recv_ms']['p50']):>11} {_num(row['kv_to_recv_ms']['p99']):>6} |"
                f" {_num(e['steps_per_s']):>7} {loss:>6} | {_num(e['step_ms']['p50']):>8}"
                f" {_num(e['step_ms']['p99']):>6} {added:>6} | {_ms3(e['host_cpu_ms']['mean']):>16} {cpu_added:>6} |"
                f" {_ms3(e['hooks_ms']['mean']):>10} {_ms3(e['hooks_ms']['p99']):>6}"
                f" {_ms3(e['hooks_cpu_ms']['mean']):>5} |"
                f" {_ms3(e['gil_wait_ms']['mean']):>13} {_ms3(e['gil_wait_ms']['p99']):>6} |"
                f" {_ms3(e['core_wait_ms']['mean']):>14} {_ms3(e['core_wait_ms']['p99']):>6} | {e['cpu_pct']:>4.0f}"
            )
    o = results["options"]
    lines.append(
        f"\neach step: {o['python_ms']:g} ms of Python ({results['iterations']:,} iterations) over the forward's "
        f"layers, then {o['wait_ms']:g} ms with the interpreter released; prompts of {o['tokens']} tokens; "
        "loss, +p99 and +mean host CPU against 'alone' at the same rate.  Of a step's work before its wait: "
        "host CPU is the engine thread's own (kvflow's hooks included), core wait its time runnable without a "
        "core, GIL wait the rest (another thread of its process held the interpreter); hooks: the step's "
        "time inside the connector's hooks, and the thread's CPU in them."
    )
    if o["host_cpus"] or o["engine_cpus"]:
        lines.append(
            f"engines on CPUs {o['host_cpus'] or 'any'}; kvflow's engine processes and the driver on "
            f"{o['engine_cpus'] or 'any'}"
        )
    return "\n".join(lines)


def _ms3(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def main(args: Any) -> int:
    """`kvflow bench host`: run, print the tables, write JSON when asked."""
    o = HostOptions(
        systems=tuple(args.systems),
        rates=tuple(args.rates),
        duration_s=args.duration,
        turns=args.turns,
        python_ms=args.python_ms,
        iterations=args.iterations,
        wait_ms=args.wait_ms,
        tokens=args.tokens,
        layer_groups=args.layer_groups,
        idle_s=args.idle,
        warmup_s=args.warmup,
        nixl_progress_delay_us=args.nixl_progress_delay_us,
        host_cpus=tuple(args.host_cpus),
        engine_cpus=tuple(args.engine_cpus),
    )
    results = run(o, progress=lambda line: sys.stderr.write(f"  {line}\n"))
    sys.stdout.write(render(results) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
        sys.stdout.write(f"\nwrote {args.json}\n")
    return 1 if any(row["failed"] or row["bad_pages"] for row in results["rows"]) else 0
