"""The tables beside the transfers' (an engine's life, a peer's phases, a torn-down peer, a vLLM
request's stages, a worker rank's requests) are tables that can fail.

Each is made by `kvflow.protocol.tables.complete`, which refuses a table where a (state,
event) pair has no row and is not declared ignored: a row taken out of any of them is an error
at import, not a quiet "ignored".  And each has a test that its rows' behaviour is checked: a
wrong row planted in the table (as the transfer tables' mutation campaign does) makes the test
that guards it fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from enum import Enum
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvflow.errors import UsageError
from kvflow.integrations.vllm import mapping, request_book, stages
from kvflow.protocol import association, lifecycle, phases, teardown
from kvflow.protocol.tables import complete, pairs
from tests import test_engine_life, test_teardown
from tests.test_peer_phases import PeerPhases
from tests.test_vllm_book_stateful import BookMachine
from tests.test_vllm_request_book import RequestBookMachine


class Light(Enum):
    OFF = "off"
    ON = "on"


class Press(Enum):
    UP = "up"
    DOWN = "down"


def test_a_pair_with_no_row_and_not_declared_ignored_is_refused_and_so_is_one_with_both() -> None:
    rows = {(Light.OFF, Press.UP): Light.ON, (Light.ON, Press.DOWN): Light.OFF}
    ignored = {(Light.OFF, Press.DOWN), (Light.ON, Press.UP)}
    table = complete("light", Light, Press, rows, ignored, lambda light: light)
    assert isinstance(table, MappingProxyType) and len(table) == 4 and table[(Light.ON, Press.UP)] is Light.ON
    with pytest.raises(UsageError, match=r"table light: no row and not declared ignored: ON/UP"):
        complete("light", Light, Press, rows, ignored - {(Light.ON, Press.UP)}, lambda light: light)
    with pytest.raises(UsageError, match=r"a row and declared ignored: OFF/UP"):
        complete("light", Light, Press, rows, ignored | {(Light.OFF, Press.UP)}, lambda light: light)
    with pytest.raises(UsageError, match=r"not a pair of its states and events: OFF/OFF"):
        complete("light", Light, Press, rows, {*ignored, (Light.OFF, Light.OFF)}, lambda light: light)  # type: ignore[misc]
    assert pairs([Light.ON], Press) == {(Light.ON, Press.UP), (Light.ON, Press.DOWN)}


TABLES: dict[str, tuple[Mapping[Any, Any], type[Enum], type[Enum]]] = {
    "lifecycle": (lifecycle.TABLE, lifecycle.Life, lifecycle.Event),
    "phases": (phases.TABLE, phases.Phase, phases.Event),
    "answered teardown": (teardown.TABLES[teardown.Kind.ANSWERED], teardown.Phase, teardown.Event),
    "silent teardown": (teardown.TABLES[teardown.Kind.SILENT], teardown.Phase, teardown.Event),
    "stages": (stages.TABLE, stages.Stage, stages.Event),
    "worker requests": (request_book.TABLE, request_book.Stage, request_book.Event),
}


@pytest.mark.parametrize("name", list(TABLES))
def test_each_table_is_made_complete_and_any_row_left_out_of_it_is_refused(name: str) -> None:
    table, states, events = TABLES[name]
    assert isinstance(table, MappingProxyType) and set(table) == pairs(states, events)
    for left_out in table:
        rows = {pair: row for pair, row in table.items() if pair != left_out}
        with pytest.raises(UsageError, match="no row and not declared ignored"):
            complete(name, states, events, rows, (), lambda state: (state, ()))


def _with(table: Mapping[Any, Any], pair: Any, row: Any) -> dict[Any, Any]:
    return {**table, pair: row}


def _finding(max_examples: int, stateful_step_count: int) -> settings:
    """Settings for a machine run that must find a planted row: the same examples every time,
    and no shrinking of the failure found (only that one is found matters here; shrinking took
    most of the run's time)."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=stateful_step_count,
        deadline=None,
        derandomize=True,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
    )


