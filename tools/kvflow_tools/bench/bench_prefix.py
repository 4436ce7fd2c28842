"""`kvflow bench vllm --prefix-hit N`: bytes moved per request when D's prefix cache holds a prefix.

Why a cell of its own: with prefix caching on D (vLLM's default), what a transfer moves depends
on what D already holds, not only on the prompt.  The cell runs P and D (D with prefix caching)
in this process on vLLM's real Scheduler, over the loopback transport or NIXL: first requests of
distinct prompts (D's cache holds nothing of them), then one request that warms D's cache with a
prefix of N tokens, then requests sharing that prefix.  For each request it reports the bytes P
wrote (the kvflow engine's ``bytes_written`` counter) and checks every page D read, from its
cache or loaded.  vLLM's NixlPushConnector trims its WRITE to D's uncached blocks the same way
(``_apply_prefix_caching`` in its push worker); it is not run here.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvflow.errors import ConfigError
from kvflow_tools.errors import BenchError
from kvflow_tools.standin import EngineOptions, StandInEngine
from kvflow_tools.standin.model import ModelShape

__all__ = ("PrefixCell", "main", "run_prefix_cell")

# the connector benchmark's model: 8 layers of 4 KV heads x 64, fp16, 32-token blocks
MODEL = ModelShape(family="opt", layers=8, kv_heads=4, head_dim=64, dtype="float16")
BLOCK_SIZE = 32
FLIGHT_TIMEOUT = 120.0


@dataclass
class PrefixCell:
    tokens: int  # prompt length
    shared: int  # tokens of the prefix D's cache holds for the hit requests (whole blocks)
    requests: int
    transport: str
    cold_bytes: list[int] = field(default_factory=list)  # per request, D's cache holding none of it
    hit_bytes: list[int] = field(default_factory=list)  # per request sharing the warmed prefix
    bad_pages: int = 0  # pages D read (from its cache or loaded) that did not hold P's KV

    def summary(self) -> dict[str, Any]:
        cold = statistics.median(self.cold_bytes) if self.cold_bytes else 0
        hit = statistics.median(self.hit_bytes) if self.hit_bytes else 0
        return {
            "tokens": self.tokens,
            "shared": self.shared,
            "transport": self.transport,
            "bytes_per_request_cold": cold,
            "bytes_per_request_hit": hit,
            "saved": 1 - hit / cold if cold else 0.0,
            "bad_pages": self.bad_pages,
        }


def _prompt(tokens: int, seed: int, shared: list[int] | None = None) -> list[int]:
    out = list(shared or [])
    out += [3 + (seed * 131 + i * 7) % 900 for i in range(len(out), tokens)]
    return out


class _Pair:
    def __init__(self, tokens: int, transport: str) -> None:
        blocks = 4 * (-(-tokens // BLOCK_SIZE) + 2) + 16
        max_len = max(1024, tokens + 64)
        extra: dict[str, Any] = {"transport": transport, "port": 0, "fabric": f"prefix-bench-{time.monotonic_ns()}"}

        def options(name: str, role: str, prefix_caching: bool) -> EngineOptions:
            return EngineOptions(
                name,
                role,
                extra,
                model=MODEL,
                num_blocks=blocks,
                max_model_len=max_len,
                max_num_batched_tokens=max_len,
                prefix_caching=prefix_caching,
            )

        self.p = StandInEngine(options("prefill", "kv_producer", False))
        try:
            self.d = StandInEngine(options("decode", "kv_consumer", True))
        except BaseException:
            self.p.close()
            raise
        self.serial = 0

    def written(self) -> int:
        engine = next(iter(self.p.kvflow_engines()))
        return int(engine.stats()["bytes_written"])

    def move(self, tokens: list[int]) -> tuple[int, int]:
        """One request through P and D: (bytes P wrote for it, bad pages D read)."""
        self.serial += 1
        tid = f"b{self.serial}"
        kv = {
            "transfer_id": tid,
            "epoch": 1,
            "mode": "push",
            "prefill": {"engine": "prefill", "address": self.p.worker.control_address},
            "decode": {"engine": "decode", "address": self.d.worker.control_address},
        }
        before = self.written()
        d_req = self.d.add(f"d-{tid}", len(tokens), 2, {"do_remote_prefill": True, "kvflow": kv}, tid, tokens)
        p_req = self.p.add(f"p-{tid}", len(tokens), 1, {"do_remote_decode": True, "kvflow": kv}, tid, tokens)
        deadline = time.monotonic() + FLIGHT_TIMEOUT
        while not (p_req.is_finished() and d_req.is_finished() and self.p.idle() and self.d.idle()):
            if time.monotonic() > deadline:
                raise BenchError(f"request {tid} did not finish within {FLIGHT_TIMEOUT}s")
            for engine in (self.p, self.d):
                if engine.busy():
                    engine.step()
            time.sleep(0.0005)
        return self.written() - before, self.d.checked.get(d_req.request_id, 0)

    def close(self) -> None:
        self.d.close()
        self.p.close()


def run_prefix_cell(tokens: int, shared: int, requests: int, transport: str = "loopback") -> PrefixCell:
    """Measure one cell.

    :raises ConfigError: a shared prefix that is not whole blocks shorter than the prompt.
    :raises BenchError: a request did not finish in time.
    """
    if shared <= 0 or shared % BLOCK_SIZE or shared >= tokens or requests <= 0:
        raise ConfigError(f"--prefix-hit must be a positive multiple of {BLOCK_SIZE} below the prompt length")
    cell = PrefixCell(tokens, shared, requests, transport)
    pair = _Pair(tokens, transport)
    try:
        for i in range(requests):
            written, bad = pair.move(_prompt(tokens, seed=1000 + i))
            cell.cold_bytes.append(written)
            cell.bad_pages += bad
        prefix = _prompt(shared, seed=1)
        pair.move(_prompt(tokens, seed=2, shared=prefix))  # warms D's cache with the prefix
        for i in range(requests):
            written, bad = pair.move(_prompt(tokens, seed=3 + i, shared=prefix))
            cell.hit_bytes.append(written)
            cell.bad_pages += bad
    finally:
        pair.close()
    return cell


def main(options: dict[str, Any]) -> int:
    """Run the prefix-hit cell for each prompt length; print (and with ``json``, write) it.

    :raises ConfigError, BenchError: see `run_prefix_cell`.
    """
    cells = [
        run_prefix_cell(tokens, options["prefix_hit"], options["requests"], options.get("transport", "loopback"))
        for tokens in options["tokens"]
        if tokens > options["prefix_hit"]
    ]
    rows = [cell.summary() for cell in cells]
    lines = ["tokens  shared  bytes/request cold  bytes/request hit  saved  bad pages"]
    for r in rows:
        lines.append(
            f"{r['tokens']:>6}  {r['shared']:>6}  {r['bytes_per_request_cold']:>18,.0f}  "
            f"{r['bytes_per_request_hit']:>17,.0f}  {r['saved']:>5.0%}  {r['bad_pages']:>9}"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    if options.get("json"):
        with open(options["json"], "w") as f:
            json.dump({"options": options, "summary": rows, "cells": [asdict(c) for c in cells]}, f, indent=1)
    return 1 if any(r["bad_pages"] for r in rows) else 0
