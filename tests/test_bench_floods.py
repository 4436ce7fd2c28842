"""`kvflow bench floods` at a tiny scale, through the CLI: a real engine process is flooded, its
threads are listed with their CPU, the genuine peer's transfer completes, and the JSON report
holds what the table prints (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow_tools.bench.bench_floods import SHORT_OF_DESCRIPTORS
from kvflow_tools.cli import main
from kvflow_tools.errors import BenchError


def flood(tmp_path: Path, *options: str) -> dict[str, object]:
    """One flood's run from the JSON report; the command's status says whether D's transfer completed."""
    out = tmp_path / "floods.json"
    # patience: P short of descriptors drains what the flood left in ~11 s here when the machine is
    # quiet; a starved one (tests beside it on 2 cores) once took more than the default 30 s
    argv = ["bench", "floods", "--connections", "200", "--runs", "1", "--patience", "180", *options]
    status = main([*argv, "--json", str(out)])
    report = json.loads(out.read_text())
    connections = int(argv[len(argv) - 1 - argv[::-1].index("--connections") + 1])  # the last one given
    assert report["config"]["connections"] == connections and len(report["runs"]) == 1
    run: dict[str, object] = report["runs"][0]
    genuine = run["genuine"]
    assert isinstance(genuine, dict) and status == (0 if genuine["completed"] else 1)
    return run


def test_a_flood_is_counted_by_the_engine_and_a_genuine_peer_moves_kv_meanwhile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = flood(tmp_path)
    assert 0 < run["connections"] <= 200  # type: ignore[operator]
    control = run["control"]
    assert isinstance(control, dict)
    assert control["connections_accepted"] > 0 and control["rejected_handshake"] > 0  # the engine saw them
    genuine = run["genuine"]
    assert isinstance(genuine, dict) and genuine["completed"] is True and genuine["connected"] == "connected"
    threads = run["threads"]
    assert isinstance(threads, list)
    names = {t["name"] for t in threads}
    assert {"loop (MainThread)", "kvflow-connections-P", "ZMQbg/IO/0"} <= names, names
    assert all(t["cpu_pct"] >= 0 for t in threads)
    descriptors = run["p_descriptors"]
    assert isinstance(descriptors, dict) and descriptors["peak"] > descriptors["before"] > 0
    load = run["load"]
    assert isinstance(load, dict) and len(load["start"]) == len(load["end"]) == 3
    table = capsys.readouterr().out
    assert "conn/s" in table and "accept_failed" in table and "yes" in table


@pytest.mark.system
@pytest.mark.parametrize("rate", ["0", "50"])  # as fast as it can (bursts that time out together), or paced
def test_at_a_descriptor_limit_the_engine_holds_no_more_and_the_genuine_peer_still_connects(
    tmp_path: Path, rate: str
) -> None:
    run = flood(tmp_path, "--nofile", "128", "--rate", rate)  # 200 connections cannot all be held
    descriptors = run["p_descriptors"]
    assert run["nofile"] == 128 and isinstance(descriptors, dict) and descriptors["peak"] <= 128
    genuine = run["genuine"]
    # at the limit P once wedged for good here (docs/security.md, "A process wedged at its
    # descriptor limit"): a link monitor made one descriptor short blocked libzmq's I/O thread
    assert isinstance(genuine, dict) and genuine["completed"] is True, genuine
    # P short of descriptors may refuse D, or leave it unanswered, until the flood's connections end
    failed = genuine["failed_attempts"]
    assert isinstance(failed, list) and genuine["attempts"] == len(failed) + 1
    assert all(any(why in error for why in SHORT_OF_DESCRIPTORS) for error in failed), failed


@pytest.mark.system
def test_an_insiders_idle_connections_at_the_limit_give_way_to_a_genuine_peer(tmp_path: Path) -> None:
    """200 DEALERs holding the secret's keys, each completing its handshake and then sending
    nothing (and reconnecting when closed), against P at 128 descriptors: before, they held every
    descriptor and D never got in (P spinning on failed accepts); now P refuses new handshakes
    while short, closes the idle connections, and D connects and moves KV."""
    refused = []
    for _ in range(2):
        run = flood(tmp_path, "--nofile", "128", "--attack", "idle_insiders")
        assert run["attack"] == "idle_insiders" and run["connections"] == 200
        genuine = run["genuine"]
        assert isinstance(genuine, dict) and genuine["completed"] is True, genuine
        descriptors = run["p_descriptors"]
        assert isinstance(descriptors, dict) and descriptors["peak"] <= 128
        control = run["control"]
        assert isinstance(control, dict)
        refused.append(control.get("connections_refused_short", 0))  # a count that never moved is absent
        if refused[-1] > 0:
            break
        # seen once in the system stage, beside other tests: the insider's handshakes failed on
        # their own (slow ZAP answers), D got in at its first try, P never had to refuse: once more
    assert refused[-1] > 0, f"P never refused a handshake for want of descriptors: {refused}, {control}"


def test_bench_floods_refuses_bad_settings() -> None:
    with pytest.raises(BenchError, match="--connections"):
        main(["bench", "floods", "--connections", "0"])
    for rate in ("-1", "nan", "inf"):
        with pytest.raises(BenchError, match="--rate"):
            main(["bench", "floods", "--rate", rate])
    for patience in ("0", "nan", "inf"):
        with pytest.raises(BenchError, match="--patience"):
            main(["bench", "floods", "--patience", patience])
    with pytest.raises(SystemExit):  # argparse names the choices
        main(["bench", "floods", "--attack", "knock"])


@pytest.mark.system
def test_an_insider_under_many_names_is_held_to_the_descriptor_budget_and_an_allow_list_keeps_it_out(
    tmp_path: Path,
) -> None:
    """An insider associates 40 engines, one name each, with P at 256 descriptors: P takes
    names until its descriptor reserve, refuses the rest naming why, never holds more than its
    limit, and serves D once the names leave.  With an allow-list of engine ids (docs/security.md's
    bound for this attacker) every name is refused and D moves KV while they are there."""
    run = flood(tmp_path, "--nofile", "256", "--attack", "many_names", "--connections", "40")
    insider, descriptors = run["insider"], run["p_descriptors"]
    assert isinstance(insider, dict) and isinstance(descriptors, dict)
    assert 0 < insider["associated"] < 40 and insider["associated"] + insider["refused"] == 40, insider
    assert any("file descriptors left" in reason for reason in insider["reasons"]), insider
    # P never reaches its limit (on an older tree 300 names took it to 1,024 of 1,024); that
    # names admitted together count what their additions will open is tests/test_peer_thread.py's
    assert descriptors["peak"] < 256, descriptors
    after = run["genuine_after"]
    assert isinstance(after, dict) and after["completed"] is True, after

    run = flood(tmp_path, "--nofile", "256", "--attack", "many_names", "--connections", "40", "--allowed-peers", "D")
    insider, genuine = run["insider"], run["genuine"]
    assert isinstance(insider, dict) and insider["associated"] == 0 and insider["refused"] == 40, insider
    assert isinstance(genuine, dict) and genuine["completed"] is True and genuine["during_flood"] is True, genuine