def _fails(check: Callable[[], object]) -> None:
    """`check` fails as a test does: an assertion (or several, as Hypothesis reports distinct
    failures), or a `pytest.raises` that saw nothing raised."""
    try:
        check()
    except (AssertionError, pytest.fail.Exception):
        return
    except BaseExceptionGroup as group:
        assert group.subgroup((AssertionError, pytest.fail.Exception)) is not None, group
        return
    pytest.fail("the planted row went unnoticed")


def test_a_peer_left_associated_by_its_teardown_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """An associated peer torn down here (lost) whose data goes but whose phase stays."""
    wrong = (phases.Phase.ASSOCIATED, (phases.Do.TEAR_DOWN,))
    monkeypatch.setattr(association, "TABLE", _with(phases.TABLE, (phases.Phase.ASSOCIATED, phases.Event.LOST), wrong))
    _fails(lambda: run_state_machine_as_test(PeerPhases, settings=_finding(max_examples=500, stateful_step_count=60)))


def test_an_engine_that_starts_twice_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second start of a running engine taken as nothing instead of refused."""
    wrong = (lifecycle.Life.RUNNING, ())
    monkeypatch.setattr(
        lifecycle, "TABLE", _with(lifecycle.TABLE, (lifecycle.Life.RUNNING, lifecycle.Event.START), wrong)
    )
    _fails(
        lambda: asyncio.run(
            test_engine_life.test_an_engine_refuses_a_second_start_in_every_state_and_a_second_close_does_nothing()
        )
    )


def test_a_silent_peer_whose_hold_ends_without_its_fence_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The held blocks of a silent peer would never go back."""
    silent = teardown.TABLES[teardown.Kind.SILENT]
    wrong = (teardown.Phase.ENDED, ())
    mutated = {
        **teardown.TABLES,
        teardown.Kind.SILENT: _with(silent, (teardown.Phase.HOLDING, teardown.Event.DEADLINE), wrong),
    }
    monkeypatch.setattr(teardown, "TABLES", mutated)
    _fails(test_teardown.test_a_silent_peer_is_lost_after_the_grace_and_fenced_after_the_hold)


def test_a_decode_request_whose_failed_load_is_ignored_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """D's request whose load failed stays tracked as waiting for its KV."""
    wrong = (stages.Stage.EXPECTING, ())
    monkeypatch.setattr(
        mapping, "TABLE", _with(stages.TABLE, (stages.Stage.EXPECTING, stages.Event.RECEIVE_FAILED), wrong)
    )
    _fails(lambda: run_state_machine_as_test(BookMachine, settings=_finding(max_examples=300, stateful_step_count=30)))


def _worker_book_with(monkeypatch: pytest.MonkeyPatch, pair: Any, row: Any) -> None:
    monkeypatch.setattr(request_book, "TABLE", _with(request_book.TABLE, pair, row))
    _fails(
        lambda: run_state_machine_as_test(
            RequestBookMachine,
            settings=_finding(max_examples=300, stateful_step_count=40),
        )
    )


def test_a_released_prefill_request_never_reported_sent_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """P's blocks, released before vLLM said the request finished, would never be freed."""
    pair = (request_book.Stage.RELEASED, request_book.Event.FINISHED)
    _worker_book_with(monkeypatch, pair, (request_book.Stage.RELEASED, ()))


def test_a_prefill_request_reported_sent_and_kept_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reported in finished_sending, yet still in the book: it could be reported again."""
    pair = (request_book.Stage.RELEASED, request_book.Event.FINISHED)
    _worker_book_with(monkeypatch, pair, (request_book.Stage.RELEASED, (request_book.Do.REPORT_SENT,)))


def test_an_aborted_decode_request_reported_as_a_failed_load_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load ended on purpose (vLLM aborted the request) taken for a failure."""
    pair = (request_book.Stage.ABORTING, request_book.Event.ALL_ENDED_FAILED)
    failed = (request_book.Do.REPORT_RECEIVED, request_book.Do.REPORT_FAILED)
    _worker_book_with(monkeypatch, pair, (request_book.Stage.ENDED, failed))
