"""`kvflow bench pd`'s report: the results contract, percentiles, the tables, the plots and the
`kvflow bench pd-report` command, on documents built here in the contract's shape (no scheduler
runs).  Plots are checked by what matplotlib drew (lines, bars, scales), and as PNG files."""

from __future__ import annotations

import copy
import io
import json
import math
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.lines import Line2D
from rich.console import Console

from kvflow.errors import ConfigError
from kvflow_tools.cli import main as cli_main
from kvflow_tools.pd import plots
from kvflow_tools.pd.contract import SCHEMA, percentiles, validate
from kvflow_tools.pd.report import load, markdown_table, render_table, write

SYSTEMS = ["kvflow", "kvflow-pull", "vllm-pull", "vllm-push", "vllm-push-0.33"]
QPS = [1.0, 4.0]
PNGS = ["ttft_vs_qps.png", "tpot_vs_qps.png", "ttft_cdf.png", "ttft_split.png", "blocks.png"]


def make_cell(system: str, qps: float, rng: random.Random, requests: int = 12) -> dict[str, Any]:
    """A cell whose statistics are computed from its own per-request records."""
    slow = 1.0 + SYSTEMS.index(system) * 0.5 if system in SYSTEMS else 3.0
    per_request: list[dict[str, Any]] = []
    for i in range(requests):
        parts = {
            "p_queue_ms": rng.uniform(0, 20) * qps,
            "prefill_ms": rng.uniform(50, 80),
            "transfer_wait_ms": rng.uniform(1, 10) * slow,
            "d_queue_ms": rng.uniform(0, 5) * qps,
        }
        ttft = sum(parts.values())
        tpot = rng.uniform(20, 30) * slow
        output = rng.randint(8, 64)
        per_request.append(
            {
                "id": f"{system}-{qps:g}-{i}",
                "prompt": rng.randint(100, 4000),
                "output": output,
                "arrival_s": i / qps,
                "ttft_ms": ttft,
                "tpot_ms": tpot,
                "e2e_ms": ttft + tpot * (output - 1),
                "ttft_from_p_ms": parts["p_queue_ms"] + parts["prefill_ms"],
                **parts,
            }
        )
    split = {
        k.removesuffix("_ms"): percentiles(r[k] for r in per_request)["mean"] for k in per_request[0] if "_ms" in k
    }
    times = [round(t * 0.5, 1) for t in range(10)]
    return {
        "system": system,
        "qps": qps,
        "requests": requests,
        "completed": requests,
        "failed": 0,
        "bad_pages": 0,
        "duration_s": requests / qps,
        "ttft_ms": percentiles(r["ttft_ms"] for r in per_request),
        "ttft_from_p_ms": percentiles(r["ttft_from_p_ms"] for r in per_request),
        "tpot_ms": percentiles(r["tpot_ms"] for r in per_request),
        "e2e_ms": percentiles(r["e2e_ms"] for r in per_request),
        "ttft_split_ms": {k: split[k] for k in ("p_queue", "prefill", "transfer_wait", "d_queue")},
        "blocks": {"p": [[t, rng.randint(0, 900)] for t in times], "d": [[t, rng.randint(0, 1800)] for t in times]},
        "blocks_peak": {"p": 900, "d": 1800},
        "admission_stall_s": {"p": 0.25, "d": 0.0},
        "over_budget_steps": {"p": 3, "d": 0},
        "steps": {"p": 120, "d": 800},
        "per_request": per_request,
    }


