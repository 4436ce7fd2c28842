"""Hostile ``kv_transfer_params`` through kvflow's connector on vLLM's scheduler, at any scale.

Why: what any HTTP client of vLLM's server writes in ``kv_transfer_params`` reaches the
connector's scheduler side as it is, and once crashed engines, tore associations down and held
blocks.  This runs stand-in P and D engines (vLLM's scheduler, allocation and hooks, real
ZeroMQ, bytes over the loopback transport), sends them every value of
`kvflow.integrations.vllm.params_fuzz` in every field of a transfer's params and then random mutations,
with a genuine transfer between the same two engines every `genuine_every` hostile requests,
and reports what held: no engine crashed, every request ended, every genuine request decoded
from P's KV and nothing else from KV it was not sent, no block or transfer stayed held, each
engine kept exactly its one association.  The tests run it small; ``kvflow soak --fuzz`` at its
``--fuzz-scale``.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvflow.integrations.vllm.params_fuzz import hostile_params, single_field_variants
from kvflow.integrations.vllm.standin import EngineOptions, StandInEngine

__all__ = ("ParamsSoakReport", "run_params_soak")

UNSERVABLE = "kvflow cannot serve its kv_transfer_params"
QUIET = 3  # genuine transfers first, alone


@dataclass
class ParamsSoakReport:
    hostile: int = 0  # requests with hostile params, at P and at D together
    genuine: int = 0
    genuine_ok: int = 0  # genuine requests that decoded from P's KV
    refused: int = 0  # requests whose params the connector refused (each logged once)
    unfinished: int = 0  # requests still open at the deadline
    misread: list[str] = field(default_factory=list)  # D requests that decoded KV they were not sent
    crashed: list[str] = field(default_factory=list)
    leaked_blocks: dict[str, int] = field(default_factory=dict)
    live_transfers: dict[str, int] = field(default_factory=dict)
    peers: dict[str, list[str]] = field(default_factory=dict)
    genuine_ms_p50: float = 0.0  # from adding a genuine request to D until its KV landed
    genuine_ms_max: float = 0.0
    quiet_ms_p50: float = 0.0  # the same with no other request in the engines
    benign_ms: float = 0.0  # the same amid as many requests without params as a hostile batch
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        expected = {"prefill": ["decode-tp0"], "decode": ["prefill-tp0"]}
        return (
            self.genuine_ok == self.genuine
            and not (self.unfinished or self.misread or self.crashed or self.leaked_blocks)
            and not any(self.live_transfers.values())
            and self.peers == expected
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


class _Refusals(logging.Handler):
    """The request ids the connector logged as refused."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.ids: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if UNSERVABLE in text:
            self.ids.add(text.split(":", 1)[0].removeprefix("request "))


def _params(p: StandInEngine, d: StandInEngine, transfer_id: str) -> dict[str, Any]:
    ends = {"prefill": (p, "prefill"), "decode": (d, "decode")}
    kv: dict[str, Any] = {"transfer_id": transfer_id, "epoch": 1, "mode": "push"}
    for role, (engine, name) in ends.items():
        kv[role] = {"engine": name, "address": engine.worker.control_address, "tp_size": 1}
    return kv


