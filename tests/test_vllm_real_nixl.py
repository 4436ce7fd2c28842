"""The anchor: the real-engine P/D scenarios of tests/test_vllm_real_pd.py that apply to it,
run with vLLM's own `NixlConnector` (pull after P answered) between the same real vLLM CPU
servers, checked the same way: D's greedy tokens equal one plain engine's, and D's counters say
every prompt token it did not hold came by transfer.  Where kvflow and vLLM's connector differ
on a scenario, this module is what vLLM itself does there.

Only the sequential convention applies (vLLM's connector needs P's answer before D can pull);
push, kvflow's router's concurrent dispatch and kvflow's metrics do not.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvflow_tools.serve.launcher import Deployment, ServeOptions
from tests.vllm_real import (
    BLOCK,
    PREFILL_BUDGET,
    chunked,
    prefix_on_d,
    running,
    sixteen_at_once,
    through_router,
    toy_proxy,
)

pytestmark = [pytest.mark.timeout(1200), pytest.mark.real_engine]  # the module's first test also starts three engines


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    options = ServeOptions(
        connector="nixl",
        mode="sequential",
        reference=True,
        port=0,
        block_size=BLOCK,
        max_model_len=2048,
        prefill_batched_tokens=PREFILL_BUDGET,
        run_dir=tmp_path_factory.mktemp("real-nixl"),
        # Stock NIXL's progress thread polls without pause, a core per agent: on 2 cores with three
        # engines that starved every other process for 10-26 s at a time (the router closed
        # requests at its header deadline, D missed its health checks, P's leases expired).
        nixl_progress_delay_us=1000,
    )
    yield from running(options)


def test_tokens_through_a_sequential_router_equal_one_engines_and_the_kv_came_by_transfer(pd: Deployment) -> None:
    through_router(pd, pd.router_url, 3)


def test_vllms_toy_proxy_convention(pd: Deployment) -> None:
    toy_proxy(pd, "prefill-0", 7)


def test_sixteen_concurrent_requests_of_mixed_lengths(pd: Deployment) -> None:
    sixteen_at_once(pd, pd.router_url)


def test_a_prompt_longer_than_ps_token_budget_is_prefilled_in_chunks_and_moves(pd: Deployment) -> None:
    chunked(pd, pd.router_url, 29)


def test_a_prefix_d_holds_comes_from_ds_cache_and_only_the_tail_moves(pd: Deployment) -> None:
    prefix_on_d(pd, pd.router_url, 42)
