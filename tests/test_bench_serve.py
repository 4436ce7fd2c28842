"""`kvflow bench serve`'s pure parts: the phases, a turn's figures, the client's parsing, the report.

Why without servers: a real pair costs minutes and gigabytes; what the benchmark computes from
what it measured (percentiles, failures, KV bytes, CPU in cores, tables, plots) and how it
plans which pairs are alive together are checked here on hand-made data in milliseconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from kvflow.errors import ConfigError
from kvflow_tools.errors import BenchError
from kvflow_tools.pd.workload import Arrival
from kvflow_tools.routing.backends import Backend
from kvflow_tools.routing.legs import nixl_push_decode_body
from kvflow_tools.serve import bench_serve, serve_report
from kvflow_tools.serve.bench_serve import MODEL, add_arguments, kv_bytes_per_token, main, plan_phases, rotated
from kvflow_tools.serve.client import Result, deltas, group_usage, metric_sum, prompt_ids
from kvflow_tools.serve.launcher import place


def test_all_pairs_together_when_they_fit_else_kvflow_beside_each_other_in_turn() -> None:
    assert plan_phases(["kvflow", "nixl", "nixl-push"], 3) == [["kvflow", "nixl", "nixl-push"]]
    assert plan_phases(["kvflow", "nixl", "nixl-push"], 2) == [["kvflow", "nixl"], ["kvflow", "nixl-push"]]
    with pytest.raises(ConfigError):
        plan_phases(["kvflow", "nixl"], 1)
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_the_model_holds_32_kib_of_float32_kv_a_token() -> None:
    assert MODEL.head_dim == 32
    assert kv_bytes_per_token() == 2 * 32 * 4 * 32 * 4


def test_a_request_fails_on_an_error_or_too_few_tokens_and_then_has_no_latency() -> None:
    good = Result("a", 100, 5, 0.5, ttft_ms=10.0, e2e_ms=50.0, tokens=5)
    assert not good.failed and good.tpot_ms == pytest.approx(10.0)
    short = Result("b", 100, 5, 0.5, ttft_ms=10.0, e2e_ms=50.0, tokens=3)
    assert short.failed and short.tpot_ms is None and short.row()["ttft_ms"] is None
    assert Result("c", 1, 1, 0.0, error="HTTP 502").failed


def test_prompts_are_repeatable_and_differ_between_systems() -> None:
    arrival = Arrival("q1-0", 0.1, 64, 4)
    assert prompt_ids(arrival, "kvflow/1") == prompt_ids(arrival, "kvflow/1")
    assert prompt_ids(arrival, "kvflow/1")[:16] != prompt_ids(arrival, "kvflow-pull/1")[:16]
    assert len(prompt_ids(arrival, "x")) == 64 and all(0 < t < 1000 for t in prompt_ids(arrival, "x"))


def test_a_second_run_sends_prompts_no_prefix_cache_holds_from_the_first() -> None:
    arrival = Arrival("q1-0", 0.1, 64, 4)
    first, second = (prompt_ids(arrival, bench_serve.run_salt("kvflow", 1, run)) for run in (1, 2))
    assert first[:16] != second[:16]  # the first block differs, so no block of the second run is cached


def test_metric_sum_adds_the_samples_whose_labels_match() -> None:
    text = "\n".join(
        [
            "# HELP vllm:prompt_tokens_by_source_total tokens",
            'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 1104.0',
            'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 7.0',
            'vllm:prompt_tokens_by_source_total{engine="1",source="external_kv_transfer"} 6.0',
            'vllm:nixl_bytes_transferred_sum{engine="0",model_name="tiny"} 3.7748736e+07',
            'vllm:nixl_bytes_transferred_count{engine="0",model_name="tiny"} 2.0',
        ]
    )
    name = "vllm:prompt_tokens_by_source_total"
    assert metric_sum(text, name, {"source": "external_kv_transfer"}) == 1110.0
    assert metric_sum(text, "vllm:nixl_bytes_transferred_sum") == 37748736.0
    assert metric_sum(text, "vllm:kvflow_bytes_transferred_sum") == 0.0
    assert deltas({"a": 1.0}, {"a": 3.0, "b": 2.0}, ["a", "b"]) == {"a": 2.0, "b": 2.0}


def test_group_usage_sums_cpu_and_memory_of_its_group_only(tmp_path: Path) -> None:
    import os

    ticks, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")

    def stat(pid: int, pgrp: int, utime: int, stime: int, rss: int) -> str:
        after = ["S", "1", str(pgrp), *["0"] * 8, str(utime), str(stime), *["0"] * 8, str(rss)]
        return f"{pid} (VLLM::Worker (x)) " + " ".join(after) + " 0 0\n"

    for pid, pgrp, u, s, rss in ((10, 7, ticks, ticks, 100), (11, 7, ticks, 0, 50), (12, 9, 99 * ticks, 0, 1)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(stat(pid, pgrp, u, s, rss))
    (tmp_path / "self").mkdir()
    cpu, rss = group_usage(7, tmp_path)
    assert cpu == pytest.approx(3.0) and rss == 150 * page


def _cell(system: str, phase: int, qps: float, failed: int = 0) -> dict[str, Any]:
    rows = [Result(f"r{i}", 1000, 11, i * 0.5, ttft_ms=100.0 + i, e2e_ms=300.0 + i, tokens=11).row() for i in range(10)]
    rows += [Result(f"f{i}", 1000, 11, 9.0, error="HTTP 502: prefill").row() for i in range(failed)]
    counters = {"external_tokens": 9984.0, "local_tokens": 16.0, "p_nixl_bytes": 9984.0 * 32768, "d_kvflow_bytes": 0.0}
    cpu = {
        "p": {"idle_s": 2.0, "idle_cpu_s": 1.0, "load_s": 10.0, "load_cpu_s": 8.0},
        "d": {"idle_s": 2.0, "idle_cpu_s": 0.02, "load_s": 10.0, "load_cpu_s": 5.0},
    }
    return serve_report.summarise(system, phase, qps, rows, 10.0, counters, cpu, 32768)


def test_a_cell_has_percentiles_failures_kv_bytes_and_cpu_in_cores() -> None:
    cell = _cell("vllm-pull", 1, 2.0, failed=2)
    assert (cell["requests"], cell["completed"], cell["failed"]) == (12, 10, 2)
    assert cell["errors"] == ["HTTP 502: prefill"]
    assert cell["ttft_ms"]["p50"] == pytest.approx(104.5) and cell["ttft_ms"]["p90"] == pytest.approx(108.1)
    assert cell["tpot_ms"]["p50"] == pytest.approx(20.0)
    assert cell["kv"]["bytes_by_tokens"] == 9984 * 32768
    assert cell["kv"]["connector_bytes"] == {"p_nixl_bytes": 9984 * 32768, "d_kvflow_bytes": 0}
    assert cell["cpu_cores"] == {"idle": {"p": 0.5, "d": 0.01}, "load": {"p": 0.8, "d": 0.5}}
    assert cell["output_tokens_per_s"] == 11.0 and cell["cpu_ms_per_request"] == pytest.approx(1083.33)


def _results() -> dict[str, Any]:
    cells = [_cell("vllm-pull", 1, 1.0, failed=1), _cell("kvflow", 1, 1.0), _cell("kvflow", 2, 1.0)]
    model = {"num_layers": 32, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 4, "head_dim": 32,
             "dtype": "float32", "kv_bytes_per_token": 32768, "kv_mib_per_request": 20.0}  # fmt: skip
    dist = {"dist": "uniform", "min": 256, "max": 1024, "mean": 640.0}
    workload = {"qps": [1.0], "requests_per_point": 10, "prompt": dist, "output": dist, "seed": 1}
    config = {"model": model, "workload": workload, "order": "interleaved", "machine": "test",
              "load_before": "1.00", "load_after": "2.00", "left_out": {}}  # fmt: skip
    return {"config": config, "cells": serve_report.order(cells)}


def test_the_table_orders_by_phase_and_system_and_warns_of_failures() -> None:
    text = serve_report.render_table(_results())
    assert "vLLM's NIXL progress threads: stock, polling without pause" in text
    slowed = _results()
    slowed["config"]["nixl_progress_delay_us"] = 1000
    assert "vLLM's NIXL progress threads: sleeping 1000 µs between polls" in serve_report.render_table(slowed)
    assert "32 KiB/token" in text and "phase 1, run 1, 1 req/s" in text and "phase 2, run 1, 1 req/s" in text
    phase1 = text.split("phase 1, run 1, 1 req/s")[1].split("phase 2")[0]
    assert phase1.index("kvflow") < phase1.index("vllm-pull")
    assert "WARNING vllm-pull: 1 of 11 failed" in text
    markdown = serve_report.markdown_table(_results())
    assert markdown.count("\n") == 2 + 3 and "| 1 | 1 | 1 | vllm-pull | 10/1 |" in markdown


def test_results_and_plots_are_written(tmp_path: Path) -> None:
    paths = serve_report.write(_results(), tmp_path / "out")
    assert [p.name for p in paths] == [
        "results.json",
        "ttft_vs_qps.png",
        "tpot_vs_qps.png",
        "e2e_vs_qps.png",
        "cpu.png",
    ]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_nixl_push_decode_leg_names_p_and_its_side_channel() -> None:
    prefill = Backend("http://127.0.0.1:8100", "prefill-0", "tcp://127.0.0.1:5600")
    body = nixl_push_decode_body({"prompt": [1, 2], "max_tokens": 4}, prefill, "cmpl-kvflow-abc")
    assert body["max_tokens"] == 4
    assert body["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": "cmpl-kvflow-abc",
    }


def test_no_prefill_server_shares_a_cpu_with_a_decode_server_when_there_are_two() -> None:
    # prefill-0 beside decode-0 on one CPU starved each other's steps (first transfers 20-40 s)
    names = ["prefill-0", "prefill-1", "decode-0", "reference"]
    assert place(names, [0, 1]) == [0, 0, 1, 1]
    assert place(names, [0, 1, 2, 3]) == [0, 1, 2, 3]
    assert place(["prefill-0", "decode-0", "decode-1"], [4, 5, 6]) == [4, 6, 6]
    assert place(names, [3]) == [3, 3, 3, 3]  # one CPU: nothing else to do
    with pytest.raises(ConfigError, match="no CPU"):
        place(names, [])


@pytest.mark.parametrize("delay", ["-2", "1000001"])
def test_a_bad_progress_delay_is_refused_before_anything_is_written(
    tmp_path: Path, delay: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    results = tmp_path / "results"
    args = parser.parse_args(["--quick", "--results", str(results), "--nixl-progress-delay-us", delay])
    assert main(args) == 2
    assert f"nixl_progress_delay_us must be a whole number of µs in 0..1000000, not {delay}" in capsys.readouterr().err
    assert not results.exists()


def test_the_spread_gives_each_run_s_ttft_and_kvflow_s_ratio_run_by_run() -> None:
    results = _results()
    slower = _cell("kvflow", 1, 1.0) | {"repeat": 2}
    slower["ttft_ms"] = slower["ttft_ms"] | {"p50": 209.0}
    results["cells"] = serve_report.order([*results["cells"], slower, _cell("vllm-pull", 1, 1.0) | {"repeat": 2}])
    lines = serve_report.spread_lines(results["cells"])
    assert lines[0] == (
        "TTFT p50 by run, phase 1, 1 req/s: kvflow 104.5 / 209.0; vllm-pull 104.5 / 104.5; "
        "kvflow/vllm-pull 1.00x / 2.00x"
    )
    assert lines[1] == "TTFT p50 by run, phase 2, 1 req/s: kvflow 104.5"
    text = serve_report.render_table(results)
    assert "phase 1, run 2, 1 req/s" in text and lines[0] in text


class FakePairs:
    """Pairs that start nothing: the vllm-push pair's warm-up fails, as it did on the CPU build."""

    def __init__(self, folder: Path, *_: object) -> None:
        self.folder, self.stopped = folder, 0
        self.kept: list[tuple[list[str], int | None]] = []
        self.rss_gib: dict[str, float] = {}
        FakePairs.last = self

    last: FakePairs

    def keep(self, connectors: list[str], systems: list[str], say: object) -> None:
        written = self.folder / serve_report.RESULTS_FILE
        cells = len(json.loads(written.read_text())["cells"]) if written.exists() else None
        self.kept.append((list(connectors), cells))
        if "nixl-push" in connectors:
            raise BenchError("nixl-push (nixl-push): warm-up request failed: no complete answer within 300 s")

    def stop(self) -> None:
        self.stopped += 1


