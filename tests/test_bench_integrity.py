"""`kvflow bench integrity` at a tiny size through the CLI: every row holds the digests' cost and
the pushes' latency (the check off, on, and one transfer in 4 checked, how many D checked said), the JSON what the table
prints; bad settings are refused (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow_tools.cli import main
from kvflow_tools.errors import BenchError


def test_a_tiny_run_reports_each_length_with_the_check_off_and_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "integrity.json"
    argv = ["bench", "integrity", "--tokens", "16,100", "--layers", "2", "--heads", "2", "--head-dim", "16"]
    assert main([*argv, "--runs", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["tokens"] for row in report["rows"]] == [16, 100] and report["runs"] == 2
    for row in report["rows"]:
        assert row["seal_gib_s"] > 0 and row["check_gib_s"] > 0 and row["push_off_ms"] > 0 and row["push_on_ms"] > 0
        assert row["push_sampled_ms"] > 0
        checked, pushed = row["sampled_checked"]  # D's secret picks: any number of the 2 x 4
        assert pushed == 2 * 4 and 0 <= checked <= pushed
        assert len(row["seal_ms"]) == len(row["check_ms"]) == 2  # best, median
    # 100 tokens are 7 blocks of 16: 2 layers x K and V x 7 blocks x 16 tokens x 2 heads x 16 x 2 bytes
    assert report["rows"][1]["kv_bytes"] == 2 * 2 * 7 * 16 * 2 * 16 * 2
    table = capsys.readouterr().out
    assert "push on ms" in table and "1 in 4 ms" in table and "load average" in table and report["sample"] == 4


def test_bench_integrity_refuses_bad_settings() -> None:
    for argv in (["--tokens", "8"], ["--runs", "0"], ["--layers", "0"], ["--sample", "1"]):
        with pytest.raises(BenchError, match="bench integrity"):
            main(["bench", "integrity", *argv])
