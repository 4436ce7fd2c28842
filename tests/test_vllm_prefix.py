"""D with prefix caching on (vLLM's default), on vLLM's real Scheduler with async scheduling.

The compatibility matrix's prefix rows (tests/vllm_compat_prefix.py) run the same scenarios
with synchronous scheduling; here they run with vLLM's default async scheduling, where the next
step is scheduled before the previous one's output (and its transfer results) is read.  Plus a
failed load, which must leave no block of it in D's prefix cache, and the bytes the benchmark's
prefix-hit cell counts.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvflow.errors import ConfigError
from kvflow_tools.bench.bench_prefix import run_prefix_cell
from kvflow_tools.standin import StandInEngine
from tests import vllm_prefix
from tests.vllm_prefix import failed_load, pair

Scenario = Callable[[StandInEngine, StandInEngine], None]


@pytest.mark.parametrize("scenario", ["partial_hit", "full_hit", "shared_in_flight"])
def test_prefix_caching_on_decode_with_async_scheduling(scenario: str) -> None:
    run: Scenario = getattr(vllm_prefix, scenario)
    p, d = pair(async_scheduling=True)
    assert d.options.async_scheduling and d.config.cache_config.enable_prefix_caching
    try:
        run(p, d)
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_a_failed_load_leaves_no_cached_block_behind(scheduling: str) -> None:
    p, d = pair(async_scheduling=scheduling == "async", d_extra={"transfer_timeout": 2.0})
    try:
        failed_load(p, d)
    finally:
        d.close()
        p.close()


def test_the_bench_prefix_cell_counts_the_bytes_p_wrote() -> None:
    """`kvflow bench vllm --prefix-hit`: 133-token prompts are 5 blocks of 8 layers x 32 KiB;
    with 2 blocks in D's cache P writes the other 3, and every page D read holds P's KV."""
    cell = run_prefix_cell(tokens=133, shared=64, requests=2)
    block = 8 * 32 * 1024
    assert (cell.cold_bytes, cell.hit_bytes, cell.bad_pages) == ([5 * block] * 2, [3 * block] * 2, 0)
    assert cell.summary()["saved"] == pytest.approx(0.4)
    with pytest.raises(ConfigError, match="prefix-hit"):
        run_prefix_cell(tokens=133, shared=50, requests=1)
