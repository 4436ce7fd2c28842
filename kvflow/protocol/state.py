"""The transfer state machine: the queries over its transition tables, and its state-triggered hops.

Why apart from the tables: the core asks only what an input does in a state and which hop a
state takes by itself; how the rows of `TABLES` are assembled (several hundred lines of data and
the row makers that generate them) is kept in `kvflow.protocol.transfer_tables`, so that these
lookups and the rules they follow read on one page.

Theory of operation
-------------------
Every KV transfer is seen by two engines: the prefill engine (P) that owns the source blocks and
the decode engine (D) that owns the destination blocks.  Each side runs one machine per transfer
and epoch.  A machine is a `State`; an `Input` moves it along the table for its (mode, role) and
yields a tuple of `Effect`s: what the driver must do (send a message, submit a WRITE, release
blocks, ...).  Nothing here does I/O or reads a clock.

Rule 1: everything that decides *which* state follows *which* input lives in `TABLES`, and every
hop a machine takes without an outside event lives in `STATE_TRIGGERED`: in a listed state, when
a listed `Condition` holds, the core feeds the listed input, and repeats until no row applies.
The core (`kvflow.protocol.core`) only refines raw events into inputs (is this the last
outstanding op?  is this notification a duplicate?), evaluates conditions, and turns `Effect`s into
concrete actions with payloads.

Rule 2: an input that the table does not list raises `InvalidTransition` and changes nothing.
The driver decides what that means: a local caller made a mistake (re-raised), or a peer sent
something it should not have (counted and ignored).

Two modes run on identical code:

* push (kvflow's default): D registers its destination blocks with P as soon as it allocates
  them; P WRITEs into them as soon as its KV is ready (either may come first); each WRITE carries
  a notification that D counts.  P is the *initiator* of data movement, D the *target*.
* pull (vLLM's default flow): P reports ready with its block ids; D READs them and then tells P
  it is done, so P may release.  D is the initiator, P the target.  D claims the transfer when
  it allocates, so P may make its KV ready for a decode peer it does not know yet (sequential
  routers): the first claimant becomes the peer.

Safety: who may release blocks, and when
----------------------------------------
An initiator knows which of its own ops are in flight, so its blocks are released as soon as the
last op has completed or failed.  A target cannot know: a WRITE (push) or READ (pull) issued by
the peer may still be touching its blocks.  So when a target gives up on a transfer (abort,
failure, deadline) it enters a *fencing* state (ABORTING / FAILING / EXPIRING): the outcome is
final and reported, but the blocks stay quarantined until the initiator confirms that nothing is
in flight (PEER_QUIESCED), or the peer has been declared dead and torn down (PEER_LOST).  A
fencing state has its own deadline; when it passes the driver declares the peer lost.  The
initiator enters the same fencing states while its own ops drain, then tells the target
SEND_QUIESCED; with nothing in flight it does so at once (a state-triggered hop).  Terminal
states never release twice: release happens on exactly one edge into a terminal (or
NOTIFIED-then-DONE) state.

The tables, and the groups of states they are written around (`TERMINAL`, `FENCING`,
`ACTIVE`), are built in `kvflow.protocol.transfer_tables`; `python -m kvflow_tools.diagrams`
draws every table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvflow.errors import InvalidTransition
from kvflow.protocol.transfer_tables import FENCING_DONE, TABLES
from kvflow.protocol.vocabulary import Condition, Effect, Input, Mode, Outcome, Role, State, Transition

__all__ = (
    "STATE_TRIGGERED",
    "TRIGGERS_BY_STATE",
    "Effect",
    "Condition",
    "Input",
    "Mode",
    "Outcome",
    "Role",
    "State",
    "Transition",
    "initial_state",
    "is_initiator",
    "outcome_of",
    "state_triggered",
    "transition",
    "triggers_by_state",
)


_OUTCOME = {
    State.NOTIFIED: Outcome.SUCCEEDED,
    State.DONE: Outcome.SUCCEEDED,
    State.ABORTING: Outcome.ABORTED,
    State.ABORTED: Outcome.ABORTED,
    State.FAILING: Outcome.FAILED,
    State.FAILED: Outcome.FAILED,
    State.EXPIRING: Outcome.EXPIRED,
    State.EXPIRED: Outcome.EXPIRED,
}

# --------------------------------------------------------------------------------------------
# State-triggered hops: in this state, when the condition holds, the core feeds this input
# itself, after every step, until no row applies.
# --------------------------------------------------------------------------------------------

StateTriggers = dict[tuple[State, Condition], Input]


def _initiator_drains() -> StateTriggers:
    """An initiator that gave up with none of its ops in flight has nothing to wait for: it
    releases and tells the target at once (its fencing rows for OPS_DRAINED)."""
    return {(fencing, Condition.NOTHING_IN_FLIGHT): Input.OPS_DRAINED for fencing in FENCING_DONE}


STATE_TRIGGERED: Mapping[tuple[Mode, Role], StateTriggers] = {
    # D registered no block (it holds every position P would write): nothing can land, and
    # the registration it just sent is its verdict.
    (Mode.PUSH, Role.DECODE): {(State.REGISTERED, Condition.NOTHING_WANTED): Input.NOTHING_TO_LAND},
    # P gives up after D's registration with no WRITE in flight (none issued yet, or every
    # batch so far written): the hop fires.  P's last batch needed no WRITE (D holds those
    # positions): written.  D's verdict came with nothing of P's in flight: done.  D registered
    # no block: its registration was its verdict.
    (Mode.PUSH, Role.PREFILL): {
        **_initiator_drains(),
        (State.WRITING, Condition.NOTHING_IN_FLIGHT): Input.OPS_DRAINED,
        (State.CONFIRMED, Condition.NOTHING_IN_FLIGHT): Input.OPS_DRAINED,
        (State.WRITTEN, Condition.NOTHING_WANTED): Input.PEER_DONE,
    },
    # D gives up only from READING, where its one READ is in flight, so today this never
    # fires; it keeps the rule the same for every initiator.
    (Mode.PULL, Role.DECODE): _initiator_drains(),
    # P gave up on a transfer no peer claimed: nobody can be reading it, release at once.
    (Mode.PULL, Role.PREFILL): {(fencing, Condition.UNCLAIMED): Input.OPS_DRAINED for fencing in FENCING_DONE},
}


def initial_state(role: Role) -> State:
    """The state a new machine starts in: D holds its blocks, P is prefilling."""
    return State.ALLOCATED if role is Role.DECODE else State.PREFILL_RUNNING


def is_initiator(mode: Mode, role: Role) -> bool:
    """The side that issues the data-plane ops (and so knows what is in flight)."""
    return (mode is Mode.PUSH) == (role is Role.PREFILL)


def outcome_of(state: State) -> Outcome | None:
    """The transfer's outcome once decided (NOTIFIED and later, or a failure), else None."""
    return _OUTCOME.get(state)


