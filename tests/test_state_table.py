"""Totality and shape of the transition tables (h2's State x Input test, plus structure), and
of the state-triggered hops the core applies after every step.

Every (mode, role, state, input) either follows the tables or raises `InvalidTransition` naming
the transfer, state and input, and leaves a real core machine exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvflow.errors import InvalidTransition
from kvflow.protocol.actions import Action, ReleaseBlocks, SendMessage, SubmitOp
from kvflow.protocol.core import TransferCore
from kvflow.protocol.messages import Notice, Quiesced, Registration, TransferKey, id_tag
from kvflow.protocol.requests import Abort, Expect, KvReady
from kvflow.protocol.state import (
    STATE_TRIGGERED,
    TRIGGERS_BY_STATE,
    Condition,
    Effect,
    Input,
    Mode,
    Outcome,
    Role,
    State,
    Transition,
    initial_state,
    is_initiator,
    outcome_of,
    state_triggered,
    transition,
    triggers_by_state,
)
from kvflow.protocol.transfer_tables import ACTIVE, FENCING, FENCING_DONE, TABLES, TERMINAL
from kvflow_tools.diagrams import reachable_from

SIDES = sorted(TABLES, key=lambda k: (k[0].value, k[1].value))
LOCAL_ONLY_EFFECTS = {
    Effect.SUBMIT_PENDING,
    Effect.SEND_REGISTRATION,
    Effect.SEND_READY,
    Effect.RESOLVE,
    Effect.QUARANTINE,
}


def _machine_in(mode: Mode, role: Role, state: State) -> tuple[TransferCore, TransferKey]:
    core = TransferCore("engine", num_layers=2)
    key = TransferKey("t", 1)
    if role is Role.DECODE:
        core.expect(Expect(key, peer="peer", mode=mode, block_ids=[0, 1]), now=0.0, deadline=10.0)
    else:
        core.kv_ready(KvReady(key, block_ids=[3], final=False, mode=mode, peer="peer"), now=0.0, deadline=10.0)
    m = core.machine(key, role)
    m.state = state
    return core, key


def test_totality_over_every_side_state_and_input() -> None:
    """Exhaustive: every side, every `State` and every `Input`."""
    for side in SIDES:
        for state in State:
            for input_ in Input:
                check_pair(side, state, input_)


def check_pair(side: tuple[Mode, Role], state: State, input_: Input) -> None:
    mode, role = side
    core, key = _machine_in(mode, role, state)
    m = core.machine(key, role)
    before = (repr(m), core.ledger.held_blocks, repr(core.stats))
    expected = TABLES[side].get((state, input_))
    if expected is None:
        with pytest.raises(InvalidTransition) as caught:
            core.feed(m, input_, 1.0)
        assert (repr(m), core.ledger.held_blocks, repr(core.stats)) == before
        assert m.state is state
        message = str(caught.value)
        assert state.name in message and input_.name in message and f"{id_tag('t')}@1" in message
    else:
        core.feed(m, input_, 1.0)
        assert m.state is settled(side, expected.target, m.holds)


def settled(side: tuple[Mode, Role], state: State, holds: Callable[[Condition], bool]) -> State:
    """Where a machine that entered `state` comes to rest: its state-triggered hops followed."""
    seen = {state}
    while (hop := state_triggered(*side, state, holds)) is not None:
        state = TABLES[side][(state, hop)].target
        assert state not in seen, f"{side}: state-triggered hops loop through {state.name}"
        seen.add(state)
    return state


@pytest.mark.parametrize("side", SIDES, ids=lambda s: f"{s[0].value}-{s[1].value}")
def test_table_shape(side: tuple[Mode, Role]) -> None:
    table = TABLES[side]
    for (state, input_), (target, effects) in table.items():
        where = f"{side} {state.name} + {input_.name}"
        if state in TERMINAL:
            assert target is state, f"{where}: a terminal state never leaves"
            assert not set(effects) & (LOCAL_ONLY_EFFECTS | {Effect.RELEASE}), f"{where}: terminal effects {effects}"
        if state in FENCING:
            assert target in (state, FENCING_DONE[state]), f"{where}: fencing leads only to its outcome"
        if Effect.RESOLVE in effects:
            assert outcome_of(state) is None and outcome_of(target) is not None, f"{where}: resolves once"
        if Effect.RELEASE in effects or Effect.HOLD_FOR_FENCE in effects:
            assert target in TERMINAL or target in (State.NOTIFIED, State.WRITTEN), f"{where}: releases only at the end"
        if Effect.QUARANTINE in effects:
            assert target in FENCING, f"{where}: quarantine means waiting for a fence"
        assert effects.count(Effect.RELEASE) <= 1, where


@pytest.mark.parametrize("side", SIDES, ids=lambda s: f"{s[0].value}-{s[1].value}")
def test_every_wait_has_a_deadline_and_an_exit(side: tuple[Mode, Role]) -> None:
    table = TABLES[side]
    states = {s for s, _ in table}
    for state in states:
        if state in ACTIVE or state in FENCING:
            for input_ in (Input.DEADLINE, Input.PEER_LOST, Input.PEER_LOST_UNFENCED, Input.ABORT):
                assert (state, input_) in table, f"{side} {state.name} must handle {input_.name}"
    # every reachable state can reach a terminal one
    reachable = reachable_from(table, initial_state(side[1]))
    assert reachable <= states | TERMINAL
    for state in reachable - TERMINAL:
        assert reachable_from(table, state) & TERMINAL, f"{side}: {state.name} can never finish"


def test_lookup_names_transfer_state_and_input() -> None:
    with pytest.raises(InvalidTransition, match=r"can't handle DELIVERED when transfer='x@3' and state=ALLOCATED"):
        transition(Mode.PUSH, Role.DECODE, State.ALLOCATED, Input.DELIVERED, "x@3")


# ------------------------------------------------------------------ state-triggered hops


@pytest.mark.parametrize("side", SIDES, ids=lambda s: f"{s[0].value}-{s[1].value}")
def test_state_triggered_rows_are_reachable_total_and_settle(side: tuple[Mode, Role]) -> None:
    table, triggers = TABLES[side], STATE_TRIGGERED[side]
    reachable = reachable_from(table, initial_state(side[1]))
    for (state, condition), input_ in triggers.items():
        if condition is Condition.NOTHING_IN_FLIGHT:
            # about the machine's own ops: only an initiator has any
            assert is_initiator(*side), f"{side}: a target has no ops of its own to wait for"
        elif condition is Condition.UNCLAIMED:  # only pull P makes KV ready for a peer not known
            assert side == (Mode.PULL, Role.PREFILL), f"{side}: only pull P has unclaimed transfers"
        where = f"{side} {state.name} if {condition.name} -> {input_.name}"
        assert state in reachable, f"{where}: the state is never reached"
        assert (state, input_) in table, f"{where}: the table has no row, so the hop would raise"
        assert table[(state, input_)].target is not state, f"{where}: a hop must move on"
    for state in reachable:
        settled(side, state, lambda _: True)  # never loops, whatever holds


def _idle_push_prefill() -> tuple[TransferCore, TransferKey]:
    """P wrote its first batch into D's registered blocks; the WRITE completed; more KV is to
    come.  Nothing of P's is in flight, and it holds block 3."""
    core, key = TransferCore("P", num_layers=2), TransferKey("t", 1)
    core.peer_connected("D", 0.0)
    core.kv_ready(KvReady(key, block_ids=[3], final=False), now=0.0, deadline=10.0)
    (op,) = [a for a in core.receive("D", Registration(key, (7, 8), 2, 10.0), 0.0) if isinstance(a, SubmitOp)]
    core.op_submitted(op.op_id, 0.0)
    core.op_finished(op.op_id, 0.5)
    m = core.machine(key, Role.PREFILL)
    assert (m.state, m.inflight) == (State.REGISTERED, set())
    return core, key


