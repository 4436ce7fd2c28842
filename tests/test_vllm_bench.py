"""The side-by-side benchmark: kvflow's connector and vLLM's two NIXL connectors, each as two
real engine processes over NIXL-UCX, with every received page checked.  Timings are printed by
`kvflow bench vllm`, never asserted here; what is asserted is that every connector moved and
verified real bytes, and that the pattern check catches what it must."""

from __future__ import annotations

import pytest
import torch
import vllm

from kvflow.errors import ConfigError
from kvflow_tools.bench.bench_report import render, render_hooks, summarize, verdict
from kvflow_tools.bench.bench_vllm import run
from kvflow_tools.cli import main as cli_main
from kvflow_tools.standin import PagedKV

# vLLM's NIXL agents poll every millisecond, not in a busy loop (NIXL's default): these runs check
# what is moved and measured, and two spinning agents would take this machine's two cores
QUIET_NIXL = {"nixl_progress_delay_us": 1000}


@pytest.mark.parametrize("layout", ["LBNHC", "LHBNC"])
def test_pattern_check_catches_stale_torn_and_misplaced_pages(layout: str) -> None:
    """Views over one int8 buffer, made by vLLM's own `create_kv_cache_views` in a layout where
    a page is one run of bytes and in one where it is one run per head."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, compute_layout_strides
    from vllm.v1.kv_cache_interface import create_kv_cache_views as views_of
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=64, dtype=torch.float16)
    names, blocks_total = ["l0", "l1"], 16
    kind = KVCacheLayout[layout]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, blocks_total, len(names), kind)
    size = spec.page_size_bytes * blocks_total * len(names)
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride)
    views = views_of(raw, spec, blocks_total, kind, tensor)
    pages = PagedKV(views, blocks_total, 32, shard=0)
    positions, blocks = [0, 1, 2], [5, 9, 3]
    assert pages.count_bad("t1", positions, blocks, 96) == 6  # zeroed pages never match
    for layer in range(2):
        pages.write_blocks(layer, "t1", positions[:2], blocks[:2])
        pages.write(layer, "t1", 2, 3, 0, 20)  # the last block: 20 of its 32 tokens
    assert pages.count_bad("t1", positions, blocks, 84) == 0
    assert pages.count_bad("t1", positions, blocks, 85) == 2  # a token prefill never wrote
    assert pages.count_bad("t2", positions, blocks, 84) == 6  # another transfer's pages
    assert pages.count_bad("t1", [0, 2, 1], blocks, 84) == 4  # blocks in the wrong order
    assert PagedKV(views, blocks_total, 32, shard=1).count_bad("t1", positions, blocks, 84) == 6  # another shard
    views[1][9, 3, 31, 127] = 3.0  # one torn element
    assert pages.count_bad("t1", positions, blocks, 84) == 1


@pytest.mark.system
@pytest.mark.timeout(1200)  # four pairs of engine processes, each started again once if it hangs
def test_every_connector_moves_and_verifies_real_bytes() -> None:
    """vLLM 0.34's push (NixlConnector in push mode) and pull, and 0.33's NixlPushConnector,
    whose engine processes run in 0.33's environment: each engine says which vLLM it runs."""
    connectors = ["kvflow", "vllm-push", "vllm-push-0.33", "vllm-pull"]
    cells = run(
        connectors, tokens=[96], concurrency=[2], step_ms=[0.0], requests=3, repeats=1, warmup=1, options=QUIET_NIXL
    )
    rows = summarize(cells)
    assert sorted(r["connector"] for r in rows) == sorted(connectors)
    for row in rows:
        assert row["failed"] == 0 and row["bad_pages"] == 0, row
        assert row["bytes_per_request"] == 3 * 8 * 32 * 1024, row  # 3 blocks x 8 layers x 32 KiB
        assert row["bytes_verified"] == 3 * row["bytes_per_request"], row  # 3 requests
    releases = {row["connector"]: row["vllm"] for row in rows}
    assert releases["vllm-push-0.33"].startswith("0.33.") and releases["vllm-push"].startswith("0.34.")
    assert releases["vllm-pull"].startswith("0.34.") and releases["kvflow"] == vllm.__version__
    table = render(rows)
    assert all(name in table for name in connectors)
    assert "vllm-push-0.33 on 0.33." in table.splitlines()[0]
    assert "start→recv" in table
    for row in rows:  # every flight is measured from the start of P's last prefill step too
        assert row["start_to_recv_p50_ms"] >= row["kv_to_recv_p50_ms"], row
        for side in ("p_hook_us", "d_hook_us"):  # each hook the model runner calls, per step
            hooks = row[side]
            assert {"bind_connector_metadata", "save_kv_layer", "wait_for_save", "get_transfer_results"} <= set(hooks)
            assert all(v["p50"] <= v["p99"] for v in hooks.values()), hooks
    hooks_table = render_hooks(rows)
    assert all(f"{name} 96 tok/1 c2 fast:" in hooks_table for name in connectors)
    assert "save_kv_layer" in hooks_table