def triggers_by_state(
    triggers: Mapping[tuple[State, Condition], Input],
) -> dict[State, tuple[tuple[Condition, Input], ...]]:
    """`triggers` grouped by state, each state's rows in `Condition` order: what
    `state_triggered` walks, so that it looks only at the rows of the machine's state."""
    return {
        state: tuple((c, triggers[(state, c)]) for c in Condition if (state, c) in triggers)
        for state in dict.fromkeys(s for s, _ in triggers)
    }


# Built once from `STATE_TRIGGERED`; `tests/test_state_table.py` checks that it equals it.
TRIGGERS_BY_STATE: dict[tuple[Mode, Role], dict[State, tuple[tuple[Condition, Input], ...]]] = {
    side: triggers_by_state(triggers) for side, triggers in STATE_TRIGGERED.items()
}
_NO_TRIGGERS: tuple[tuple[Condition, Input], ...] = ()


def state_triggered(mode: Mode, role: Role, state: State, holds: Callable[[Condition], bool]) -> Input | None:
    """The input a machine in `state` feeds itself now, if any: the first row of
    `STATE_TRIGGERED` for `state` whose condition `holds`."""
    for condition, input_ in TRIGGERS_BY_STATE[(mode, role)].get(state, _NO_TRIGGERS):
        if holds(condition):
            return input_
    return None


def transition(mode: Mode, role: Role, state: State, input_: Input, transfer: str = "?") -> Transition:
    """Look up what `input_` does in `state`.

    :raises InvalidTransition: the table has no entry; nothing changes.
    """
    try:
        return TABLES[(mode, role)][(state, input_)]
    except KeyError:
        raise InvalidTransition(transfer, state.name, input_.name) from None
