"""`kvflow bench hma` at small prompts through the CLI, its figures checked against vLLM's rule.

The rule (vLLM's SlidingWindowManager): after N computed tokens a sliding-window group with
window W frees floor(max(0, N - W + 1) / B) leading blocks to the null block and keeps the rest of
its ceil(N / B); a full-attention group keeps all ceil(N / B).  vLLM's NIXL connector sends the
last ceil(W / B) + 1 entries of a sliding-window group's list.  Bytes: 2 (K and V) x B tokens x
KV heads x head size x 2 (bfloat16) per layer and block.  No timing is asserted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow_tools.bench.bench_hma import BLOCK, MODELS, measure
from kvflow_tools.cli import main

pytest.importorskip("vllm")

TOKENS = [100, 1024, 1040, 2000]  # under, at and past the 1024-token window; not block multiples


def kept(tokens: int, window: int | None) -> int:
    blocks = -(-tokens // BLOCK)
    if window is None:
        return blocks
    return blocks - max(0, tokens - window + 1) // BLOCK


def test_bench_hma_reports_the_blocks_vllm_keeps_and_the_bytes_each_way(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hma.json"
    assert main(["bench", "hma", "--tokens", ",".join(map(str, TOKENS)), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert {(r["model"], r["tokens"]) for r in rows} == {(m, n) for m in MODELS for n in TOKENS}
    for row in rows:
        model, n = MODELS[row["model"]], row["tokens"]
        page = 2 * BLOCK * model.kv_heads * model.head_dim * 2
        sliding = sum(not model.is_full(i) for i in range(model.layers))
        assert sum(g["layers"] for g in row["groups"]) == model.layers
        assert sum(g["layers"] for g in row["groups"] if g["window"]) == sliding
        for g in row["groups"]:
            assert g["page_bytes"] == page
            assert g["window"] in (None, model.window)
            assert g["kept_blocks"] == kept(n, g["window"])
            assert g["blocks"] == -(-n // BLOCK)  # the freed ones are null entries, in place
            expected_list = min(g["blocks"], -(-model.window // BLOCK) + 1) if g["window"] else g["blocks"]
            assert g["nixl_list"] == expected_list
            assert g["nixl_list"] - g["nixl_list_nulls"] == min(g["kept_blocks"], g["nixl_list"])
        expected_hma = page * (sliding * kept(n, model.window) + (model.layers - sliding) * kept(n, None))
        assert row["bytes_hma"] == expected_hma
        [whole] = row["groups_hma_off"]  # the manager off: one group, every layer, every block
        assert whole["layers"] == model.layers and whole["kept_blocks"] == -(-n // BLOCK)
        assert row["bytes_hma_off"] == page * model.layers * -(-n // BLOCK)
        assert row["ratio"] == pytest.approx(row["bytes_hma_off"] / expected_hma)
        assert f"{n:,}" in printed
    at_window = next(r for r in rows if r["model"] == "gemma3-27b" and r["tokens"] == 1024)
    assert at_window["ratio"] == 1.0  # nothing has left a 1024-token window yet


def test_chunked_prefill_leaves_the_same_blocks() -> None:
    model = MODELS["gpt-oss-120b"]
    whole, chunked = measure(model, [700]), measure(model, [700], chunk=96)
    assert [g["kept_blocks"] for g in whole[0]["groups"]] == [g["kept_blocks"] for g in chunked[0]["groups"]]
    assert whole[0]["bytes_hma"] == chunked[0]["bytes_hma"]


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="models must be among"):
        main(["bench", "hma", "--models", "llama", "--tokens", "16"])
    with pytest.raises(ValueError, match="at least 1"):
        measure(MODELS["gpt-oss-120b"], [0])


def test_bench_hma_moved_is_what_vllm_keeps_each_way(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With ``--moved`` kvflow moves each prompt between a P and a D of the model (every page D
    holds checked): P writes exactly the block-layers vLLM keeps, the manager on and off."""
    out = tmp_path / "moved.json"
    argv = ["bench", "hma", "--models", "gpt-oss-120b", "--tokens", "100,300", "--moved", "--json", str(out)]
    assert main(argv) == 0
    assert "kvflow's P wrote" in capsys.readouterr().out
    for row in json.loads(out.read_text()):
        on = sum(g["kept_blocks"] * g["layers"] for g in row["groups"])
        off = sum(g["kept_blocks"] * g["layers"] for g in row["groups_hma_off"])
        assert (row["moved_block_layers_hma"], row["moved_block_layers_hma_off"]) == (on, off)
    assert row["moved_block_layers_hma"] < row["moved_block_layers_hma_off"]  # 300 tokens: past the window