def run_params_soak(
    random_variants: int,
    *,
    seed: int = 0,
    genuine_every: int = 50,
    transfer_timeout: float = 2.0,
    limit: float = 600.0,
) -> ParamsSoakReport:
    """Send P and D each the sweep of hostile values and `random_variants` random ones; a
    genuine transfer every `genuine_every` hostile requests.  The report says what held.

    :raises KVFlowError: the stand-in engines could not start.
    """
    from vllm.v1.request import RequestStatus

    start = time.monotonic()
    fabric = f"params-soak-{seed}-{time.monotonic_ns()}"
    common = {"transport": "loopback", "fabric": fabric, "port": 0, "push_group_bytes": 0}
    common["transfer_timeout"] = transfer_timeout  # a hostile transfer only one side holds fails then
    refusals = _Refusals()
    logging.getLogger("kvflow.vllm").addHandler(refusals)
    p = StandInEngine(EngineOptions("prefill", "kv_producer", dict(common)))
    d = StandInEngine(EngineOptions("decode", "kv_consumer", dict(common), failure_policy="fail"))
    report = ParamsSoakReport()
    landed: dict[str, float] = {}  # D request id -> when its KV arrived (the stand-in's clock)

    def event(**fields: Any) -> None:
        if fields.get("ev") == "recving" and not fields.get("failed"):
            landed[str(fields["id"])] = float(fields["t"])

    d.emit = event
    try:
        rng = random.Random(seed)
        requests: list[Any] = []
        genuine: list[str] = []
        quiet: list[str] = []
        benign: list[str] = []
        local: set[str] = set()
        sides = ((d, "do_remote_prefill", 4), (p, "do_remote_decode", 1))
        variants = {}
        for engine, flag, _ in sides:
            template = {flag: True, "kvflow": _params(p, d, "TID")}
            variants[engine.options.name] = single_field_variants(template) + [
                hostile_params(template, rng, mappings_only=True) for _ in range(random_variants)
            ]
        deadline = time.monotonic() + limit

        def settle() -> None:  # step both engines, as their engine cores would, until all ended
            while time.monotonic() < deadline and not (
                all(r.status >= RequestStatus.FINISHED_STOPPED for r in requests) and p.idle() and d.idle()
            ):
                for engine in (p, d):
                    if engine.busy():
                        engine.step()
                time.sleep(0.001)

        def genuine_pair(tid: str) -> str:
            kv = _params(p, d, tid)
            requests.append(d.add(f"d-{tid}", 70, 4, {"do_remote_prefill": True, "kvflow": kv}, tag=tid))
            requests.append(p.add(f"p-{tid}", 70, 1, {"do_remote_decode": True, "kvflow": kv}, tag=tid))
            return f"d-{tid}"

        for n in range(QUIET):  # what a genuine transfer takes with nothing else going on
            quiet.append(genuine_pair(f"q{n}"))
            settle()
        for n in range(genuine_every):  # the same load, benign: requests without params amid one
            if n == genuine_every // 2:
                benign.append(genuine_pair(f"b{n}"))
            for engine, _, tokens in sides:
                requests.append(engine.add(f"{engine.options.name}-b{n}", 20 + n % 40, tokens, {}, tag=f"b{n}"))
                local.add(f"{engine.options.name}-b{n}")
        settle()
        total = len(variants["decode"])
        for batch in range(0, total, genuine_every):  # a genuine pair amid each batch of hostile ones
            for n in range(batch, min(batch + genuine_every, total)):
                if n == batch + genuine_every // 2 or n == batch:
                    genuine.append(genuine_pair(f"g{n}"))
                for engine, _, tokens in sides:
                    crafted: Any = variants[engine.options.name][n]
                    inner = crafted.get("kvflow") if isinstance(crafted, dict) else None
                    if isinstance(inner, dict) and inner.get("transfer_id") == "TID":
                        inner["transfer_id"] = f"h{n}"  # a transfer of its own, unless its id is the mutation
                    rid = f"{engine.options.name}-h{n}"
                    if not (isinstance(crafted, dict) and crafted.get("do_remote_prefill")):
                        local.add(rid)  # not a remote prefill: D computes it (the stand-in does not)
                    requests.append(engine.add(rid, 20 + n % 40, tokens, crafted, tag=f"h{n}"))
                    report.hostile += 1
            settle()
        genuine += quiet + benign
        report.genuine = len(genuine)
        report.unfinished = sum(r.status < RequestStatus.FINISHED_STOPPED for r in requests)
        report.refused = len(refusals.ids)
        report.genuine_ok = sum(d.checked.get(rid) == 0 for rid in genuine)
        report.misread = sorted(
            rid for rid, bad in d.checked.items() if bad and rid not in refusals.ids and rid not in local
        )

        def ms(ids: list[str]) -> list[float]:
            return [(landed[rid] - d.added[rid]) * 1e3 for rid in ids if rid in landed]

        amid = ms([rid for rid in genuine if rid not in quiet and rid not in benign])
        if amid:
            report.genuine_ms_p50, report.genuine_ms_max = statistics.median(amid), max(amid)
        report.quiet_ms_p50 = statistics.median(ms(quiet) or [0.0])
        report.benign_ms = statistics.median(ms(benign) or [0.0])
        for engine in (p, d):
            name = engine.options.name
            (kv_engine,) = engine.kvflow_engines()
            if kv_engine.crashed:
                report.crashed.append(name)
            free = engine.free_blocks()
            if free != engine.options.num_blocks - 1:
                report.leaked_blocks[name] = engine.options.num_blocks - 1 - free
            report.live_transfers[name] = kv_engine.stats()["live_transfers"]
            report.peers[name] = kv_engine.peers()
    finally:
        logging.getLogger("kvflow.vllm").removeHandler(refusals)
        p.close()
        d.close()
    report.seconds = time.monotonic() - start
    return report
