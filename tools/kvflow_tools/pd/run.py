"""`kvflow bench pd`'s run: every system's P and D pair under open-loop load.

Paced by the step-time model, under Poisson load at every request rate, and what each request
and step did.

Why open loop: under load, what push changes is how long requests queue (on P for compute, on D
for KV); a closed loop would slow its arrivals down whenever a system is slow and hide that.
Every system's pair is started first (`start_system`); then at each request rate the systems
take turns (`run_point`), in an order that rotates from rate to rate, each resumed for its turn
and stopped (SIGSTOP, its engine processes with it) for the others', so that slow drift of the
machine falls on all of them alike and an idle pair takes no CPU from the measured one; every
system sees the same requests at a given rate.  Requests are sent at their arrival times by
this loop, whatever earlier requests are doing.  P gets max_tokens=1 and D the
request's output length, as vLLM's proxies do; the routing is `bench.Pair`'s.
"""

from __future__ import annotations

import importlib.util
import queue
import time
from dataclasses import dataclass, field
from typing import Any

from kvflow_tools.bench.runner_pair import Flight, Pair, start_pair
from kvflow_tools.errors import BenchError
from kvflow_tools.pd.contract import percentiles
from kvflow_tools.pd.sizing import STANDIN_BLOCK, Sizing
from kvflow_tools.pd.workload import Arrival
from kvflow_tools.standin.timing import StepModel

__all__ = ("Request", "run_point", "start_system", "transport")
LEASE = 3600.0  # kvflow's lease in the pairs: a pair stopped for the others' turns keeps its peers

REQUEST_TIMEOUT = 300.0  # seconds a request may take from its arrival before the run fails


@dataclass
class Request:
    """One request's journey: `Flight` (bench's routing record) plus the open-loop timestamps."""

    arrival: Arrival
    flight: Flight
    scheduled: float | None = None  # P's first step including it
    first: float | None = None  # D sampled its first token
    last: float | None = None  # D finished it

    def row(self, start: float) -> dict[str, Any]:
        f, a = self.flight, self.arrival
        t0 = f.dispatched

        def ms(late: float | None, early: float | None) -> float | None:
            return None if late is None or early is None else round((late - early) * 1e3, 3)

        tpot = None
        if self.last is not None and self.first is not None and a.output > 1:
            tpot = round((self.last - self.first) * 1e3 / (a.output - 1), 4)
        return {
            "id": a.id,
            "prompt": a.prompt,
            "output": a.output,
            "arrival_s": round(t0 - start, 6),
            "ttft_ms": ms(self.first, t0),
            "tpot_ms": tpot,
            "e2e_ms": ms(self.last, t0),
            "p_queue_ms": ms(self.scheduled, t0),
            "prefill_ms": ms(f.computed, self.scheduled),
            "transfer_wait_ms": ms(f.recving, f.computed),
            "d_queue_ms": ms(self.first, f.recving),
            # with the router's first token from P (`--first-token prefill`): P's prefill ended
            # with it sampled; the router's hop to the client is not modelled
            "ttft_from_p_ms": ms(f.computed, t0),
        }


@dataclass
class Steps:
    """One engine's steps during a point."""

    blocks: list[list[float]] = field(default_factory=list)  # [t_s, used]
    peak: int = 0
    stall_s: float = 0.0
    over: int = 0
    count: int = 0

    def add(self, event: dict[str, Any], start: float) -> None:
        self.count += 1
        self.blocks.append([round(event["t"] - start, 4), event["used"]])
        self.peak = max(self.peak, event["used"])
        self.over += bool(event["over"])
        if event["stall"]:
            self.stall_s += max(event["model_ms"], event["real_ms"]) / 1e3


def _stats(values: list[float]) -> dict[str, float | None]:
    """As the report computes them (`contract.percentiles`), rounded to microseconds."""
    return {k: None if v is None else round(v, 3) for k, v in percentiles(values).items()}


def transport() -> str:
    """What moves the bytes between the P and D processes: NIXL over UCX, for every system
    (vLLM's NIXL connectors need it, and kvflow's vLLM connector crosses processes over it).

    :raises BenchError: NIXL is not installed.
    """
    if importlib.util.find_spec("nixl") is None:
        raise BenchError("kvflow bench pd needs NIXL (pip install nixl): every system moves KV over NIXL-UCX")
    return "nixl-ucx"


def _engines(model: StepModel, sizing: Sizing, max_model_len: int) -> dict[str, dict[str, Any]]:
    common = {
        "model": sizing.shape,
        "block_size": STANDIN_BLOCK,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": model.budget_tokens,
    }
    return {"P": {**common, "num_blocks": sizing.p_blocks}, "D": {**common, "num_blocks": sizing.d_blocks}}


