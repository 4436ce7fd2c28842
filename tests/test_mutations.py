"""The stateful test must fail when a release or a fence is taken out of the table.

A property test that cannot fail proves nothing.  Each case below removes one release or one
fence from the transition table and checks that `CoreProtocol` reports the broken protocol
invariant one would expect (not some unrelated crash).  The search is derandomized, so a
mutation is caught on every run or on none.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from kvflow.protocol.state import Effect, Input, Mode, Role, State, Transition
from kvflow.protocol.transfer_tables import TABLES
from tests.core_model import InvariantViolation
from tests.test_core_stateful import EXAMPLES, STEPS, CoreProtocol
from tests.test_engine_stateful import EngineProtocol

pytestmark = pytest.mark.system  # a campaign: each case runs a stateful test to its failure
R = Effect.RESOLVE
MUTATIONS = {
    # D releases its blocks on abort instead of quarantining them until P is fenced.
    "push decode abort without fence": (
        (Mode.PUSH, Role.DECODE),
        {
            (State.REGISTERED, Input.ABORT): Transition(State.ABORTED, (R, Effect.SEND_ABORT, Effect.RELEASE)),
            (State.WRITING, Input.ABORT): Transition(State.ABORTED, (R, Effect.SEND_ABORT, Effect.RELEASE)),
        },
        r"landed in D block|D released blocks .* in flight",
    ),
    # P releases its source blocks (and claims quiescence) while its WRITEs are in flight.
    "push prefill abort without drain": (
        (Mode.PUSH, Role.PREFILL),
        {
            (State.WRITING, Input.PEER_ABORTED): Transition(State.ABORTED, (R, Effect.RELEASE, Effect.SEND_QUIESCED)),
            (State.REGISTERED, Input.PEER_ABORTED): Transition(
                State.ABORTED, (R, Effect.RELEASE, Effect.SEND_QUIESCED)
            ),
        },
        r"P released blocks .* in flight",
    ),
    # P's lease runs out in pull mode and it releases while D may still be reading.
    "pull prefill expiry without fence": (
        (Mode.PULL, Role.PREFILL),
        {
            (State.PREFILL_READY, Input.DEADLINE): Transition(State.EXPIRED, (R, Effect.SEND_ABORT, Effect.RELEASE)),
            (State.PREFILL_READY, Input.PEER_ABORTED): Transition(State.ABORTED, (R, Effect.RELEASE)),
        },
        r"P released blocks .* in flight|read P block \d+ owned by None",
    ),
    # A successful push never gives P's source blocks back.
    "push prefill success without release": (
        (Mode.PUSH, Role.PREFILL),
        {(State.WRITING, Input.LAST_OP_COMPLETED): Transition(State.WRITTEN, ())},
        r"P blocks never released|P ledger still holds",
    ),
    # D never gives its blocks back after delivery.
    "push decode delivery without release": (
        (Mode.PUSH, Role.DECODE),
        {(State.NOTIFIED, Input.DELIVERED): Transition(State.DONE, ())},
        r"D blocks never released|D ledger still holds",
    ),
}


# What the engine-level test reports for the same mutations (its oracle checks every op as its
# bytes move, and the ledgers and block pools at the end).
ENGINE_EXPECTED = {
    "push decode abort without fence": r"lands in D block",
    "push prefill abort without drain": r"lands in D block|reads P block",
    "pull prefill expiry without fence": r"reads P block",
    "push prefill success without release": r"P still holds blocks|never returned",
    "push decode delivery without release": r"D still holds blocks|never returned",
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_engine_stateful_test_catches_mutation(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run_mutated(EngineProtocol, name, ENGINE_EXPECTED[name], (AssertionError, BaseExceptionGroup), monkeypatch)


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_core_stateful_test_catches_mutation(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run_mutated(CoreProtocol, name, MUTATIONS[name][2], (InvariantViolation, BaseExceptionGroup), monkeypatch)


def run_mutated(
    machine: type[RuleBasedStateMachine],
    name: str,
    expected: str,
    raised: tuple[type[BaseException], ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table_key, replacements, _ = MUTATIONS[name]
    table = TABLES[table_key]
    for entry, mutated in replacements.items():
        assert entry in table, f"mutation targets a transition that does not exist: {entry}"
        monkeypatch.setitem(table, entry, mutated)
    quick = settings(
        max_examples=max(EXAMPLES, 1000),  # generation stops at the first failure it finds
        stateful_step_count=STEPS,
        deadline=None,
        phases=[Phase.generate],  # finding the bug is the point; shrinking it is not
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,  # the same search every run: a mutation is caught always or never
    )
    with pytest.raises(raised) as caught:
        run_state_machine_as_test(machine, settings=quick)
    found = getattr(caught.value, "exceptions", (caught.value,))
    assert all(isinstance(e, raised[0]) for e in found), f"failed for another reason: {found}"
    assert any(re.search(expected, str(e)) for e in found), f"caught, but by another invariant: {found}"
