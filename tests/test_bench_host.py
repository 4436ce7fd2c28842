"""`kvflow bench host`: the host-work model in the stand-in, the split of a step's waits, the
figures against the baseline, and a small run of the command (real engines, real transfers).

No timing is asserted: the run checks that every figure is there and that the transfers moved.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvflow.errors import ConfigError
from kvflow_tools.bench.bench_host import HostOptions, Window, _relative, _summary, calibrate
from kvflow_tools.cli import main as cli
from kvflow_tools.standin.pacing import HostLoad, burn, thread_times
from tests.vllm_pairs import dispatch, make_pair, settle


def test_burn_holds_the_interpreter_and_calibrates_to_milliseconds() -> None:
    iterations = calibrate(2.0)
    started = time.perf_counter()
    burn(iterations)
    assert iterations > 0 and time.perf_counter() - started > 0
    assert calibrate(0.0) == 0


def test_time_a_thread_spends_blocked_shows_as_neither_cpu_nor_core_wait() -> None:
    """A thread blocked (on the GIL, or here on a lock another thread holds for 0.2 s) is
    neither running nor runnable: the wall time it loses is what the step's split calls a GIL
    wait (wall - CPU - core wait), however busy the machine is."""
    held = threading.Lock()
    held.acquire()
    threading.Timer(0.2, held.release).start()
    before = thread_times()
    held.acquire()  # blocked until the timer releases it
    after = thread_times()
    cpu, queued, wall = (b - a for a, b in zip(before, after, strict=True))
    assert wall - cpu - queued >= 0.15


def _step(t: float, dur: float, cpu: float, queued: float, busy: float) -> dict[str, float]:
    return {"t": t, "dur": dur, "py": cpu, "cpu": cpu, "queued": queued, "busy": busy}


def test_a_windows_summary_splits_each_steps_work_and_the_relative_figures_follow() -> None:
    alone, other = Window("alone", 10.0), Window("kvflow", 10.0)
    for i in range(11):
        alone.steps["P"].append(_step(i * 0.010, 0.010, 0.003, 0.0, 0.003))
        other.steps["P"].append(_step(i * 0.020, 0.020, 0.004, 0.001, 0.008))
    for window in (alone, other):
        window.steps["D"] = list(window.steps["P"])
        window.cpu = {"P": [1.0, 0.5], "D": [1.0, 0.0], "_wall": [10.0, 0.0]}
        window.seconds = 1.0
    rows = [_summary([alone]), _summary([other])]
    _relative(rows)
    p = rows[1]["engines"]["P"]
    assert p["steps_per_s"] == pytest.approx(50.0) and rows[0]["engines"]["P"]["steps_per_s"] == pytest.approx(100.0)
    assert p["loss_pct"] == pytest.approx(50.0)
    assert p["gil_wait_ms"]["mean"] == pytest.approx(3.0)  # 8 busy - 4 CPU - 1 waiting for a core
    assert p["core_wait_ms"]["mean"] == pytest.approx(1.0)
    assert p["added_p99_ms"] == pytest.approx(10.0) and p["added_cpu_ms"] == pytest.approx(1.0)
    assert p["cpu_pct"] == pytest.approx(15.0) and p["children_cpu_pct"] == pytest.approx(5.0)
    assert rows[0]["engines"]["P"]["loss_pct"] is None  # the baseline has nothing to lose to
    later = Window("alone", 10.0)  # a second turn, later and slower: the turns' samples pool
    later.steps["P"] = later.steps["D"] = [_step(100 + i * 0.020, 0.020, 0.003, 0.0, 0.003) for i in range(6)]
    later.cpu, later.seconds = {"P": [1.0, 0.0], "D": [1.0, 0.0], "_wall": [10.0, 0.0]}, 1.0
    pooled = _summary([alone, later])
    assert pooled["turns"] == 2 and pooled["engines"]["P"]["steps"] == 17
    assert pooled["engines"]["P"]["steps_per_s"] == pytest.approx((10 + 5) / (0.1 + 0.1))


@pytest.mark.parametrize(
    "options",
    [{"systems": ("nobody",)}, {"rates": (0.0,)}, {"python_ms": 0.0, "wait_ms": 0.0}, {"tokens": 0}],
)
def test_bad_options_are_refused_by_name(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        HostOptions(**options)


def test_the_stand_in_does_the_host_work_and_steps_with_nothing_scheduled() -> None:
    events: list[dict[str, Any]] = []
    p, d = make_pair()
    try:
        p.emit = lambda **event: events.append(event)
        p.host, p.spin = HostLoad(calibrate(1.0), 1.0), True
        p.step()  # nothing scheduled: the engine core still steps, as one busy with other requests
        p_req, d_req = dispatch(p, d, "host", 64)
        settle((p, d), [p_req, d_req])
    finally:
        d.close()
        p.close()
    steps = [e for e in events if e["ev"] == "hstep"]
    assert len(steps) >= 2
    assert all(s["dur"] >= 0.001 and s["py"] > 0 and s["busy"] >= s["cpu"] - 1e-3 for s in steps)


@pytest.mark.system
def test_a_small_run_of_the_command_measures_every_system(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    code = cli(
        [
            "bench", "host", "--systems", "alone,kvflow,kvflow-integrity", "--rates", "20", "--duration", "0.5",
            "--turns", "2", "--idle", "0.3", "--warmup", "0.2", "--python-ms", "1", "--wait-ms", "2",
            "--json", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    results = json.loads(out.read_text())
    assert set(results["idle"]) == {"alone", "kvflow", "kvflow-integrity"}
    by_system = {row["system"]: row for row in results["rows"]}
    assert set(by_system) == {"alone", "kvflow", "kvflow-integrity"}
    for row in by_system.values():
        assert row["requests"] == 20 and row["failed"] == 0 and row["bad_pages"] == 0
        for engine in row["engines"].values():
            assert engine["steps"] > 0 and engine["steps_per_s"] > 0
            assert {"gil_wait_ms", "core_wait_ms", "host_cpu_ms", "hooks_ms"} <= set(engine)
    assert by_system["kvflow"]["kv_to_recv_ms"]["p50"] is not None
    assert by_system["alone"]["kv_to_recv_ms"]["p50"] is None  # nothing moves
    assert by_system["kvflow"]["engines"]["P"]["children_cpu_pct"] > 0  # its engine process did the work