@pytest.mark.system
@pytest.mark.timeout(600)  # two pairs of engine processes, on a machine it may share
def test_a_long_prompt_prefilled_in_chunks_moves_and_is_compared_from_ps_last_step() -> None:
    """The long-prompt cell alone: P's budget of 64 tokens makes a 256-token prefill four steps."""
    connectors = ["kvflow", "vllm-pull"]
    cells = run(
        connectors, [], [1], [0.0], requests=2, repeats=1, warmup=0, options=QUIET_NIXL, long_tokens=256, long_chunks=4
    )
    rows = summarize(cells)
    assert sorted((r["connector"], r["chunks"]) for r in rows) == [("kvflow", 4), ("vllm-pull", 4)]
    for row in rows:
        assert row["failed"] == 0 and row["bad_pages"] == 0, row
        assert row["bytes_per_request"] == 8 * 8 * 32 * 1024, row  # 8 blocks x 8 layers x 32 KiB
    (line,) = verdict(rows)
    assert line.startswith("256 tokens in 4 chunks, 1 in flight, fast steps: kvflow kv→recv p50"), line
    with pytest.raises(ConfigError, match="token budget of 64..255 tokens per chunk, not 32"):
        run(connectors, [], [1], [0.0], long_tokens=256, long_chunks=8)


def test_the_command_refuses_an_unknown_connector_before_starting_anything() -> None:
    with pytest.raises(ConfigError, match="nope"):
        cli_main(["bench", "vllm", "--connectors", "kvflow,nope", "--requests", "1"])


def test_a_pair_that_does_not_start_in_time_is_started_again_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that hangs (seen once in CI: engines that never said ready) gets one more try with
    fresh ports; an engine that exits is not retried, and a second hang is reported."""
    from kvflow_tools.bench import runner_pair as bench
    from kvflow_tools.errors import BenchError

    attempts: list[str] = []

    def starting(outcomes: list[str]) -> object:
        def pair(connector: str, *args: object) -> str:
            attempts.append(connector)
            outcome = outcomes[len(attempts) - 1]
            if outcome != "ready":
                raise BenchError(f"{connector}: {outcome} waiting for engines to start")
            return "started"

        return pair

    monkeypatch.setattr(bench, "Pair", starting(["timed out", "ready"]))
    assert bench.start_pair("kvflow", 96, 1, {}) == "started" and len(attempts) == 2  # type: ignore[comparison-overlap]
    attempts.clear()
    monkeypatch.setattr(bench, "Pair", starting(["engine P exited while", "ready"]))
    with pytest.raises(BenchError, match="exited"):
        bench.start_pair("kvflow", 96, 1, {})
    assert len(attempts) == 1
    attempts.clear()
    monkeypatch.setattr(bench, "Pair", starting(["timed out", "timed out", "ready"]))
    with pytest.raises(BenchError, match="timed out"):
        bench.start_pair("kvflow", 96, 1, {})
    assert len(attempts) == 2


def test_each_vllm_connector_runs_from_the_environment_of_its_release(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from kvflow_tools.bench.systems import CONNECTORS, ENVIRONMENTS, ROOT, Connector, installed_release, python_for
    from kvflow_tools.errors import BenchError

    here = installed_release()
    assert vllm.__version__.startswith(here + ".")
    assert python_for(CONNECTORS["kvflow"]) == sys.executable  # kvflow: whatever vLLM is here
    for name in ("vllm-push", "vllm-pull", "vllm-push-0.33"):
        release = CONNECTORS[name].release
        assert release is not None
        expected = sys.executable if release == here else str(ROOT / ENVIRONMENTS[release] / "bin" / "python")
        assert python_for(CONNECTORS[name]) == expected, name
    assert CONNECTORS["vllm-push"].extra == {"transfer_mode": "push"}  # 0.34 names its push connector so
    monkeypatch.setenv("KVFLOW_VLLM_031_PYTHON", "/nowhere/python")
    with pytest.raises(BenchError, match=r"vLLM 0\.31 runs in another environment, and /nowhere/python does not"):
        python_for(Connector("NixlPushConnector", release="0.31"))


@pytest.mark.system
@pytest.mark.timeout(300)
def test_a_connector_whose_engines_run_another_vllm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.33's NixlPushConnector pointed at an environment of another vLLM: the engines say which
    they run, and the pair is refused before any request, naming both."""
    import sys

    from kvflow_tools.bench.runner_pair import start_pair
    from kvflow_tools.bench.systems import installed_release
    from kvflow_tools.errors import BenchError

    assert installed_release() != "0.33"  # this environment's vLLM, standing in for the wrong one
    monkeypatch.setenv("KVFLOW_VLLM_033_PYTHON", sys.executable)
    with pytest.raises(BenchError, match=r"vllm-push-0\.33 needs vLLM 0\.33, and its engines run vLLM 0\.34\."):
        start_pair("vllm-push-0.33", 96, 1, QUIET_NIXL)