GIVING_UP: dict[str, tuple[Callable[[TransferCore, TransferKey], list[Action]], Outcome]] = {
    "abort": (lambda core, key: core.abort(Abort(key, Role.PREFILL), 1.0), Outcome.ABORTED),
    "deadline": (lambda core, key: core.timer(10.0), Outcome.EXPIRED),
    "peer failed": (lambda core, key: core.receive("D", Notice(key, Outcome.FAILED, "boom"), 1.0), Outcome.FAILED),
}


@pytest.mark.parametrize("cause", sorted(GIVING_UP))
def test_initiator_giving_up_with_nothing_in_flight_fences_at_once(cause: str) -> None:
    """Nothing to drain, so nothing to wait for: in the same step P releases its blocks and
    tells D that nothing is in flight, instead of sitting in a fencing state until the fence
    deadline declares D lost."""
    core, key = _idle_push_prefill()
    give_up, outcome = GIVING_UP[cause]
    actions = give_up(core, key)
    assert core.machine(key, Role.PREFILL).state in TERMINAL, cause
    assert ReleaseBlocks(key, Role.PREFILL, (3,), outcome) in actions
    assert SendMessage("D", Quiesced(key)) in actions
    assert core.ledger.held_blocks == 0


@pytest.mark.parametrize("side", SIDES, ids=lambda s: f"{s[0].value}-{s[1].value}")
def test_the_index_the_core_walks_is_the_state_triggered_table(side: tuple[Mode, Role]) -> None:
    """`state_triggered` walks `TRIGGERS_BY_STATE`, built once: it holds exactly the rows of
    `STATE_TRIGGERED`, each state's in `Condition` order, so editing one means rebuilding it."""
    index, triggers = TRIGGERS_BY_STATE[side], STATE_TRIGGERED[side]
    assert {(state, c): i for state, rows in index.items() for c, i in rows} == triggers
    for state, rows in index.items():
        assert [c for c, _ in rows] == [c for c in Condition if (state, c) in triggers]
        for condition, input_ in rows:
            only: frozenset[Condition] = frozenset({condition})
            assert state_triggered(*side, state, only.__contains__) is input_
    assert index == triggers_by_state(triggers)