def start_system(
    system: str, model: StepModel, sizing: Sizing, max_model_len: int, nixl_progress_delay_us: int | None = None
) -> Pair:
    """`system`'s pair, paced by `model`, its connections made by one unmeasured request, then
    stopped (`resume` it for its turn); vLLM's connectors with their NIXL agents' progress
    threads sleeping `nixl_progress_delay_us` between polls (None: stock NIXL, a busy poll).

    :raises BenchError: NIXL is missing, an engine died or the warm-up request did not finish.
    """
    transport()
    options: dict[str, Any] = {"engines": _engines(model, sizing, max_model_len), "kvflow_settings": {"lease": LEASE}}
    if nixl_progress_delay_us is not None and not system.startswith("kvflow"):
        options["nixl_progress_delay_us"] = nixl_progress_delay_us  # kvflow's agents run no progress thread
    pair = start_pair(system, max_model_len - 1, 1, options)
    try:
        for engine in pair.engines.values():
            engine.send(op="model", model=model.to_json())
        warm = Arrival("warmup", 0.0, min(256, max_model_len // 2), 2)
        _run_point(pair, [warm])  # connections and handshakes, not measured
    except BaseException:
        pair.failed = True
        pair.close()
        raise
    pair.pause()
    return pair


def run_point(pair: Pair, qps: float, requests: list[Arrival], progress: Any = None) -> dict[str, Any]:
    """One (system, qps) cell: the stopped `pair` resumed for `requests`, then stopped again.
    `progress(count)` is told of every finished request.

    :raises BenchError: an engine died or a request did not finish in time.
    """
    pair.resume()
    try:
        return {"system": pair.connector, "qps": qps, **_run_point(pair, requests, progress)}
    except BaseException:
        pair.failed = True
        raise
    finally:
        pair.pause()


def _run_point(pair: Pair, arrivals: list[Arrival], progress: Any = None) -> dict[str, Any]:
    start = time.perf_counter()
    due = sorted(arrivals, key=lambda a: a.arrival_s)
    live: dict[str, Request] = {}
    done: list[Request] = []
    steps = {"P": Steps(), "D": Steps()}
    while due or live:
        now = time.perf_counter()
        while due and start + due[0].arrival_s <= now:
            a = due.pop(0)
            request = Request(a, Flight(f"{a.id}-{pair.connector}-{time.monotonic_ns()}", now, decode_tokens=a.output))
            live[request.flight.request_id] = request
            pair.dispatch(request.flight, a.prompt)
        oldest = min((r.flight.dispatched for r in live.values()), default=now)
        if live and now - oldest > REQUEST_TIMEOUT:
            said = "\n".join(pair.describe())
            raise BenchError(f"{pair.connector}: a request did not finish within {REQUEST_TIMEOUT:.0f} s\n{said}")
        wait = (start + due[0].arrival_s - now) if due else 1.0
        try:
            name, event = pair.events.get(timeout=max(0.0, min(wait, 1.0)))
        except queue.Empty:
            continue
        kind = event["ev"]
        if kind == "exit":
            pair.failed = True
            raise BenchError(f"{pair.connector}: engine {name} exited (log: {pair.engines[name].log_path})")
        if kind == "step":
            steps[name].add(event, start)
            continue
        mine = live.get(event.get("id", ""))
        if mine is None:
            continue
        if name == "P" and kind == "scheduled" and mine.scheduled is None:
            mine.scheduled = event["t"]
        elif name == "D" and kind == "first" and mine.first is None:
            mine.first = event["t"]
        elif name == "D" and kind == "params":
            mine.last = event["t"]
        pair.on_event(name, event, mine.flight, mine.arrival.prompt)
        if mine.flight.done:
            done.append(live.pop(mine.flight.request_id))
            if progress is not None:
                progress(1)
    return _cell(done, steps, start, time.perf_counter() - start)


def _cell(done: list[Request], steps: dict[str, Steps], start: float, duration: float) -> dict[str, Any]:
    # in the workload's order (its planned arrivals), the same for every system: the order
    # requests were dispatched in moves with the machine's load
    rows = [r.row(start) for r in sorted(done, key=lambda r: (r.arrival.arrival_s, r.arrival.id))]
    failed = sum(
        1
        for r in done
        if r.flight.recving is None
        or r.flight.recv_failed
        or r.flight.bad_pages
        or not r.flight.pages
        or r.first is None
        or r.last is None
    )

    def values(key: str) -> list[float]:
        return [row[key] for row in rows if row[key] is not None]

    split = {k: values(f"{k}_ms") for k in ("p_queue", "prefill", "transfer_wait", "d_queue")}
    return {
        "requests": len(done),
        "completed": len(done) - failed,
        "failed": failed,
        "bad_pages": sum(r.flight.bad_pages for r in done),
        "duration_s": round(duration, 3),
        "ttft_ms": _stats(values("ttft_ms")),
        "ttft_from_p_ms": _stats(values("ttft_from_p_ms")),
        "tpot_ms": _stats(values("tpot_ms")),
        "e2e_ms": _stats(values("e2e_ms")),
        "ttft_split_ms": {k: (round(sum(v) / len(v), 3) if v else None) for k, v in split.items()},
        "blocks": {k.lower(): s.blocks for k, s in steps.items()},
        "blocks_peak": {k.lower(): s.peak for k, s in steps.items()},
        "admission_stall_s": {k.lower(): round(s.stall_s, 4) for k, s in steps.items()},
        "over_budget_steps": {k.lower(): s.over for k, s in steps.items()},
        "steps": {k.lower(): s.count for k, s in steps.items()},
        "per_request": rows,
    }
