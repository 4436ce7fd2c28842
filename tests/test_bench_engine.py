"""`kvflow bench engine` at a tiny size, through the CLI: every cell runs and the JSON report
holds what the table prints (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow_tools.cli import main
from kvflow_tools.errors import BenchError


def test_bench_engine_runs_every_cell_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "engine.json"
    argv = ["bench", "engine", "--quick", "--sizes", "0,64", "--windows", "2", "--transfers", "6"]
    assert main([*argv, "--aging", "24", "--memory", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    cells = {(c["mode"], c["size"], c["window"]): c for c in report["cells"]}
    assert set(cells) == {(mode, size, 2) for mode in ("loopback", "zmq-shm") for size in (0, 64)}
    assert all(c["transfers"] == 6 and c["rate"] > 0 for c in cells.values())
    assert report["aging"]["first"] == 2 and report["aging"]["after"] == 20
    assert [m["in_flight"] for m in report["memory"]] == [4] and report["memory"][0]["bytes_per_transfer"] > 0
    table = capsys.readouterr().out
    assert "zmq-shm" in table and "aging" in table and "per transfer" in table


@pytest.mark.parametrize(
    ("option", "problem"), [(["--modes", "rdma"], "unknown modes"), (["--windows", "0"], "must be >= 1")]
)
def test_bench_engine_refuses_bad_options_naming_them(option: list[str], problem: str) -> None:
    with pytest.raises(BenchError, match=problem):
        main(["bench", "engine", "--quick", *option])


def test_bench_frames_decodes_the_largest_frame_of_each_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvflow_tools.bench.bench_frames import main as bench_frames

    out = tmp_path / "frames.json"
    assert bench_frames(repeats=1, json_path=str(out)) == 0
    rows = json.loads(out.read_text())
    assert [row["frame"].split(",")[0] for row in rows] == ["ready", "registration", "heartbeat", "heartbeat"]
    assert all(0 < row["bytes"] <= 1 << 20 and row["best_ms"] > 0 for row in rows)
    assert "ns/byte" in capsys.readouterr().out
