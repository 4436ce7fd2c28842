"""Hostile ``kv_transfer_params`` through kvflow's connector on vLLM's scheduler, at any scale.

Why: what any HTTP client of vLLM's server writes in ``kv_transfer_params`` reaches the
connector's scheduler side as it is, and once crashed engines, tore associations down and held
blocks.  This runs stand-in P and D engines (vLLM's scheduler, allocation and hooks, real
ZeroMQ, bytes over the loopback transport), sends them every value of
`kvflow_tools.testing.params_fuzz` in every field of a transfer's params and then random mutations,
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

from kvflow_tools.standin import EngineOptions, StandInEngine
from kvflow_tools.testing.params_fuzz import hostile_params, single_field_variants

__all__ = ("ParamsSoakReport", "StandInPair", "run_params_soak")

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


class StandInPair:
    """Stand-in P and D with kvflow's connector (bytes over the loopback transport, real
    ZeroMQ), the requests added to them, and when each D request's KV landed."""

    def __init__(self, fabric: str, transfer_timeout: float) -> None:
        """:raises KVFlowError: an engine could not start."""
        common = {"transport": "loopback", "fabric": fabric, "port": 0, "push_group_bytes": 0}
        common["transfer_timeout"] = transfer_timeout  # a transfer only one side holds fails then
        self.p = StandInEngine(EngineOptions("prefill", "kv_producer", dict(common)))
        try:
            self.d = StandInEngine(EngineOptions("decode", "kv_consumer", dict(common), failure_policy="fail"))
        except BaseException:
            self.p.close()
            raise
        self.requests: list[Any] = []
        self.landed: dict[str, float] = {}  # D request id -> when its KV arrived (the stand-in's clock)
        self.d.emit = self._event

    def _event(self, **fields: Any) -> None:
        if fields.get("ev") == "recving" and not fields.get("failed"):
            self.landed[str(fields["id"])] = float(fields["t"])

    def params(self, transfer_id: str, **changes: Any) -> dict[str, Any]:
        """The kvflow entry of a transfer between the two, with `changes` made to it."""
        kv: dict[str, Any] = {"transfer_id": transfer_id, "epoch": 1, "mode": "push", **changes}
        for role, engine in (("prefill", self.p), ("decode", self.d)):
            kv[role] = {"engine": role, "address": engine.worker.control_address, "tp_size": 1}
        return kv

    def add(self, engine: StandInEngine, request_id: str, prompt_len: int, tokens: int, params: Any, tag: str) -> None:
        self.requests.append(engine.add(request_id, prompt_len, tokens, params, tag=tag))

    def genuine(self, transfer_id: str) -> str:
        """Both legs of a genuine transfer, as a router sends them; D's request id."""
        kv = self.params(transfer_id)
        self.add(self.d, f"d-{transfer_id}", 70, 4, {"do_remote_prefill": True, "kvflow": kv}, transfer_id)
        self.add(self.p, f"p-{transfer_id}", 70, 1, {"do_remote_decode": True, "kvflow": kv}, transfer_id)
        return f"d-{transfer_id}"

    def unfinished(self) -> int:
        return sum(not is_finished(r) for r in self.requests)

    def settle(self, deadline: float) -> None:
        """Step both engines, as their engine cores would, until every request ended and both
        idle, or `deadline` (a `time.monotonic` reading) passed."""
        while time.monotonic() < deadline and not (not self.unfinished() and self.p.idle() and self.d.idle()):
            for engine in (self.p, self.d):
                if engine.busy():
                    engine.step()
            time.sleep(0.001)

    def ms(self, request_ids: list[str]) -> list[float]:
        """From adding each of these D requests until its KV landed, in ms (those that landed)."""
        return [(self.landed[rid] - self.d.added[rid]) * 1e3 for rid in request_ids if rid in self.landed]

    def close(self) -> None:
        self.p.close()
        self.d.close()


def is_finished(request: Any) -> bool:
    from vllm.v1.request import RequestStatus

    return bool(request.status >= RequestStatus.FINISHED_STOPPED)


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
    start = time.monotonic()
    pair = StandInPair(f"params-soak-{seed}-{time.monotonic_ns()}", transfer_timeout)
    p, d = pair.p, pair.d
    report = ParamsSoakReport()
    refusals = _Refusals()
    logging.getLogger("kvflow.vllm").addHandler(refusals)
    try:
        rng = random.Random(seed)
        genuine: list[str] = []
        quiet: list[str] = []
        benign: list[str] = []
        local: set[str] = set()
        sides = ((d, "do_remote_prefill", 4), (p, "do_remote_decode", 1))
        variants = {}
        for engine, flag, _ in sides:
            template = {flag: True, "kvflow": pair.params("TID")}
            variants[engine.options.name] = single_field_variants(template) + [
                hostile_params(template, rng, mappings_only=True) for _ in range(random_variants)
            ]
        deadline = time.monotonic() + limit
        for n in range(QUIET):  # what a genuine transfer takes with nothing else going on
            quiet.append(pair.genuine(f"q{n}"))
            pair.settle(deadline)
        for n in range(genuine_every):  # the same load, benign: requests without params amid one
            if n == genuine_every // 2:
                benign.append(pair.genuine(f"b{n}"))
            for engine, _, tokens in sides:
                pair.add(engine, f"{engine.options.name}-b{n}", 20 + n % 40, tokens, {}, f"b{n}")
                local.add(f"{engine.options.name}-b{n}")
        pair.settle(deadline)
        total = len(variants["decode"])
        for batch in range(0, total, genuine_every):  # a genuine pair amid each batch of hostile ones
            for n in range(batch, min(batch + genuine_every, total)):
                if n == batch + genuine_every // 2 or n == batch:
                    genuine.append(pair.genuine(f"g{n}"))
                for engine, _, tokens in sides:
                    crafted: Any = variants[engine.options.name][n]
                    inner = crafted.get("kvflow") if isinstance(crafted, dict) else None
                    if isinstance(inner, dict) and inner.get("transfer_id") == "TID":
                        inner["transfer_id"] = f"h{n}"  # a transfer of its own, unless its id is the mutation
                    rid = f"{engine.options.name}-h{n}"
                    if not (isinstance(crafted, dict) and crafted.get("do_remote_prefill")):
                        local.add(rid)  # not a remote prefill: D computes it (the stand-in does not)
                    pair.add(engine, rid, 20 + n % 40, tokens, crafted, f"h{n}")
                    report.hostile += 1
            pair.settle(deadline)
        genuine += quiet + benign
        report.genuine = len(genuine)
        report.unfinished = pair.unfinished()
        report.refused = len(refusals.ids)
        report.genuine_ok = sum(d.checked.get(rid) == 0 for rid in genuine)
        report.misread = sorted(
            rid for rid, bad in d.checked.items() if bad and rid not in refusals.ids and rid not in local
        )
        amid = pair.ms([rid for rid in genuine if rid not in quiet and rid not in benign])
        if amid:
            report.genuine_ms_p50, report.genuine_ms_max = statistics.median(amid), max(amid)
        report.quiet_ms_p50 = statistics.median(pair.ms(quiet) or [0.0])
        report.benign_ms = statistics.median(pair.ms(benign) or [0.0])
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
        pair.close()
    report.seconds = time.monotonic() - start
    return report
