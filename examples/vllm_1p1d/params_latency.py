"""What hostile kv_transfer_params cost a genuine transfer, against the same load without them.

Why: `kvflow soak --fuzz` reports a genuine transfer's time amid batches of hostile requests,
but a batch of requests costs a genuine one time in vLLM's scheduler whatever their params say.
This holds the load equal: stand-in P and D (vLLM's scheduler and allocation, kvflow's
connector, real ZeroMQ), batches of 50 requests at each side with one genuine transfer among
them, taking turns between three kinds of batch: requests without params (benign), params the
connector refuses (an epoch of 2**64), and valid params that name a transfer only one side
holds (it waits out its deadline).  It prints the genuine transfer's time, from its being added
to D until its KV landed, per batch and the median per kind.

    .venv/bin/python -m examples.vllm_1p1d.params_latency --rounds 4
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Any

from kvflow.integrations.vllm.standin import EngineOptions, StandInEngine

KINDS = ("benign", "refused", "one-sided")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="batches of each kind, taking turns")
    parser.add_argument("--batch", type=int, default=50, help="requests at each side per batch")
    args = parser.parse_args()
    from vllm.v1.request import RequestStatus

    logging.getLogger("kvflow").setLevel(logging.CRITICAL)  # every refusal is logged: not what is timed
    common = {"transport": "loopback", "fabric": "latency", "port": 0, "transfer_timeout": 2.0, "push_group_bytes": 0}
    p = StandInEngine(EngineOptions("prefill", "kv_producer", dict(common)))
    d = StandInEngine(EngineOptions("decode", "kv_consumer", dict(common), failure_policy="fail"))
    landed: dict[str, float] = {}
    d.emit = lambda **e: (
        landed.__setitem__(e["id"], e["t"]) if e.get("ev") == "recving" and not e.get("failed") else None
    )
    requests: list[Any] = []

    def params(tid: str, **changes: Any) -> dict[str, Any]:
        kv: dict[str, Any] = {"transfer_id": tid, "epoch": 1, "mode": "push", **changes}
        kv["prefill"] = {"engine": "prefill", "address": p.worker.control_address, "tp_size": 1}
        kv["decode"] = {"engine": "decode", "address": d.worker.control_address, "tp_size": 1}
        return kv

    def settle() -> None:
        while not (all(r.status >= RequestStatus.FINISHED_STOPPED for r in requests) and p.idle() and d.idle()):
            for engine in (p, d):
                if engine.busy():
                    engine.step()
            time.sleep(0.001)

    def batch(kind: str, n: int) -> float:
        tid = f"g-{kind}-{n}"
        requests.append(d.add(f"d-{tid}", 70, 4, {"do_remote_prefill": True, "kvflow": params(tid)}, tag=tid))
        requests.append(p.add(f"p-{tid}", 70, 1, {"do_remote_decode": True, "kvflow": params(tid)}, tag=tid))
        for i in range(args.batch):
            rid = f"{kind}{n}-{i}"
            if kind == "benign":
                d_params, p_params = {}, {}
            elif kind == "refused":
                d_params = {"do_remote_prefill": True, "kvflow": params(rid, epoch=2**64)}
                p_params = {"do_remote_decode": True, "kvflow": params(rid, epoch=2**64)}
            else:  # valid, but P and D name different transfers
                d_params = {"do_remote_prefill": True, "kvflow": params("D" + rid)}
                p_params = {"do_remote_decode": True, "kvflow": params("P" + rid)}
            requests.append(d.add(f"d-{rid}", 20 + i % 40, 4, d_params, tag=rid))
            requests.append(p.add(f"p-{rid}", 20 + i % 40, 1, p_params, tag=rid))
        settle()
        return (landed[f"d-{tid}"] - d.added[f"d-{tid}"]) * 1e3

    try:
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for n in range(args.rounds):
            for kind in KINDS:
                times[kind].append(batch(kind, n))
    finally:
        p.close()
        d.close()
    print(
        json.dumps(
            {
                kind: {"ms": [round(t, 1) for t in ts], "median_ms": round(statistics.median(ts), 1)}
                for kind, ts in times.items()
            }
        )
    )


if __name__ == "__main__":
    main()
