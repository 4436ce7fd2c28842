"""Totality and shape of the transition tables (h2's State x Input test, plus structure).

Every (mode, role, state, input) either follows the table or raises `InvalidTransition` naming
the transfer, state and input, and leaves a real core machine exactly as it was.
"""

from __future__ import annotations

from collections import deque

import hypothesis.strategies as st
import pytest
from hypothesis import given

from kvflow.errors import InvalidTransition
from kvflow.protocol.core import TransferCore
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import (
    ACTIVE,
    FENCING,
    FENCING_DONE,
    TABLES,
    TERMINAL,
    Act,
    Input,
    Mode,
    Role,
    State,
    initial_state,
    outcome_of,
    transition,
)

SIDES = sorted(TABLES, key=lambda k: (k[0].value, k[1].value))
LOCAL_ONLY_ACTS = {Act.SUBMIT_PENDING, Act.SEND_REGISTRATION, Act.SEND_READY, Act.RESOLVE, Act.QUARANTINE}


def _machine_in(mode: Mode, role: Role, state: State) -> tuple[TransferCore, TransferKey]:
    core = TransferCore("engine", num_layers=2)
    key = TransferKey("t", 1)
    if role is Role.DECODE:
        core.expect(key, peer="peer", mode=mode, block_ids=[0, 1], deadline=10.0, now=0.0)
    else:
        core.kv_ready(key, block_ids=[3], now=0.0, final=False, mode=mode, peer="peer", deadline=10.0)
    m = core.machine(key, role)
    m.state = state
    return core, key


def test_totality_over_every_side_state_and_input() -> None:
    """Exhaustive: all 4 x 14 x 27 combinations."""
    for side in SIDES:
        for state in State:
            for input_ in Input:
                check_pair(side, state, input_)


@given(side=st.sampled_from(SIDES), state=st.sampled_from(State), input_=st.sampled_from(Input))
def test_totality_sampled(side: tuple[Mode, Role], state: State, input_: Input) -> None:
    check_pair(side, state, input_)


def check_pair(side: tuple[Mode, Role], state: State, input_: Input) -> None:
    mode, role = side
    core, key = _machine_in(mode, role, state)
    m = core.machine(key, role)
    before = (repr(m), core.ledger.held_blocks, repr(core.stats))
    expected = TABLES[side].get((state, input_))
    if expected is None:
        with pytest.raises(InvalidTransition) as caught:
            core._feed(m, input_, 1.0)
        assert (repr(m), core.ledger.held_blocks, repr(core.stats)) == before
        assert m.state is state
        message = str(caught.value)
        assert state.name in message and input_.name in message and "t@1" in message
    else:
        core._feed(m, input_, 1.0)
        if input_ is not Input.OPS_DRAINED and expected.target in FENCING and state not in FENCING:
            # an initiator with nothing in flight drains at once: one step further
            assert m.state in (expected.target, FENCING_DONE[expected.target])
        else:
            assert m.state is expected.target


@pytest.mark.parametrize("side", SIDES, ids=lambda s: f"{s[0].value}-{s[1].value}")
def test_table_shape(side: tuple[Mode, Role]) -> None:
    table = TABLES[side]
    for (state, input_), (target, acts) in table.items():
        where = f"{side} {state.name} + {input_.name}"
        if state in TERMINAL:
            assert target is state, f"{where}: a terminal state never leaves"
            assert not set(acts) & (LOCAL_ONLY_ACTS | {Act.RELEASE}), f"{where}: terminal acts {acts}"
        if state in FENCING:
            assert target in (state, FENCING_DONE[state]), f"{where}: fencing leads only to its outcome"
        if Act.RESOLVE in acts:
            assert outcome_of(state) is None and outcome_of(target) is not None, f"{where}: resolves once"
        if Act.RELEASE in acts:
            assert target in TERMINAL or target is State.NOTIFIED, f"{where}: releases only at the end"
        if Act.QUARANTINE in acts:
            assert target in FENCING, f"{where}: quarantine means waiting for a fence"
        assert acts.count(Act.RELEASE) <= 1, where


@pytest.mark.parametrize("side", SIDES, ids=lambda s: f"{s[0].value}-{s[1].value}")
def test_every_wait_has_a_deadline_and_an_exit(side: tuple[Mode, Role]) -> None:
    table = TABLES[side]
    states = {s for s, _ in table}
    for state in states:
        if state in ACTIVE or state in FENCING:
            for input_ in (Input.DEADLINE, Input.PEER_LOST, Input.ABORT):
                assert (state, input_) in table, f"{side} {state.name} must handle {input_.name}"
    # every reachable state can reach a terminal one
    reachable = {initial_state(side[1])}
    queue = deque(reachable)
    while queue:
        state = queue.popleft()
        for (source, _), (target, _) in table.items():
            if source is state and target not in reachable:
                reachable.add(target)
                queue.append(target)
    assert reachable <= states | TERMINAL
    for state in reachable - TERMINAL:
        seen, frontier = {state}, [state]
        while frontier:
            current = frontier.pop()
            for (source, _), (target, _) in table.items():
                if source is current and target not in seen:
                    seen.add(target)
                    frontier.append(target)
        assert seen & TERMINAL, f"{side}: {state.name} can never finish"


def test_lookup_names_transfer_state_and_input() -> None:
    with pytest.raises(InvalidTransition, match=r"can't handle DELIVERED when transfer='x@3' and state=ALLOCATED"):
        transition(Mode.PUSH, Role.DECODE, State.ALLOCATED, Input.DELIVERED, "x@3")
