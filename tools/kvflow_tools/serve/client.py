"""`kvflow bench serve`'s client: open-loop streaming OpenAI requests, engines' CPU, their metrics.

Why its own client rather than vLLM's ``vllm bench serve``: the benchmark stops the pairs not
being measured (SIGSTOP) and samples each engine's CPU from /proc around every turn, in this
process, between turns; vLLM's client is a separate program (a fresh vLLM import per turn, in
another interpreter) that draws its own arrivals.  This one sends exactly the seeded arrivals
of `workload.arrivals` at their times, whatever earlier requests are doing (open loop), and
measures what vLLM's does: TTFT at the first streamed token, TPOT over the rest, end to end,
and a failure for any status other than 200, a broken stream or fewer tokens than asked for.
Prompts are token ids, unique per system (`prompt_ids`), so no prefix cache ever serves one.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvflow_tools.pd.workload import Arrival

__all__ = ("Result", "deltas", "group_usage", "metric_sum", "prompt_ids", "run_requests")

VOCAB = 1000  # prompt tokens are ids below this (the tiny model's vocabulary is 1024; 1023 is EOS)
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


@dataclass
class Result:
    """One request as the client saw it (times in ms from its send; None where not reached)."""

    id: str
    prompt: int
    output: int
    arrival_s: float
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    tokens: int = 0  # completion tokens streamed
    error: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.error) or self.tokens < self.output

    @property
    def tpot_ms(self) -> float | None:
        if self.failed or self.ttft_ms is None or self.e2e_ms is None or self.tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.tokens - 1)

    def row(self) -> dict[str, Any]:
        def r(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        return {
            "id": self.id,
            "prompt": self.prompt,
            "output": self.output,
            "arrival_s": round(self.arrival_s, 6),
            "ttft_ms": r(self.ttft_ms) if not self.failed else None,
            "tpot_ms": r(self.tpot_ms),
            "e2e_ms": r(self.e2e_ms) if not self.failed else None,
            "tokens": self.tokens,
            "error": self.error,
        }


def prompt_ids(arrival: Arrival, salt: str) -> list[int]:
    """`arrival.prompt` token ids, the same for the same arrival and `salt`, and (with
    overwhelming odds) sharing no 16-token block with any other arrival or salt."""
    rng = random.Random(f"{salt}/{arrival.id}")
    return [rng.randrange(1, VOCAB) for _ in range(arrival.prompt)]


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, arrival: Arrival, salt: str, timeout: float
) -> Result:
    result = Result(arrival.id, arrival.prompt, arrival.output, arrival.arrival_s)
    body = {
        "model": model,
        "prompt": prompt_ids(arrival, salt),
        "max_tokens": arrival.output,
        "temperature": 0.0,
        "ignore_eos": True,  # every request decodes exactly its output length
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout), session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            usage = None
            async for raw in response.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    result.error = f"stream error: {str(chunk['error'])[:300]}"
                    return result
                choices = chunk.get("choices") or []
                if any(c.get("text") for c in choices):
                    if result.ttft_ms is None:
                        result.ttft_ms = (time.perf_counter() - start) * 1e3
                    result.tokens += 1  # vLLM streams one chunk per token (no stream batching asked)
                usage = chunk.get("usage") or usage
            result.e2e_ms = (time.perf_counter() - start) * 1e3
            if usage is not None:  # the server's own count, where a chunk carried more than one token
                result.tokens = int(usage.get("completion_tokens", result.tokens))
    except TimeoutError:
        result.error = f"no complete answer within {timeout:g} s"
    except (aiohttp.ClientError, ValueError) as exc:
        result.error = f"{exc.__class__.__name__}: {exc}"
    if not result.error and result.tokens < arrival.output:
        result.error = f"{result.tokens} of {arrival.output} tokens"
    return result


async def _run(
    url: str, model: str, arrivals: list[Arrival], salt: str, timeout: float, done: Callable[[int], None] | None
) -> list[Result]:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)  # servers close idle ones after 5 s
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()

        async def at_its_time(arrival: Arrival) -> Result:
            await asyncio.sleep(max(0.0, start + arrival.arrival_s - time.perf_counter()))
            result = await _one(session, url, model, arrival, salt, timeout)
            if done is not None:
                done(1)
            return result

        return list(await asyncio.gather(*(at_its_time(a) for a in arrivals)))


def run_requests(
    url: str,
    model: str,
    arrivals: list[Arrival],
    salt: str,
    timeout: float = 300.0,
    done: Callable[[int], None] | None = None,
) -> list[Result]:
    """Send `arrivals` to the OpenAI server at `url`, each at its arrival time after now, and
    return their results in the same order; `done(1)` after each one ends."""
    return asyncio.run(_run(url, model, arrivals, salt, timeout, done))


def group_usage(pgid: int, proc: Path = Path("/proc")) -> tuple[float, int]:
    """User plus system CPU seconds, and the sum of resident bytes, of every live process in
    process group `pgid` (from ``/proc/<pid>/stat``; a process that ends between listing and
    reading is skipped)."""
    ticks, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    cpu = rss = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 on
        if int(fields[2]) == pgid:  # field 5: pgrp
            cpu += int(fields[11]) + int(fields[12])  # fields 14, 15: utime, stime
            rss += int(fields[21])  # field 24: rss in pages
    return cpu / ticks, rss * page


def metric_sum(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The sum over every sample of metric `name` in Prometheus text `text` whose labels
    include `labels` (0 when there is none)."""
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in (labels or {}).items()):
            total += float(match.group(3))
    return total


def deltas(before: Mapping[str, float], after: Mapping[str, float], keys: Iterable[str]) -> dict[str, float]:
    """``after - before`` for each of `keys` (a key missing counts as 0)."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys}
