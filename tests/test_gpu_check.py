"""The GPU check's CPU parts (`kvflow_tools.gpu`): its options, what results.json says whatever a
phase does (ends, fails, raises, waits on a child past its deadline, is cut short by a signal,
finds no budget left), UCX's protocol tables read out of a log, and (system) the whole dry run
on host memory through NIXL, as it is run before it goes to a GPU machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvflow_tools.errors import GpuChildFailed, GpuPhaseTimeout
from kvflow_tools.gpu.__main__ import parse_args
from kvflow_tools.gpu.phases import Phase, run_phases
from kvflow_tools.gpu.run import Proc, Run, child_argv, child_env, interrupt_on_signals
from kvflow_tools.gpu.ucx import is_ucx_table, ucx_summary, ucx_tables

ROOT = Path(__file__).resolve().parent.parent
Body = Callable[[float], dict[str, Any]]


def results(run: Run) -> dict[str, Any]:
    return dict(json.loads((run.out / "results.json").read_text()))


def entry(run: Run, key: str) -> dict[str, Any]:
    (found,) = [p for p in results(run)["phases"] if p["phase"] == key]
    return dict(found)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    run = Run(tmp_path / "out", "cpu", budget=120.0)
    yield run
    run.close()


# ---------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("phases", "message"),
    [
        ("ABX", "unknown phase 'X': the phases are A, B, E, G, V, I, C, D, F"),
        ("abed", "unknown phase 'a'"),
        ("ABB", "phase 'B' named twice"),
        ("", "no phase named"),
    ],
)
def test_a_bad_phases_option_is_refused_naming_the_letter(
    phases: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--device", "cpu", "--out", "x", "--phases", phases])
    assert exit_info.value.code == 2
    assert f"argument --phases: {message}" in capsys.readouterr().err


def test_phases_and_sizes_are_parsed_with_their_defaults() -> None:
    args = parse_args(["--device", "cuda", "--out", "x", "--phases", "BD", "--sizes", "1,16,256"])
    assert (args.phases, args.sizes, args.budget, args.limit_scale) == ("BD", [1, 16, 256], 320.0, 1.0)
    args = parse_args(["--device", "cpu", "--out", "x"])
    assert (args.phases, args.sizes, args.role) == ("ABEGVICDF", [1, 4, 16, 64, 256], "parent")


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--sizes", "1,x", "size 'x' is not a whole number of MiB"),
        ("--sizes", "1,,4", "size '' is not a whole number of MiB"),
        ("--sizes", "4,0", "size 0 MiB: sizes are positive"),
        ("--budget", "0", "0 is not above 0"),
        ("--limit-scale", "fast", "'fast' is not a number"),
    ],
)
def test_bad_sizes_and_times_are_refused(
    option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--device", "cpu", "--out", "x", option, value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_parent_needs_out_and_a_child_does_not(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--device", "cpu"])
    assert exit_info.value.code == 2
    assert "--out is required" in capsys.readouterr().err
    assert parse_args(["--device", "cpu", "--role", "env"]).out is None


def test_children_run_the_module_with_the_checkout_in_front_of_the_pythonpath(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/tmp/site", str(ROOT / "tools")]))
    first, second = child_env({"UCX_PROTO_INFO": "y"}), child_env()
    assert first["PYTHONPATH"].split(os.pathsep) == [str(ROOT), str(ROOT / "tools"), "/tmp/site"]
    assert first["UCX_PROTO_INFO"] == "y" and "UCX_PROTO_INFO" not in second
    assert len(first["KVFLOW_SECRET"]) == 64 and first["KVFLOW_SECRET"] != second["KVFLOW_SECRET"]
    assert child_argv("env", "cpu")[:5] == [sys.executable, "-m", "kvflow_tools.gpu", "--role", "env"]


# ---------------------------------------------------------------------- results.json


def test_each_phases_end_is_its_status_in_results_json(run: Run) -> None:
    seen_while_running: list[dict[str, str]] = []

    def ok(deadline: float) -> dict[str, Any]:
        seen_while_running.append(dict(results(run)["summary"]))
        return {"status": "ok", "detail": 1}

    def raises(deadline: float) -> dict[str, Any]:
        run.partial["transfers"] = ["first"]
        raise ValueError("a bad reply")

    def times_out(deadline: float) -> dict[str, Any]:
        run.partial["rows"] = [1]
        raise GpuPhaseTimeout("decode-0: no 'result' in time")

    phases = [
        Phase("A", "fine", 60, ok),
        Phase("B", "raises", 60, raises),
        Phase("E", "waits too long", 60, times_out),
        Phase("D", "fails", 60, lambda deadline: {"status": "fail"}),
    ]
    assert run_phases(run, phases) == 1
    assert seen_while_running == [{"A": "running"}]
    assert results(run)["summary"] == {"A": "ok", "B": "error", "E": "timeout", "D": "fail"}
    assert entry(run, "A")["detail"] == 1
    b = entry(run, "B")
    assert b["error"] == "ValueError: a bad reply" and "a bad reply" in b["trace"] and b["transfers"] == ["first"]
    assert entry(run, "E")["error"] == "decode-0: no 'result' in time" and entry(run, "E")["rows"] == [1]
    assert run_phases(run, [Phase("F", "informative", 60, lambda deadline: {"status": "info: fail"})]) == 1


def test_phases_that_pass_or_are_skipped_exit_0(run: Run) -> None:
    phases = [
        Phase("A", "fine", 60, lambda deadline: {"status": "ok"}),
        Phase("C", "cuda only", 60, lambda deadline: {"status": "skipped", "why": "needs CUDA"}),
        Phase("F", "informative", 60, lambda deadline: {"status": "info: error"}),
    ]
    assert run_phases(run, phases) == 0
    assert results(run)["summary"] == {"A": "ok", "C": "skipped", "F": "info: error"}
    assert "summary: " in (run.out / "run.log").read_text()


def silent_child(run: Run, code: str, deadline: float) -> dict[str, Any]:
    """A phase whose child runs `code` and never answers "ready"."""
    proc = Proc(run, "decode-0", [sys.executable, "-c", code], child_env(), "T")
    try:
        proc.wait("ready", None, min(deadline, time.monotonic() + 1.0))
    finally:
        proc.close()
    raise AssertionError("unreachable: the wait cannot succeed")


def test_a_child_that_never_answers_times_the_phase_out_and_is_closed(run: Run) -> None:
    code = "import sys; sys.stderr.write('waiting\\n'); sys.stderr.flush(); sys.stdin.readline()"
    t = time.monotonic()
    assert run_phases(run, [Phase("B", "silent", 60, lambda dl: silent_child(run, code, dl))]) == 1
    assert time.monotonic() - t < 10  # closed politely: it read "close" and ended
    assert results(run)["summary"] == {"B": "timeout"}
    assert entry(run, "B")["error"] == "decode-0: no 'ready' in time"
    assert "=== T decode-0 (rc 0) stderr ===\nwaiting" in (run.out / "children.log").read_text()


def test_a_child_that_exits_is_an_error_naming_its_status_and_stderr(run: Run) -> None:
    code = "import sys; sys.stderr.write('no module named nixl\\n'); sys.exit(3)"
    with pytest.raises(GpuChildFailed, match=r"decode-0 exited \(rc 3\) waiting for 'ready': no module named nixl"):
        silent_child(run, code, time.monotonic() + 30)
    assert run_phases(run, [Phase("B", "exits", 60, lambda dl: silent_child(run, code, dl))]) == 1
    assert results(run)["summary"] == {"B": "error"}
    assert entry(run, "B")["error"].startswith("GpuChildFailed: decode-0 exited (rc 3)")


def test_a_signal_cuts_the_run_short_as_interrupted_keeping_what_the_phase_had(run: Run) -> None:
    ran: list[str] = []

    def killed(deadline: float) -> dict[str, Any]:
        run.partial["transfers"] = ["first"]
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises in here
        return {"status": "ok"}

    def never(deadline: float) -> dict[str, Any]:
        ran.append("D")
        return {"status": "ok"}

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        interrupt_on_signals(run)
        phases = [Phase("A", "fine", 60, lambda dl: {"status": "ok"}), Phase("B", "killed", 60, killed)]
        try:
            status = run_phases(run, [*phases, Phase("D", "after", 60, never)])
        except KeyboardInterrupt:  # not pytest's to see: it would stop the whole test run
            pytest.fail("the interrupt escaped run_phases")
        assert status == 2
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])
    assert ran == [] and run.stopping  # children are killed from now on, not closed politely
    assert results(run)["summary"] == {"A": "ok", "B": "interrupted"}
    b = entry(run, "B")
    assert b["error"] == "SIGTERM (the run's time limit?)" and b["transfers"] == ["first"]


def test_limits_are_scaled_capped_by_the_budget_and_a_phase_without_time_is_skipped(tmp_path: Path) -> None:
    deadlines: list[float] = []

    def note(deadline: float) -> dict[str, Any]:
        deadlines.append(deadline - time.monotonic())
        return {"status": "ok"}

    run = Run(tmp_path, "cpu", budget=40.0)
    try:
        assert run_phases(run, [Phase("A", "scaled", 60, note), Phase("B", "capped", 100, note)], 0.5) == 0
        assert 29 < deadlines[0] <= 30 and 39 < deadlines[1] <= 40
        run.deadline = time.monotonic() + 4
        assert run_phases(run, [Phase("E", "too late", 60, note)]) == 0
        assert len(deadlines) == 2
        assert entry(run, "E") == {
            "phase": "E",
            "title": "too late",
            "status": "skipped",
            "why": "no time left in the budget",
        }
    finally:
        run.close()


# ---------------------------------------------------------------------- UCX's tables

# UCX_PROTO_INFO=y as a GPU child writes it: two threads' tables interleaved, a table printed
# twice, NIXL's own lines between them
UCX_LOG = """\
2026-12-05 08:14:43 NIXL INFO    _api.py:281 Initialized NIXL agent: prefill-0
[1796458483.480023] [gpu:4828 :0]   +--------+-------------+-------------------------------+
[1796458483.480023] [gpu:4828 :0]   | prefill-0 intra-node cfg#1                            |
[1796458483.480023] [gpu:4828 :1]   +--------+-------------+-------------------------------+
[1796458483.480023] [gpu:4828 :1]   | prefill-0 intra-node cfg#2                            |
[1796458483.480023] [gpu:4828 :0]   | remote memory write by ucp_put* from cuda/GPU0 to cuda |
[1796458483.480023] [gpu:4828 :1]   | active message by ucp_am_send* from host memory       |
[1796458483.480023] [gpu:4828 :0]   +--------+-------------+-------------------------------+
[1796458483.480023] [gpu:4828 :0]   | Range  | Description |              Config           |
[1796458483.480023] [gpu:4828 :0]   | 0..inf | zero-copy   | cuda_ipc/cuda                 |
[1796458483.480023] [gpu:4828 :1]   |      0 | short       | tcp/lo                        |
[1796458483.480023] [gpu:4828 :1]   | 1..inf | zero-copy   | tcp/lo                        |
[1796458483.480023] [gpu:4828 :0]   +--------+-------------+-------------------------------+
[1796458484.100000] [gpu:4828 :0]   | prefill-0 intra-node cfg#1                            |
[1796458484.100000] [gpu:4828 :0]   | remote memory write by ucp_put* from cuda/GPU0 to cuda |
[1796458484.100000] [gpu:4828 :0]   | 0..inf | zero-copy   | cuda_ipc/cuda                 |
[1796458484.200000] [gpu:4828 :0]   | prefill-0 intra-node cfg#1                                  |
[1796458484.200000] [gpu:4828 :0]   | remote memory read by ucp_get* into cuda/GPU0 from cuda     |
[1796458484.200000] [gpu:4828 :0]   |  0..8191 | copy-out    | rc_mlx5/mlx5_0:1                  |
[1796458484.200000] [gpu:4828 :0]   | 8192..inf | zero-copy   | cuda_ipc/cuda                    |
2026-12-05 08:14:44 NIXL WARN    transfer done
"""


def test_ucx_tables_are_read_per_thread_with_their_rows() -> None:
    tables = ucx_tables(UCX_LOG.splitlines())
    assert [(t["context"], t["operation"]) for t in tables] == [
        ("prefill-0 intra-node cfg#1", "remote memory write by ucp_put* from cuda/GPU0 to cuda"),
        ("prefill-0 intra-node cfg#2", "active message by ucp_am_send* from host memory"),
        ("prefill-0 intra-node cfg#1", "remote memory write by ucp_put* from cuda/GPU0 to cuda"),
        ("prefill-0 intra-node cfg#1", "remote memory read by ucp_get* into cuda/GPU0 from cuda"),
    ]
    assert tables[0]["rows"] == [["0..inf", "zero-copy", "cuda_ipc/cuda"]]
    assert tables[1]["rows"] == [["0", "short", "tcp/lo"], ["1..inf", "zero-copy", "tcp/lo"]]
    assert tables[3]["rows"] == [
        ["0..8191", "copy-out", "rc_mlx5/mlx5_0:1"],
        ["8192..inf", "zero-copy", "cuda_ipc/cuda"],
    ]


def test_the_ucx_summary_keeps_each_remote_memory_table_once_and_counts_lanes() -> None:
    summary = ucx_summary(UCX_LOG.splitlines())
    assert summary["remote_memory"] == [
        "prefill-0 intra-node cfg#1: remote memory write by ucp_put* from cuda/GPU0 to cuda: "
        "0..inf zero-copy cuda_ipc/cuda",
        "prefill-0 intra-node cfg#1: remote memory read by ucp_get* into cuda/GPU0 from cuda: "
        "0..8191 copy-out rc_mlx5/mlx5_0:1; 8192..inf zero-copy cuda_ipc/cuda",
    ]
    assert summary["lanes"] == {"cuda_ipc/cuda": 3, "tcp/lo": 2, "rc_mlx5/mlx5_0:1": 1}
    assert ucx_summary(["no table here", "[1.0] [h:1 :0]   plain UCX warning"]) == {"remote_memory": [], "lanes": {}}


def test_children_log_leaves_out_ucx_table_lines_only() -> None:
    kept = [ln for ln in UCX_LOG.splitlines() if not is_ucx_table(ln)]
    assert kept == [UCX_LOG.splitlines()[0], UCX_LOG.splitlines()[-1]]
    assert not is_ucx_table("[1796458483.480023] [gpu:4828 :0]   UCX  WARN  cuda_ipc is disabled")


# ---------------------------------------------------------------------- the dry run


@pytest.mark.system
def test_the_cpu_dry_run_moves_byte_exact_blocks_and_measures_each_size(tmp_path: Path) -> None:
    """What `scripts/gpu-check dry-run` runs, as it is run before the check goes to a GPU machine."""
    out = tmp_path / "tmp"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check"), "dry-run", "--sizes", "1,4", "--phases", "ABEGVID"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["summary"] == {"A": "ok", "B": "ok", "E": "ok", "G": "ok", "V": "skipped", "I": "ok", "D": "ok"}
    phases = {p["phase"]: p for p in doc["phases"]}
    assert "driver-mapped memory" in phases["V"]["why"]  # a GPU run's alone
    assert phases["A"]["details"]["kvflow"] == str(ROOT / "kvflow" / "__init__.py")
    transfers = phases["B"]["transfers"]
    assert [t["mode"] for t in transfers] == ["push", "push", "push", "pull"]
    assert all(t["digest_equal"] and t["d_outside_nonzero_bytes"] == 0 for t in transfers)
    assert phases["B"]["memory"] == {"p": ["DRAM"] * 4, "d": ["DRAM"] * 4}
    assert phases["E"]["ucx"]["p"]["remote_memory"]  # UCX's tables were found and read
    # G: P's engine in an engine process over the memory its owner shared (4 layers' runs)
    assert all(t["digest_equal"] and t["d_outside_nonzero_bytes"] == 0 for t in phases["G"]["transfers"])
    assert len(phases["G"]["transfers"]) == 4 and phases["G"]["p_shared"] >= 1
    # I: the integrity check passes the clean blocks and names the one with a flipped bit
    assert phases["I"]["clean"] is None and "block 63" in phases["I"]["flipped"]
    csv = (out / "bandwidth.csv").read_text().splitlines()
    assert [row.split(",")[:4] for row in csv[1:]] == [["1", "1048576", "8", "7/7"], ["4", "4194304", "32", "7/7"]]
    header = csv[0].split(",")
    raw = [dict(zip(header, row.split(","), strict=True)) for row in csv[1:]]
    assert [r["raw_verified"] for r in raw] == ["7/7", "7/7"]  # the bare NIXL baseline moved the same bytes
    assert all(float(r["kvflow_over_raw"]) > 0 for r in raw)
    assert "== phase D: ok" in (out / "run.log").read_text()
    assert "=== phase E: d stderr with UCX_PROTO_INFO=y ===" in (out / "ucx.log").read_text()


BARE = """
import sys
for name in ("pytest_asyncio", "vllm", "nixl", "nixl_cu13", "nixl_cu12"):
    sys.modules[name] = None  # not installed, as on the GPU machine's image
import pytest
sys.exit(pytest.main(["-c", "/dev/null", "--rootdir", ".", "-p", "no:cacheprovider", "-rs", "-q",
                      "tests/test_nixl_hardware.py"]))
"""


def test_the_hardware_tests_load_and_skip_naming_what_is_missing_where_little_is_installed() -> None:
    """As `scripts/gpu-check run` runs them on the GPU machine: no pytest-asyncio, no vLLM, no
    NIXL, none of the project's pytest settings; every test skips with its reason, none errors."""
    env = {
        **os.environ,
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tools")]),
    }
    done = subprocess.run([sys.executable, "-c", BARE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "5 skipped" in done.stdout and "error" not in done.stdout.lower(), done.stdout
    assert "needs a CUDA GPU" in done.stdout and "needs AWS EFA" in done.stdout
