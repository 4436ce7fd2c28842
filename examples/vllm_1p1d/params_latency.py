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

from kvflow_tools.testing.params_soak import StandInPair

KINDS = ("benign", "refused", "one-sided")


def batch(pair: StandInPair, kind: str, n: int, size: int) -> float:
    """One batch of `kind` with a genuine transfer among it: that transfer's ms."""
    genuine = pair.genuine(f"g-{kind}-{n}")
    for i in range(size):
        rid = f"{kind}{n}-{i}"
        d_params: dict[str, Any] = {}
        p_params: dict[str, Any] = {}
        if kind == "refused":
            d_params = {"do_remote_prefill": True, "kvflow": pair.params(rid, epoch=2**64)}
            p_params = {"do_remote_decode": True, "kvflow": pair.params(rid, epoch=2**64)}
        elif kind == "one-sided":  # valid, but P and D name different transfers
            d_params = {"do_remote_prefill": True, "kvflow": pair.params("D" + rid)}
            p_params = {"do_remote_decode": True, "kvflow": pair.params("P" + rid)}
        pair.add(pair.d, f"d-{rid}", 20 + i % 40, 4, d_params, rid)
        pair.add(pair.p, f"p-{rid}", 20 + i % 40, 1, p_params, rid)
    pair.settle(time.monotonic() + 600)
    (ms,) = pair.ms([genuine])
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="batches of each kind, taking turns")
    parser.add_argument("--batch", type=int, default=50, help="requests at each side per batch")
    args = parser.parse_args()
    logging.getLogger("kvflow").setLevel(logging.CRITICAL)  # every refusal is logged: not what is timed
    pair = StandInPair("latency", 2.0)
    try:
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for n in range(args.rounds):
            for kind in KINDS:
                times[kind].append(batch(pair, kind, n, args.batch))
    finally:
        pair.close()
    summary = {
        kind: {"ms": [round(t, 1) for t in ts], "median_ms": round(statistics.median(ts), 1)}
        for kind, ts in times.items()
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