def make_results(systems: list[str] = SYSTEMS, qps: list[float] = QPS, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    dist = {"dist": "uniform", "min": 100, "max": 4000, "mean": 2050}
    return {
        "config": {
            "model": {
                "name": "Qwen3-32B",
                "layers": 64,
                "kv_heads": 8,
                "head_dim": 128,
                "dtype": "bfloat16",
                "block_size": 16,
                "kv_bytes_per_token": 262144,
                "emulated_bytes_per_token": 8192,  # 256 KiB / TP 2 / 16
                "scale": 16.0,
            },
            "gpu": {"name": "H200", "hbm_gb": 141, "bw_tb_s": 4.8, "tflops": 989, "tp": 2, "sources": ["spec sheet"]},
            "step_model": {
                "t_base_ms": 4.0,
                "eta_mem": 0.8,
                "mfu": 0.45,
                "budget_tokens": 8192,
                "sources": ["roofline", "published MFU"],
                "notes": "decode is memory-bound",
            },
            "capacity": {"p_blocks": 1000, "d_blocks": 2000, "tokens_per_block": 16, "real_tokens": 16000},
            "workload": {"qps": qps, "requests_per_point": 12, "prompt": dist, "output": dict(dist), "seed": seed},
            "systems": systems,
            "transport": "shm",
            "machine": "test box",
        },
        "cells": [make_cell(s, q, rng) for q in qps for s in systems],
    }


def xs(line: Line2D) -> list[float]:
    return [float(v) for v in np.asarray(line.get_xdata())]


def ys(line: Line2D) -> list[float]:
    return [float(v) for v in np.asarray(line.get_ydata())]


def cell_of(results: dict[str, Any], system: str, qps: float) -> dict[str, Any]:
    return next(c for c in results["cells"] if c["system"] == system and c["qps"] == qps)


# ---------------------------------------------------------------------- percentiles


def test_percentiles_by_hand() -> None:
    # 1..10: rank q*(n-1); p90 at 8.1 -> 9 + 0.1 * (10 - 9) = 9.1; p99 at 8.91 -> 9.91
    assert percentiles(range(1, 11)) == pytest.approx({"p50": 5.5, "p90": 9.1, "p99": 9.91, "mean": 5.5})
    assert percentiles([3, 1, 2]) == pytest.approx({"p50": 2.0, "p90": 2.8, "p99": 2.98, "mean": 2.0})
    assert percentiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0, "mean": 7.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}
    with pytest.raises(ConfigError, match="non-finite"):
        percentiles([1.0, math.nan])


@given(st.lists(st.floats(min_value=-1e9, max_value=1e9, allow_nan=False), min_size=1, max_size=200))
def test_percentiles_are_ordered_within_the_range_and_agree_with_numpy(values: list[float]) -> None:
    got = percentiles(values)
    p50, p90, p99, mean = (got[k] for k in ("p50", "p90", "p99", "mean"))
    assert p50 is not None and p90 is not None and p99 is not None and mean is not None
    tolerance = 1e-9 * max(1.0, max(abs(v) for v in values))
    assert min(values) - tolerance <= p50 <= p90 + tolerance and p90 <= p99 + tolerance
    assert p99 <= max(values) + tolerance and min(values) - tolerance <= mean <= max(values) + tolerance
    assert [p50, p90, p99] == pytest.approx(list(np.percentile(values, [50, 90, 99])), abs=tolerance)


# ---------------------------------------------------------------------- the contract


def leaf_paths(spec: object, prefix: list[str | int]) -> list[list[str | int]]:
    """Every key path of the schema, lists entered at their first item."""
    if isinstance(spec, dict):
        return [p for k, v in spec.items() for p in [[*prefix, k], *leaf_paths(v, [*prefix, k])]]
    if isinstance(spec, list):
        return leaf_paths(spec[0], [*prefix, 0])
    return []


