"""`kvflow bench router` at a tiny scale, through the CLI: every scenario runs against the real
router process and its JSON holds what was observed (statuses, descriptors, refusals), with no
timing asserted.  The router's limits are made small so that each scenario meets them: a
header deadline the hostile connections outlast, a body budget two of three bodies fit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow_tools.cli import main
from kvflow_tools.errors import BenchError

SLOWLORIS = ["--trickling", "3", "--idle", "2", "--duration", "0.1", "--grace", "60", "--trickle-interval", "0.05"]
BODIES = ["--bodies", "3", "--body-mib", "1", "--body-budget", "2200000", "--max-body", "1100000"]
LOCKOUT = ["--lockout-idle", "8", "--lockout-addresses", "2", "--lockout-cap", "8", "--genuine", "3"]
LIMITS = ["--header-timeout", "2", "--idle-timeout", "2"]  # long enough for all five to be opened and counted first


def test_every_scenario_runs_and_reports_what_it_observed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "router.json"
    argv = ["bench", "router", *SLOWLORIS, *BODIES, *LOCKOUT, *LIMITS, "--requests", "10", "--warmup", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = {run["scenario"]: run for run in report["runs"]}
    assert list(runs) == ["slowloris", "bodies", "endless", "latency", "lockout"]
    for run in runs.values():
        assert run["run"] == 1 and len(run["load_start"]) == len(run["load_end"]) == 3

    slow = runs["slowloris"]
    assert slow["genuine_status"] == 200 and slow["open_end"] == 0  # every hostile one closed by the router
    assert slow["refused"]["header_timeout"] == 3 and slow["refused"]["idle"] >= 2
    assert slow["samples"] and slow["fds_before"] > 0 and slow["fds_max"] > slow["fds_before"]

    big = runs["bodies"]
    assert big["taken"] == 2 and big["statuses"]["200"] == 2
    assert big["statuses"].get("503", 0) + big["reset"] == 1 and big["refused"]["body_budget"] == 1
    assert big["rss_before"] > 0 and big["rss_peak"] > 0 and big["rss_dispatched"] > 0
    assert big["body_bytes_in_flight_after"] == 0

    endless = runs["endless"]
    assert endless["status"] == 502 and "more than 1048576 bytes" in endless["message"]
    assert endless["p_sent"] > endless["bound"] and endless["rss_peak"] > 0

    assert runs["latency"]["statuses"] == {"200": 10} and runs["latency"]["median_ms"] > 0

    lockout = runs["lockout"]  # 8 idle from 127.0.0.2 and .3: each address keeps its share of 2, no more
    assert lockout["max_connections"] == 8 and lockout["max_connections_per_client"] == 2
    assert lockout["genuine_served"] == 3 and lockout["genuine_failed"] == {}
    assert lockout["refused"]["evicted"] >= 1 and lockout["hostile_still_open"] <= 4  # two shares of 2
    table = capsys.readouterr().out
    assert "slowloris" in table and "refused body_budget 1" in table and "502 once P had sent" in table


@pytest.mark.parametrize(
    ("option", "problem"), [(["--scenario", "flood"], "unknown scenarios"), (["--runs", "0"], "must be >= 1")]
)
def test_bad_options_are_refused_naming_them(option: list[str], problem: str) -> None:
    with pytest.raises(BenchError, match=problem):
        main(["bench", "router", *option])
