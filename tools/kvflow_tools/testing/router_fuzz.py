"""`kvflow soak --fuzz`, its last part: hostile ``kv_transfer_params`` through the router's process.

Why: any HTTP client of the router writes its own ``kv_transfer_params``.  Passed on, they would
reach the connector of the engine they name (before the router dropped them, a client's epoch
of 2**64 crashed D through a sequential router whose P answered no params).  The router must
pass on only what it (or P's answer) sets, and serve the request.  The CI test sends 30 such
requests per kind of router (`tests/test_router_xpyd.py`); this sends thousands, several at once, to the
router's own process in each of its dispatch modes (`router_stand`: fake P and D that count every leg
carrying a marked value of a client's params, a P that answers without params every other
time), and times a genuine request among them against one among as many benign requests
(batches of each in turns, so that a drifting machine load falls on both alike).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from kvflow.runtime.meter import quantile
from kvflow_tools.bench.router_stand import Backends, Stand, stand
from kvflow_tools.testing.params_fuzz import hostile_params

__all__ = ("MARK", "RouterFuzzReport", "run_router_fuzz")

MARK = "MARK-router-fuzz"  # in every value a client sets: any leg carrying one shows
GENUINE = {
    "do_remote_prefill": True,
    "kvflow": {
        "transfer_id": f"{MARK}-t",
        "epoch": 1,
        "mode": "push",
        "prefill": {"engine": f"{MARK}-p", "address": "tcp://127.0.0.1:5700"},
        "decode": {"engine": f"{MARK}-d", "address": "tcp://127.0.0.1:5800"},
    },
}
MODES = ("push", "pull", "sequential", "nixl-push")  # the router's --mode, each


@dataclass
class RouterFuzzReport:
    """One dispatch mode's run."""

    mode: str
    requests: int  # hostile ones (and as many benign ones, in batches between them)
    statuses: dict[str, int] = field(default_factory=dict)  # of the hostile requests
    legs: int = 0  # legs that reached a backend
    carried: int = 0  # of them, legs carrying anything of a client's params: must be 0
    genuine: int = 0  # genuine requests timed among the hostile ones (and as many among benign ones)
    benign_ms: tuple[float, float] = (0.0, 0.0)  # their median and p90 among benign requests
    hostile_ms: tuple[float, float] = (0.0, 0.0)  # and among the hostile ones

    @property
    def ok(self) -> bool:
        return self.carried == 0 and set(self.statuses) <= {"200"} and self.genuine > 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ok": self.ok}


def _spread(samples: list[float]) -> tuple[float, float]:
    """Median and p90 (`kvflow.runtime.meter.quantile`, as every figure) in milliseconds."""
    return (round(quantile(samples, 0.5) * 1e3, 2), round(quantile(samples, 0.9) * 1e3, 2))


async def _genuine(live: Stand) -> float:
    started = time.perf_counter()
    status, _ = await live.complete()
    if status != 200:
        raise AssertionError(f"a genuine request was answered {status}")
    return time.perf_counter() - started


async def _fuzz_mode(mode: str, requests: int, rng: random.Random, at_once: int, batch: int) -> RouterFuzzReport:
    """Batches of `batch` requests, benign (no params of the client's) and hostile in turns, each
    with a genuine request timed while the batch's requests are in flight."""
    backends = Backends(watch=MARK, bare_every=2)
    report = RouterFuzzReport(mode, requests)
    statuses: Counter[str] = Counter()
    timed: dict[bool, list[float]] = {False: [], True: []}
    slots = asyncio.Semaphore(at_once)

    async def one(live: Stand, params: object | None) -> None:
        async with slots:
            status, _ = await (live.complete() if params is None else live.complete(kv_transfer_params=params))
            if params is not None:
                statuses[str(status)] += 1
            elif status != 200:
                raise AssertionError(f"a benign request was answered {status}")

    async with stand(backends, ("--mode", mode)) as live:
        for start in range(0, requests, batch):
            for hostile in (False, True):
                count = min(batch, requests - start)
                tasks = [
                    asyncio.ensure_future(one(live, hostile_params(GENUINE, rng) if hostile else None))
                    for _ in range(count)
                ]
                timed[hostile].append(await _genuine(live))
                await asyncio.gather(*tasks)
    report.statuses = dict(statuses)
    report.legs = sum(backends.arrived.values())
    report.carried = sum(backends.carried.values())
    report.genuine = len(timed[True])
    report.benign_ms, report.hostile_ms = _spread(timed[False]), _spread(timed[True])
    return report


def run_router_fuzz(requests: int, seed: int = 0, at_once: int = 8, batch: int = 50) -> list[RouterFuzzReport]:
    """`requests` hostile requests through the router in each dispatch mode, `at_once` at a time,
    in batches of `batch` between as many benign ones, a genuine request timed in each batch.

    :raises BenchError: the router did not start, or printed a traceback.
    :raises AssertionError: a genuine or benign request was not answered 200.
    """
    rng = random.Random(seed)
    return [asyncio.run(_fuzz_mode(mode, requests, rng, at_once, max(1, batch))) for mode in MODES]