def test_a_phase_that_fails_loses_nothing_else_and_each_phase_is_written_before_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    turns: list[tuple[str, int, float]] = []
    runs: list[int] = []

    def fake_turn(pairs: object, system: str, phase: int, qps: float, *rest: object) -> dict[str, Any]:
        turns.append((system, phase, qps))
        runs.append(int(rest[-1]))  # type: ignore[call-overload]
        return _cell(system, phase, qps)

    monkeypatch.setattr(bench_serve, "Pairs", FakePairs)
    monkeypatch.setattr(bench_serve, "turn", fake_turn)
    monkeypatch.setattr(bench_serve, "write_model", lambda folder, model: folder)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    folder = tmp_path / "results"
    args = parser.parse_args(["--quick", "--results", str(folder), "--systems", "kvflow,vllm-push,vllm-pull",
                              "--max-engines", "4", "--requests", "3"])  # fmt: skip
    assert main(args) == 2  # a phase failed: said, and the others' figures kept
    pairs = FakePairs.last
    # kvflow beside vllm-push, then beside vllm-pull; phase 1's failure was written before phase 2 began
    assert pairs.kept == [(["kvflow", "nixl-push"], None), (["kvflow", "nixl"], 0)]
    order = ["kvflow", "vllm-pull", "vllm-pull", "kvflow", "vllm-pull", "kvflow", "kvflow", "vllm-pull"]
    assert [t[:2] for t in turns] == [(s, 2) for s in order]
    # runs rotate the first system at a rate: run 1 at 1 req/s starts with kvflow, run 2 with vllm-pull
    assert turns[0] == ("kvflow", 2, 1.0) and turns[4] == ("vllm-pull", 2, 1.0)
    assert runs == [1, 1, 1, 1, 2, 2, 2, 2]  # each turn knows its run, which salts its prompts
    written = json.loads((folder / serve_report.RESULTS_FILE).read_text())
    assert written["config"]["complete"] is True and written["config"]["repeats"] == 2
    assert written["config"]["nixl_progress_delay_us"] == 1000  # fair to vLLM unless asked otherwise
    assert [f["phase"] for f in written["config"]["failed_phases"]] == [1]
    assert len(written["cells"]) == 8 and {c["repeat"] for c in written["cells"]} == {1, 2}
    out, err = capsys.readouterr()
    assert "phase 1 (kvflow, vllm-push) failed: nixl-push (nixl-push): warm-up request failed" in err
    assert "FAILED phase 1 (kvflow, vllm-push)" in out and "kvflow/vllm-pull" in out
    assert pairs.stopped >= 2  # the failed phase's pairs, and everything at the end
