"""`kvflow doctor`, `kvflow bench nixl` and `kvflow soak --fuzz` run, and say what they should."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow_tools.cli import main
from kvflow_tools.doctor import diagnose, render


def test_doctor_finds_ucx_moving_host_memory() -> None:
    report = diagnose()
    ucx = next(b for b in report.backends if b.name == "UCX")
    assert ucx.loads and "DRAM" in ucx.memory_types and ucx.dram.startswith("ok")
    libfabric = next(b for b in report.backends if b.name == "LIBFABRIC")
    if not libfabric.loads:
        assert "libfabric" in libfabric.note
    text = render(report)
    assert "UCX" in text and "Neuron" in text and "CUDA GPUs" in text


def test_bench_nixl_quick_runs_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "nixl", "--quick", "--repeats", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "raw NIXL, new handle" in printed and "kvflow NIXL" in printed and "numpy memcpy" in printed
    assert "coalescing" in printed
    rows = json.loads(out.read_text())
    assert {r["variant"] for r in rows} >= {"numpy memcpy", "raw NIXL, new handle", "kvflow NIXL", "kvflow, coalesced"}
    assert all(r["gbps"] > 0 for r in rows)


def test_console_script_is_installed() -> None:
    kvflow = Path(sys.executable).parent / "kvflow"
    result = subprocess.run([str(kvflow), "doctor"], capture_output=True, text=True, timeout=120, check=True)
    assert "UCX" in result.stdout


@pytest.mark.system
def test_soak_fuzz_also_sends_hostile_kv_transfer_params_and_reports_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvflow_tools.bench.soak as soak

    ran: list[object] = []

    def transfers_soak(config: object, json_path: str | None, quiet: bool) -> int:  # tested apart
        ran.append(config)
        return 0

    monkeypatch.setattr(soak, "main", transfers_soak)
    out = tmp_path / "soak.json"
    assert (
        main(["soak", "--transfers", "1", "--fuzz", "--fuzz-scale", "3", "--ttl", "8", "--json", str(out), "--quiet"])
        == 0
    )
    assert len(ran) == 1
    line = next(text for text in capsys.readouterr().out.splitlines() if text.startswith("kv_transfer_params fuzz: "))
    printed = json.loads(line.removeprefix("kv_transfer_params fuzz: "))
    assert (
        printed["ok"]
        and printed["hostile"] > 1000
        and printed == json.loads((tmp_path / "soak-params.json").read_text())
    )
    routers = json.loads((tmp_path / "soak-router.json").read_text())
    assert [r["mode"] for r in routers] == ["push", "pull", "sequential", "nixl-push"]
    for r in routers:  # 3 hostile, 3 benign, a genuine one among each: every leg seen, none with the client's
        assert r["ok"] and r["statuses"] == {"200": 3} and r["legs"] == 2 * (3 + 3 + 2) and r["carried"] == 0