def dotted(path: list[str | int]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


ALL_KEYS = leaf_paths(SCHEMA, [])


@pytest.mark.parametrize("path", ALL_KEYS, ids=dotted)
def test_load_names_every_missing_key(tmp_path: Path, path: list[str | int]) -> None:
    results = make_results()
    holder: Any = results
    for part in path[:-1]:
        holder = holder[part]
    del holder[path[-1]]
    (tmp_path / "results.json").write_text(json.dumps(results))
    with pytest.raises(ConfigError, match=f"missing key {re.escape(dotted(path))}$"):
        load(tmp_path)


def test_load_reads_back_what_write_wrote_and_refuses_bad_values(tmp_path: Path) -> None:
    results = make_results()
    write(results, tmp_path)
    assert load(tmp_path / "results.json") == load(tmp_path) == results
    bad = copy.deepcopy(results)
    bad["cells"][1]["ttft_ms"]["p90"] = "fast"
    with pytest.raises(ConfigError, match=r"cells\[1\]\.ttft_ms\.p90 must be a finite number or null, got 'fast'"):
        validate(bad)
    bad = copy.deepcopy(results)
    bad["cells"][0]["blocks"]["d"] = [[0.0, 1, 2]]
    with pytest.raises(ConfigError, match=r"cells\[0\]\.blocks\.d must be a list of \[t_s, value\] pairs"):
        validate(bad)
    bad = copy.deepcopy(results)
    bad["config"]["gpu"]["tp"] = True
    with pytest.raises(ConfigError, match=r"config\.gpu\.tp must be an integer"):
        validate(bad)
    with pytest.raises(ConfigError, match="cannot be written as JSON"):
        write({**results, "extra": math.nan}, tmp_path / "nan")
    assert not (tmp_path / "nan").exists()
    with pytest.raises(ConfigError, match=r"cells\[5\] repeats cells\[1\]: kvflow-pull at QPS 1"):
        validate({**results, "cells": [*results["cells"][:5], results["cells"][1]]})
    with pytest.raises(ConfigError, match="cells is empty"):
        validate({**results, "cells": []})
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="broken.json is not JSON"):
        load(tmp_path / "broken.json")
    with pytest.raises(ConfigError, match="cannot read results"):
        load(tmp_path / "absent")


