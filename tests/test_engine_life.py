"""An engine's life as a table (`kvflow.protocol.lifecycle`): total, a refusal changes nothing,
every state is reachable and every one can end closed; the engine reads it (a second start is
refused in every state, a second close does nothing)."""

from __future__ import annotations

import pytest

from kvflow.errors import EngineClosed, UsageError
from kvflow.protocol.lifecycle import ACCEPTS_CALLS, DRIVES_INPUTS, START, TABLE, Do, Event, Life, Lifecycle
from kvflow.transports.loopback import LoopbackFabric
from kvflow_tools.diagrams import reachable_from
from kvflow_tools.testing import EnginePair


def test_every_state_has_a_row_for_every_event_and_a_refusal_changes_nothing() -> None:
    assert set(TABLE) == {(life, event) for life in Life for event in Event}
    for (life, _), (target, dos) in TABLE.items():
        if Do.REFUSE in dos:
            assert dos == (Do.REFUSE,) and target is life


def test_every_state_is_reachable_and_every_one_can_end_closed() -> None:
    assert reachable_from(TABLE, START) == set(Life)
    for life in Life:
        assert Life.CLOSED in reachable_from(TABLE, life), life


def test_only_a_running_engine_takes_calls_and_a_closing_one_still_drives_its_inputs() -> None:
    assert set(ACCEPTS_CALLS) == {Life.RUNNING}
    assert set(DRIVES_INPUTS) == {Life.RUNNING, Life.CLOSING}
    life = Lifecycle()
    walk = [  # event, what the row asks for, then: state, takes calls, drives inputs
        (Event.START, (Do.OPEN,), Life.STARTING, False, False),
        (Event.STARTED, (), Life.RUNNING, True, True),
        (Event.CLOSE, (Do.WIND_DOWN,), Life.CLOSING, False, True),
        (Event.CLOSE, (), Life.CLOSING, False, True),  # closing twice does nothing
        (Event.START, (Do.REFUSE,), Life.CLOSING, False, True),
        (Event.WOUND_DOWN, (), Life.CLOSED, False, False),
        (Event.CLOSE, (), Life.CLOSED, False, False),  # closing a closed engine does nothing
    ]
    for event, dos, state, calls, inputs in walk:
        assert (life.feed(event), life.state, life.accepts_calls, life.drives_inputs) == (dos, state, calls, inputs)
    assert life.closed


@pytest.mark.asyncio
async def test_an_engine_refuses_a_second_start_in_every_state_and_a_second_close_does_nothing() -> None:
    fabric = LoopbackFabric()
    pair = await EnginePair(fabric).start()
    with pytest.raises(UsageError, match="already started"):
        await pair.d.start()
    await pair.d.aclose()
    await pair.d.aclose()
    with pytest.raises(UsageError, match="already started"):
        await pair.d.start()
    with pytest.raises(EngineClosed, match="is closed"):
        await pair.d.expect("r", 1, peer="P", block_ids=[1])
    await pair.p.aclose()
    fabric.close()
