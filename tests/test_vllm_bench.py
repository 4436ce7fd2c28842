"""The side-by-side benchmark: kvflow's connector and vLLM's two NIXL connectors, each as two
real engine processes over NIXL-UCX, with every received page checked.  Timings are printed by
`kvflow bench vllm`, never asserted here; what is asserted is that every connector moved and
verified real bytes, and that the pattern check catches what it must."""

from __future__ import annotations

import pytest
import torch

from kvflow.cli import main as cli_main
from kvflow.errors import ConfigError
from kvflow.integrations.vllm.bench import render, run, summarize
from kvflow.integrations.vllm.runner import PatternKV


def test_pattern_check_catches_stale_torn_and_misplaced_pages() -> None:
    kv = {f"layer{i}": torch.zeros(16, 4, 32, 128, dtype=torch.float16) for i in range(2)}
    pages = PatternKV(kv, 16)
    positions, blocks = [0, 1, 2], [5, 9, 3]
    assert pages.count_bad("t1", positions, blocks) == 6  # zeroed pages never match
    pages.write("t1", positions, blocks)
    assert pages.count_bad("t1", positions, blocks) == 0
    assert pages.count_bad("t2", positions, blocks) == 6  # another transfer's pages
    assert pages.count_bad("t1", [0, 2, 1], blocks) == 4  # blocks in the wrong order
    kv["layer1"][9, 3, 31, 127] = 3.0  # one torn element
    assert pages.count_bad("t1", positions, blocks) == 1


def test_every_connector_moves_and_verifies_real_bytes() -> None:
    connectors = ["kvflow", "vllm-push", "vllm-pull"]
    cells = run(connectors, tokens=[96], concurrency=[2], step_ms=[0.0], requests=3, repeats=1, warmup=1)
    rows = summarize(cells)
    assert sorted(r["connector"] for r in rows) == sorted(connectors)
    for row in rows:
        assert row["failed"] == 0 and row["bad_pages"] == 0, row
        assert row["bytes_verified"] == 3 * 3 * 8 * 32 * 1024, row  # 3 requests x 3 blocks x 8 layers
    table = render(rows)
    assert all(name in table for name in connectors)


def test_the_command_refuses_an_unknown_connector_before_starting_anything() -> None:
    with pytest.raises(ConfigError, match="nope"):
        cli_main(["bench", "vllm", "--connectors", "kvflow,nope", "--requests", "1"])
