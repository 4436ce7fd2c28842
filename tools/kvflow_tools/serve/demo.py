"""`kvflow demo`: the main job's first half: real vLLM P/D with kvflow, checked against one engine.

Why: the shortest honest answer to "does it work in a real vLLM?" is to start real servers
(1P1D with kvflow push, behind kvflow's router, and one plain engine), send a batch of requests
through the router at once, and show for each that D's greedy tokens equal the plain engine's
and that D's own counters saw the prompt arrive by transfer, not computed.  Every process
started is stopped before it returns.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvflow.errors import ConfigError
from kvflow_tools.errors import ServerFailed
from kvflow_tools.serve.client import metric_sum
from kvflow_tools.serve.launcher import Deployment, ServeOptions, Server

__all__ = ("main", "run_check")

LENGTHS = (7, 64, 100, 250, 500, 900, 1500, 33, 160, 400, 77, 1200)  # prompt tokens of the batch
STEPS = 16  # greedy tokens asked of each request
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # vLLM's prompt-token sources


def _post(url: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return dict(json.loads(answer.read()))
    except urllib.error.HTTPError as error:
        return {"error": f"HTTP {error.code}: {error.read()[:300]!r}"}
    except OSError as error:
        return {"error": repr(error)}


def _tokens(answer: dict[str, Any]) -> list[int] | None:
    try:
        return [int(t) for t in answer["choices"][0]["token_ids"]]
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _by_source(server: Server) -> dict[str, float]:
    text = server.metrics()
    name = "vllm:prompt_tokens_by_source_total"
    return {source: metric_sum(text, name, {"source": source}) for source in SOURCES}


def run_check(deployment: Deployment, seed: int = 1) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Send the batch through the router at once and each prompt to the plain engine; per
    request: its length, whether the tokens match, the seconds it took; and D's prompt tokens
    by source gained meanwhile."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 1024) for _ in range(n)] for n in LENGTHS]
    model = deployment.options.served_model_name

    def body(prompt: list[int]) -> dict[str, Any]:
        return {"model": model, "prompt": prompt, "max_tokens": STEPS, "temperature": 0, "return_token_ids": True}

    reference = deployment.server("reference")
    wants = [_tokens(_post(f"{reference.url}/v1/completions", body(p))) for p in prompts]
    decode = deployment.server("decode-0")
    before = _by_source(decode)

    def through_router(prompt: list[int]) -> tuple[dict[str, Any], float]:
        start = time.monotonic()
        return _post(f"{deployment.router_url}/v1/completions", body(prompt)), time.monotonic() - start

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(through_router, prompts))
    after = _by_source(decode)
    rows = []
    for prompt, want, (answer, seconds) in zip(prompts, wants, answers, strict=True):
        got = _tokens(answer)
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "same_tokens": got is not None and got == want,
                "seconds": round(seconds, 3),
                "error": answer.get("error", ""),
            }
        )
    gained = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in sorted(set(before) | set(after))}
    return rows, gained


def main(options: ServeOptions | None = None) -> int:
    """1P1D kvflow push and one plain engine: the batch, its table, 0 on success."""
    options = replace(options or ServeOptions(), reference=True, port=0)
    out = sys.stdout
    try:
        deployment = Deployment(options)
    except ConfigError as exc:
        out.write(f"kvflow demo: {exc}\n")
        return 2
    out.write(f"starting 1P1D with kvflow push and a plain engine (real vLLM servers; logs in {deployment.run_dir})\n")
    out.flush()
    try:
        started = time.monotonic()
        deployment.start()
        out.write(f"up in {time.monotonic() - started:.0f} s; {len(LENGTHS)} requests through the router at once\n")
        rows, gained = run_check(deployment)
    except ServerFailed as exc:
        out.write(f"kvflow demo: {exc}\n")
        return 1
    finally:
        left = deployment.stop()
    out.write("| prompt tokens | D's tokens = one engine's | seconds | error |\n|---:|---|---:|---|\n")
    for row in rows:
        same = "yes" if row["same_tokens"] else "NO"
        out.write(f"| {row['prompt_tokens']} | {same} | {row['seconds']} | {row['error']} |\n")
    prompt_tokens = sum(row["prompt_tokens"] for row in rows)
    out.write(
        f"D's prompt tokens: {gained.get('external_kv_transfer', 0):.0f} by transfer, "
        f"{gained.get('local_cache_hit', 0):.0f} from its cache, {gained.get('local_compute', 0):.0f} computed "
        f"(of {prompt_tokens})\n"
    )
    ok = all(row["same_tokens"] for row in rows) and gained.get("local_compute", 0) == 0 and not left
    if left:
        out.write(f"processes left running in {left}\n")
    out.write("all tokens equal, every prompt moved by transfer\n" if ok else "kvflow demo: FAILED\n")
    out.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(ServeOptions(run_dir=Path("results") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}")))