def test_dropping_the_drain_hop_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above fails when the hop is taken out of the table (and out of the index the
    core walks, rebuilt from it: the test before checks the two agree)."""
    side = (Mode.PUSH, Role.PREFILL)
    for row in list(STATE_TRIGGERED[side]):
        monkeypatch.delitem(STATE_TRIGGERED[side], row)
    monkeypatch.setitem(TRIGGERS_BY_STATE, side, triggers_by_state(STATE_TRIGGERED[side]))
    for cause in GIVING_UP:
        with pytest.raises(AssertionError):
            test_initiator_giving_up_with_nothing_in_flight_fences_at_once(cause)


@pytest.mark.parametrize("side", SIDES, ids=lambda s: f"{s[0].value}-{s[1].value}")
def test_a_peer_lost_unfenced_is_lost_alike_but_the_target_of_its_ops_holds_the_blocks_for_the_fence(
    side: tuple[Mode, Role],
) -> None:
    table, target = TABLES[side], not is_initiator(*side)
    lost = {state: step for (state, input_), step in table.items() if input_ is Input.PEER_LOST}
    unfenced = {state: step for (state, input_), step in table.items() if input_ is Input.PEER_LOST_UNFENCED}
    assert unfenced.keys() == lost.keys()
    for state, step in lost.items():
        held = tuple(Effect.HOLD_FOR_FENCE if target and e is Effect.RELEASE else e for e in step.effects)
        assert unfenced[state] == Transition(step.target, held), (side, state)
    holds = any(Effect.HOLD_FOR_FENCE in step.effects for step in unfenced.values())
    assert holds is target  # only the target's blocks can still be touched by the peer