def test_write_refuses_bad_results_and_writes_nothing(tmp_path: Path) -> None:
    results = make_results()
    del results["config"]["step_model"]["mfu"]
    with pytest.raises(ConfigError, match=r"missing key config\.step_model\.mfu"):
        write(results, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- plots


def test_write_makes_the_json_and_every_png(tmp_path: Path) -> None:
    folder = tmp_path / "made" / "here"
    paths = write(make_results(), folder)
    assert [p.name for p in paths] == ["results.json", *PNGS]
    for path in paths[1:]:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, path.name


def test_each_plot_draws_a_line_per_system_and_figure() -> None:
    results = make_results()
    n = len(SYSTEMS)
    for build in (plots.ttft_vs_qps, plots.tpot_vs_qps):
        (ax,) = build(results).axes
        lines = ax.get_lines()
        assert len(lines) == 2 * n  # p50 and p90 per system
        assert sorted(str(line.get_linestyle()) for line in lines) == ["-"] * n + ["--"] * n
        assert {line.get_color() for line in lines} == {plots.colour(results, s) for s in SYSTEMS}
        assert "Qwen3-32B" in ax.get_title() and "H200" in ax.get_title() and "TP 2" in ax.get_title()
        assert "(ms)" in ax.get_ylabel() and "requests/s" in ax.get_xlabel()
    (ax,) = plots.ttft_vs_qps(results).axes
    kvflow_p50 = next(line for line in ax.get_lines() if line.get_label() == "kvflow p50")
    assert ys(kvflow_p50) == [cell_of(results, "kvflow", q)["ttft_ms"]["p50"] for q in QPS]

    (ax,) = plots.ttft_cdf(results).axes
    assert len(ax.get_lines()) == n and "QPS 4" in ax.get_title()
    ours = next(line for line in ax.get_lines() if line.get_label() == "kvflow")
    assert sorted(xs(ours)) == sorted(r["ttft_ms"] for r in cell_of(results, "kvflow", 4.0)["per_request"])
    assert ys(ours)[-1] == 1.0

    (ax,) = plots.ttft_split(results).axes
    assert len(ax.containers) == 4 and all(len(bars) == n for bars in ax.containers)
    tops = [bar.get_y() + bar.get_height() for bar in ax.containers[-1]]
    split = [cell_of(results, s, 4.0)["ttft_split_ms"] for s in SYSTEMS]
    assert tops == pytest.approx([sum(s.values()) for s in split])

    top, bottom = plots.blocks(results).axes
    assert plots.system_lines(top) == n and plots.system_lines(bottom) == n
    assert "blocks used on P" in top.get_ylabel() and "(s)" in bottom.get_xlabel()


def test_plots_handle_a_missing_cell_an_unknown_system_and_a_wide_spread() -> None:
    results = make_results(systems=["kvflow", "vllm-pull", "sglang"])
    results["cells"] = [c for c in results["cells"] if (c["system"], c["qps"]) != ("vllm-pull", 4.0)]
    cell_of(results, "kvflow", 1.0)["ttft_ms"]["p90"] = None  # no sample
    cell_of(results, "sglang", 4.0)["ttft_ms"]["p90"] = 1e6  # a queue that ran away
    (ax,) = plots.ttft_vs_qps(results).axes
    labels = {str(line.get_label()): len(xs(line)) for line in ax.get_lines()}
    assert labels == {"kvflow p50": 2, "kvflow p90": 1, "vllm-pull p50": 1, "vllm-pull p90": 1, "sglang p50": 2,
                      "sglang p90": 2}  # fmt: skip
    assert ax.get_yscale() == "log"
    assert plots.colour(results, "sglang") not in plots.COLOURS.values()
    (ax,) = plots.tpot_vs_qps(results).axes
    assert ax.get_yscale() == "linear"  # 20..90 ms: no log scale
    (ax,) = plots.ttft_cdf(results).axes
    assert [line.get_label() for line in ax.get_lines()] == ["kvflow", "sglang"]  # none for vllm-pull at QPS 4
    (ax,) = plots.ttft_split(results).axes
    assert all(len(bars) == 2 for bars in ax.containers)


@settings(max_examples=15, deadline=None)
@given(
    keep=st.lists(st.booleans(), min_size=2 * len(SYSTEMS), max_size=2 * len(SYSTEMS)).filter(any),
    empty=st.lists(st.booleans(), min_size=2 * len(SYSTEMS), max_size=2 * len(SYSTEMS)),
)
def test_any_subset_of_cells_with_any_statistic_missing_still_renders(keep: list[bool], empty: list[bool]) -> None:
    """A run cut short, or a system whose requests all failed: every output still renders, with
    a line, a bar or a row only where there is a figure."""
    results = make_results()
    for c, gone in zip(results["cells"], empty, strict=True):
        if gone:
            c.update(completed=0, failed=c["requests"])
            for stats in ("ttft_ms", "tpot_ms", "e2e_ms", "ttft_split_ms"):
                c[stats] = dict.fromkeys(c[stats])
            for r in c["per_request"]:
                r.update(dict.fromkeys(k for k in r if k.endswith("_ms")))
    results["cells"] = [c for c, kept in zip(results["cells"], keep, strict=True) if kept]
    validate(results)
    text = render_table(results)
    assert all(c["system"] in text for c in results["cells"])
    assert markdown_table(results).count("\n| ") >= len(results["cells"])
    for build in plots.FIGURES.values():
        assert build(results).axes


# ---------------------------------------------------------------------- tables


def set_p50(results: dict[str, Any], system: str, qps: float, ttft: float, tpot: float) -> None:
    cell_of(results, system, qps)["ttft_ms"]["p50"] = ttft
    cell_of(results, system, qps)["tpot_ms"]["p50"] = tpot


def test_render_table_shows_every_system_the_header_and_ratios_by_hand() -> None:
    results = make_results()
    set_p50(results, "kvflow", 4.0, ttft=41.0, tpot=30.0)
    set_p50(results, "vllm-pull", 4.0, ttft=100.0, tpot=24.0)
    set_p50(results, "vllm-push", 4.0, ttft=82.0, tpot=60.0)
    set_p50(results, "vllm-push-0.33", 4.0, ttft=164.0, tpot=15.0)
    printed = io.StringIO()
    text = render_table(results, Console(file=printed, width=80, color_system=None))
    assert text == printed.getvalue()  # printed as laid out: no row wrapped on a narrow console
    for system in SYSTEMS:
        assert system in text
    for expected in (
        "Qwen3-32B",
        "64 layers",
        "H200",
        "TP 2",
        "KV bytes ÷16",
        "source: spec sheet",
        "source: roofline",
    ):
        assert expected in text
    assert "QPS 1" in text and "QPS 4" in text and "900/1800" in text and "0.25/0.00" in text
    assert "16,000 tokens" in text and "WARNING" not in text
    # 41 / 100 = 0.41, 41 / 82 = 0.50, 41 / 164 = 0.25; 30 / 24 = 1.25, 30 / 60 = 0.50, 30 / 15 = 2.00
    expected = "kvflow/vLLM at QPS 4: "
    expected += "TTFT p50 0.41× vllm-pull, 0.50× vllm-push, 0.25× vllm-push-0.33"
    expected += "; TPOT p50 1.25× vllm-pull, 0.50× vllm-push, 2.00× vllm-push-0.33"
    assert expected in text


def test_render_table_marks_missing_systems_and_ratios() -> None:
    results = make_results(systems=["kvflow", "vllm-pull", "sglang"])
    results["cells"] = [c for c in results["cells"] if (c["system"], c["qps"]) != ("vllm-pull", 4.0)]
    cell_of(results, "kvflow", 1.0)["tpot_ms"]["p50"] = None
    text = render_table(results)
    assert "sglang" in text
    missing = "— vllm-pull, — vllm-push, — vllm-push-0.33"
    assert f"QPS 4: TTFT p50 {missing}; TPOT p50 {missing}" in text
    assert "QPS 1: TTFT p50" in text and "TPOT p50 — vllm-pull" in text
    qps4 = text.split("QPS 4", 1)[1].split("kvflow/vLLM", 1)[0]
    (row,) = [line for line in qps4.splitlines() if "vllm-pull" in line]
    assert row.split()[1:4] == ["—", "—", "—"]  # no cell: its figures are dashes


def test_render_table_warns_of_failed_requests_and_wrong_pages() -> None:
    results = make_results()
    cell_of(results, "vllm-push", 4.0).update(failed=2, completed=10, bad_pages=3)
    text = render_table(results)
    assert "WARNING vllm-push at QPS 4: 2 of 12 requests failed, 3 pages arrived wrong" in text
    assert text.count("WARNING") == 1
    cell_of(results, "kvflow", 1.0)["bad_pages"] = 1  # every request done, one page wrong
    text = render_table(results)
    assert "WARNING kvflow at QPS 1: 0 of 12 requests failed, 1 pages arrived wrong" in text
    assert text.count("WARNING") == 2


def test_markdown_table_has_a_row_per_cell_and_the_ratios() -> None:
    results = make_results()
    set_p50(results, "kvflow", 1.0, ttft=41.0, tpot=30.0)
    set_p50(results, "vllm-pull", 1.0, ttft=100.0, tpot=24.0)
    text = markdown_table(results)
    main, ratios = text.strip().split("\n\n")
    rows = main.splitlines()
    assert len(rows) == 2 + len(SYSTEMS) * len(QPS)
    assert len({row.count("|") for row in rows}) == 1
    assert "| 1 | kvflow | 12/0 | 41.0 |" in main
    assert ratios.splitlines()[2].startswith("| 1 | 0.41× |") and "| 1.25× |" in ratios


# ---------------------------------------------------------------------- the command


def test_pd_report_command_rerenders_a_written_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(make_results(), tmp_path)
    for name in PNGS:
        (tmp_path / name).unlink()
    assert cli_main(["bench", "pd-report", str(tmp_path), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert all(s in out for s in SYSTEMS) and "| QPS | system |" in out and "kvflow/vLLM at QPS 4" in out
    assert all((tmp_path / name).read_bytes()[:4] == b"\x89PNG" for name in PNGS)
    broken = json.loads((tmp_path / "results.json").read_text())
    del broken["cells"][0]["per_request"][0]["ttft_ms"]
    (tmp_path / "results.json").write_text(json.dumps(broken))
    assert cli_main(["bench", "pd-report", str(tmp_path / "results.json")]) == 2
    assert r"missing key cells[0].per_request[0].ttft_ms" in capsys.readouterr().err
