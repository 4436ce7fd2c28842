"""The committed state diagrams are the ones the transition tables draw today."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.protocol import phases, teardown
from kvflow.protocol.state import STATE_TRIGGERED, Input, Mode, Role, State
from kvflow.protocol.transfer_tables import TABLES
from kvflow_tools.cli import main as cli_main
from kvflow_tools.diagrams import DEFAULT_OUTPUT, REGENERATE, main, render


def test_committed_diagrams_are_up_to_date() -> None:
    committed = DEFAULT_OUTPUT.read_text(encoding="utf-8") if DEFAULT_OUTPUT.exists() else ""
    assert committed == render(), f"docs/state-diagrams.md is out of date with the tables; run: {REGENERATE}"


def test_check_fails_on_a_stale_file_and_write_fixes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "diagrams.md"
    output.write_text("stale\n", encoding="utf-8")
    assert main(["--check", "--output", str(output)]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert main(["--output", str(output)]) == 0
    assert main(["--check", "--output", str(output)]) == 0
    assert cli_main(["diagrams", "--check"]) == 0  # the committed file, through `kvflow diagrams`


def test_a_changed_row_changes_the_drawing(monkeypatch: pytest.MonkeyPatch) -> None:
    before = render()
    assert (
        "ABORTING --> ABORTED : OPS_DRAINED / RELEASE, SEND_QUIESCED (state-triggered if NOTHING_IN_FLIGHT)" in before
    )
    assert "    DONE --> [*]" in before and "    [*] --> ALLOCATED" in before
    push_prefill = (Mode.PUSH, Role.PREFILL)
    hops = len(STATE_TRIGGERED[push_prefill])
    for row in list(STATE_TRIGGERED[push_prefill]):
        monkeypatch.delitem(STATE_TRIGGERED[push_prefill], row)
    monkeypatch.setitem(
        TABLES[push_prefill], (State.WRITING, Input.ABORT), TABLES[push_prefill][(State.WRITING, Input.DEADLINE)]
    )
    after = render()
    assert after != before and after.count("state-triggered") == before.count("state-triggered") - hops
    assert "WRITING --> EXPIRING : ABORT, DEADLINE / RESOLVE, SEND_ABORT" in after


def test_the_teardown_tables_are_drawn_and_a_changed_row_changes_the_drawing(monkeypatch: pytest.MonkeyPatch) -> None:

    before = render()
    assert "    HOLDING --> HOLDING : HEARD_AGAIN / SHORTEN_HOLD" in before
    assert "    GRACE --> ENDED : DEADLINE / LOSE" in before and "    [*] --> REMOVING : / REMOVE" in before
    silent = dict(teardown.TABLES[teardown.Kind.SILENT])
    silent[(teardown.Phase.HOLDING, teardown.Event.HEARD_AGAIN)] = (teardown.Phase.HOLDING, ())
    monkeypatch.setitem(teardown.TABLES, teardown.Kind.SILENT, silent)
    after = render()
    assert "HEARD_AGAIN / SHORTEN_HOLD" not in after and "- HOLDING: HEARD_AGAIN, REMOVAL_FAILED, REMOVED" in after


def test_an_engines_life_is_drawn_with_its_refusals_listed_not_drawn() -> None:
    text = render()
    assert (
        "    STARTING --> CLOSED : START_FAILED / CLOSE_OWNED" in text
        and "    RUNNING --> CLOSING : CLOSE / WIND_DOWN" in text
    )
    life = text[text.index("## An engine's life") :]
    life = life[: life.index("\n## ")]
    assert "- RUNNING: START, STARTED, START_FAILED, WOUND_DOWN" in life and "/ REFUSE" not in life


def test_a_peers_association_is_drawn_from_its_table(monkeypatch: pytest.MonkeyPatch) -> None:
    before = render()
    assert "    ASSOCIATED --> ADDING : ROUTED / REPLACE" in before and "    [*] --> NONE" in before
    assert "- ADDING: ANSWER, ANSWER_SENT, ANSWER_UNSENT" in before
    rows = dict(phases.TABLE)
    rows[(phases.Phase.ASSOCIATED, phases.Event.ROUTED)] = (phases.Phase.ADDING, (phases.Do.ADD,))
    monkeypatch.setattr(phases, "TABLE", rows)
    after = render()
    assert "ROUTED / REPLACE" not in after.replace("ANSWERING --> ADDING : ROUTED / REPLACE", "")
    assert "    ASSOCIATED --> ADDING : ROUTED / ADD" in after


def test_a_worker_ranks_requests_are_drawn_from_their_table(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvflow.integrations.vllm import request_book as book

    before = render()
    assert "    RELEASED --> ENDED : FINISHED / REPORT_SENT" in before and "    [*] --> LOADING" in before
    rows = dict(book.TABLE)
    rows[(book.Stage.RELEASED, book.Event.FINISHED)] = (book.Stage.RELEASED, ())  # never reported
    monkeypatch.setattr(book, "TABLE", rows)
    assert "    RELEASED --> ENDED : FINISHED / REPORT_SENT" not in render()
