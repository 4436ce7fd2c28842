"""The transfer state machine, as a transition table that is data.

Theory of operation
-------------------
Every KV transfer is seen by two engines: the prefill engine (P) that owns the source blocks and
the decode engine (D) that owns the destination blocks.  Each side runs one machine per transfer
and epoch.  A machine is a `State`; an `Input` moves it along the table for its (mode, role) and
yields a tuple of `Act`s: what the driver must do (send a message, submit a WRITE, release
blocks, ...).  Nothing here does I/O or reads a clock.

Rule 1: everything that decides *which* state follows *which* input lives in `TABLES`.  The core
(`kvflow.protocol.core`) only refines raw events into inputs (is this the last outstanding op?  is this
notification a duplicate?) and turns `Act`s into concrete actions with payloads.

Rule 2: an input that the table does not list raises `InvalidTransition` and changes nothing.
The driver decides what that means: a local caller made a mistake (re-raised), or a peer sent
something it should not have (counted and ignored).

Two modes run on identical code:

* push (kvflow's default): D registers its destination blocks with P as soon as it allocates
  them; P WRITEs into them as soon as its KV is ready (either may come first); each WRITE carries
  a notification that D counts.  P is the *initiator* of data movement, D the *target*.
* pull (vLLM's default flow): P reports ready with its block ids; D READs them and then tells P
  it is done, so P may release.  D is the initiator, P the target.

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
SEND_QUIESCED.  Terminal states never release twice: release happens on exactly one edge into a
terminal (or NOTIFIED-then-DONE) state.

The tables are written out in full below; `_absorbing` only fills in the long lists of late
messages that terminal states swallow.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from kvflow.errors import InvalidTransition

__all__ = (
    "ACTIVE",
    "FENCING",
    "FENCING_DONE",
    "TABLES",
    "TERMINAL",
    "Act",
    "Input",
    "Mode",
    "Outcome",
    "Role",
    "State",
    "Transition",
    "initial_state",
    "is_initiator",
    "outcome_of",
    "transition",
)


class Mode(enum.Enum):
    PUSH = "push"
    PULL = "pull"


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class State(enum.Enum):
    # decode side
    ALLOCATED = "allocated"  # destination blocks held, registration not sent yet
    REGISTERED = "registered"  # push: D sent its registration / P received it, prefill running
    # prefill side
    PREFILL_RUNNING = "prefill_running"
    PREFILL_READY = "prefill_ready"  # all KV ready; push: waiting for registration, pull: D may read
    # data movement
    WRITING = "writing"
    READING = "reading"
    NOTIFIED = "notified"  # D: every batch landed; P: every WRITE completed (completion sent)
    DONE = "done"
    # outcome decided, blocks quarantined until the peer's ops are fenced
    ABORTING = "aborting"
    FAILING = "failing"
    EXPIRING = "expiring"
    # terminal
    ABORTED = "aborted"
    FAILED = "failed"
    EXPIRED = "expired"


class Input(enum.Enum):
    # from the embedding engine
    REGISTER = "register"  # D push: the peer is reachable, send the registration
    KV_READY = "kv_ready"  # P: a batch of KV (a chunk or some layers) is ready
    PREFILL_FINISHED = "prefill_finished"  # P: the last batch is ready
    DELIVERED = "delivered"  # D: the consumer took the blocks
    ABORT = "abort"
    # from the clock and liveness
    DEADLINE = "deadline"
    PEER_LOST = "peer_lost"  # fed only after the peer was torn down: nothing of it can land
    # from the data plane, about this engine's own ops
    OP_SUBMITTED = "op_submitted"
    OP_COMPLETED = "op_completed"  # others still in flight
    LAST_OP_COMPLETED = "last_op_completed"  # none in flight any more
    OP_FAILED = "op_failed"
    LAST_OP_FAILED = "last_op_failed"
    OPS_DRAINED = "ops_drained"  # entered a fencing state with nothing in flight
    # from the peer
    REGISTRATION_RECEIVED = "registration_received"
    READY_RECEIVED = "ready_received"
    BATCH_LANDED = "batch_landed"  # a WRITE notification, more batches expected
    LAST_BATCH_LANDED = "last_batch_landed"
    PEER_ABORTED = "peer_aborted"
    PEER_FAILED = "peer_failed"
    PEER_QUIESCED = "peer_quiesced"  # the initiator has nothing in flight and will issue nothing
    PEER_DONE = "peer_done"  # D is done with the transfer (push: ack, pull: release)
    DUPLICATE = "duplicate"  # a message already seen for this transfer and epoch
    INCOMPATIBLE = "incompatible"  # the peer's request cannot be served (sizes, counts, ranges)


class Act(enum.Enum):
    SEND_REGISTRATION = "send_registration"
    SEND_READY = "send_ready"
    SUBMIT_PENDING = "submit_pending"  # submit an op for every ready, unsubmitted batch
    SEND_ABORT = "send_abort"  # notice carrying this machine's outcome and reason
    SEND_QUIESCED = "send_quiesced"
    SEND_DONE = "send_done"
    RESOLVE = "resolve"  # the outcome is known: tell whoever waits
    QUARANTINE = "quarantine"  # blocks stay held until the peer is fenced
    RELEASE = "release"  # give every block this machine holds back to its owner
    RETURN_BATCH = "return_batch"  # a batch that arrived too late goes straight back
    DECLARE_PEER_LOST = "declare_peer_lost"
    IGNORE = "ignore"  # a late, duplicate or stray message: count it, do nothing


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"
    ABORTED = "aborted"
    FAILED = "failed"
    EXPIRED = "expired"


class Transition(NamedTuple):
    target: State
    acts: tuple[Act, ...]


TERMINAL = frozenset({State.DONE, State.ABORTED, State.FAILED, State.EXPIRED})
FENCING_DONE: Mapping[State, State] = {
    State.ABORTING: State.ABORTED,
    State.FAILING: State.FAILED,
    State.EXPIRING: State.EXPIRED,
}
FENCING = frozenset(FENCING_DONE)
ACTIVE = frozenset(
    {
        State.ALLOCATED,
        State.REGISTERED,
        State.PREFILL_RUNNING,
        State.PREFILL_READY,
        State.WRITING,
        State.READING,
    }
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

Table = dict[tuple[State, Input], Transition]

_REMOTE = (
    Input.REGISTRATION_RECEIVED,
    Input.READY_RECEIVED,
    Input.BATCH_LANDED,
    Input.LAST_BATCH_LANDED,
    Input.PEER_ABORTED,
    Input.PEER_FAILED,
    Input.PEER_QUIESCED,
    Input.PEER_DONE,
    Input.DUPLICATE,
    Input.INCOMPATIBLE,
)
_OPS = (
    Input.OP_SUBMITTED,
    Input.OP_COMPLETED,
    Input.LAST_OP_COMPLETED,
    Input.OP_FAILED,
    Input.LAST_OP_FAILED,
    Input.OPS_DRAINED,
)

# short aliases keep the tables readable
RESOLVE, RELEASE, QUARANTINE, IGNORE = Act.RESOLVE, Act.RELEASE, Act.QUARANTINE, Act.IGNORE
SEND_ABORT, SEND_QUIESCED, SEND_DONE = Act.SEND_ABORT, Act.SEND_QUIESCED, Act.SEND_DONE
SUBMIT, RETURN_BATCH, LOSE_PEER = Act.SUBMIT_PENDING, Act.RETURN_BATCH, Act.DECLARE_PEER_LOST


def _t(target: State, *acts: Act) -> Transition:
    return Transition(target, acts)


def _absorbing(states: Iterable[State], inputs: Iterable[Input], acts: tuple[Act, ...] = (IGNORE,)) -> Table:
    """Self-loops: each state swallows each input, doing `acts`."""
    return {(s, i): Transition(s, acts) for s in states for i in inputs}


def _merge(*parts: Table) -> Table:
    table: Table = {}
    for part in parts:
        for key, value in part.items():
            if key in table:
                raise AssertionError(f"transition listed twice: {key}")  # a table bug, at import
            table[key] = value
    return table


_FAILED_STATES = (State.ABORTED, State.FAILED, State.EXPIRED)


def _terminal_common(remote_ignored: Iterable[Input]) -> Table:
    """What every terminal state swallows: repeated aborts, stale timers, late ops and messages."""
    return _merge(
        _absorbing(TERMINAL, (Input.ABORT, Input.DEADLINE, Input.PEER_LOST), ()),
        _absorbing(TERMINAL, _OPS, ()),
        _absorbing(TERMINAL, remote_ignored),
    )


def _initiator_fencing(extra_local: Iterable[Input] = ()) -> Table:
    """Initiator gave up: wait for its own ops to drain, then tell the target it may release."""
    table: Table = {}
    for fencing, done in FENCING_DONE.items():
        table.update(
            {
                (fencing, Input.OP_SUBMITTED): _t(fencing),
                (fencing, Input.OP_COMPLETED): _t(fencing),
                (fencing, Input.OP_FAILED): _t(fencing),
                (fencing, Input.LAST_OP_COMPLETED): _t(done, RELEASE, SEND_QUIESCED),
                (fencing, Input.LAST_OP_FAILED): _t(done, RELEASE, SEND_QUIESCED),
                (fencing, Input.OPS_DRAINED): _t(done, RELEASE, SEND_QUIESCED),
                (fencing, Input.PEER_LOST): _t(done, RELEASE),
                (fencing, Input.DEADLINE): _t(fencing, LOSE_PEER),
                (fencing, Input.ABORT): _t(fencing),
            }
        )
        for local in extra_local:
            table[(fencing, local)] = _t(fencing, RETURN_BATCH)
    return table


def _target_fencing(releasing: Iterable[Input]) -> Table:
    """Target gave up: its blocks stay quarantined until the initiator is fenced."""
    table: Table = {}
    for fencing, done in FENCING_DONE.items():
        table.update(
            {
                (fencing, Input.PEER_LOST): _t(done, RELEASE),
                (fencing, Input.DEADLINE): _t(fencing, LOSE_PEER),
                (fencing, Input.ABORT): _t(fencing),
            }
        )
        for remote in releasing:
            table[(fencing, remote)] = _t(done, RELEASE)
    return table


def _fencing_ignores(inputs: Iterable[Input]) -> Table:
    return _absorbing(FENCING, inputs)


# --------------------------------------------------------------------------------------------
# push, decode side (target).  D holds its blocks from allocation; P writes into them.
# --------------------------------------------------------------------------------------------


def _push_decode_active(state: State) -> Table:
    return {
        (state, Input.BATCH_LANDED): _t(State.WRITING),
        (state, Input.LAST_BATCH_LANDED): _t(State.NOTIFIED, RESOLVE, SEND_DONE),
        (state, Input.ABORT): _t(State.ABORTING, RESOLVE, SEND_ABORT, QUARANTINE),
        (state, Input.DEADLINE): _t(State.EXPIRING, RESOLVE, SEND_ABORT, QUARANTINE),
        (state, Input.INCOMPATIBLE): _t(State.FAILING, RESOLVE, SEND_ABORT, QUARANTINE),
        (state, Input.PEER_ABORTED): _t(State.ABORTING, RESOLVE, QUARANTINE),
        (state, Input.PEER_FAILED): _t(State.FAILING, RESOLVE, QUARANTINE),
        (state, Input.PEER_LOST): _t(State.FAILED, RESOLVE, RELEASE),
        (state, Input.DUPLICATE): _t(state, IGNORE),
    }


PUSH_DECODE: Table = _merge(
    {
        # Nothing was sent, so nothing can land: release at once.
        (State.ALLOCATED, Input.REGISTER): _t(State.REGISTERED, Act.SEND_REGISTRATION),
        (State.ALLOCATED, Input.ABORT): _t(State.ABORTED, RESOLVE, RELEASE),
        (State.ALLOCATED, Input.DEADLINE): _t(State.EXPIRED, RESOLVE, RELEASE),
        (State.ALLOCATED, Input.PEER_LOST): _t(State.FAILED, RESOLVE, RELEASE),
        (State.ALLOCATED, Input.PEER_ABORTED): _t(State.ABORTED, RESOLVE, RELEASE),
        (State.ALLOCATED, Input.PEER_FAILED): _t(State.FAILED, RESOLVE, RELEASE),
        (State.ALLOCATED, Input.DUPLICATE): _t(State.ALLOCATED, IGNORE),
    },
    _absorbing((State.ALLOCATED, State.REGISTERED, State.WRITING), [Input.PEER_QUIESCED]),
    _push_decode_active(State.REGISTERED),
    _push_decode_active(State.WRITING),
    {
        # Every batch landed and P issues nothing more for this epoch: no fence needed.
        (State.NOTIFIED, Input.DELIVERED): _t(State.DONE, RELEASE),
        (State.NOTIFIED, Input.ABORT): _t(State.ABORTED, RELEASE),
    },
    _absorbing(
        [State.NOTIFIED],
        (Input.PEER_ABORTED, Input.PEER_FAILED, Input.PEER_QUIESCED, Input.DUPLICATE, Input.INCOMPATIBLE),
    ),
    _absorbing([State.NOTIFIED], (Input.DEADLINE, Input.PEER_LOST), ()),
    _target_fencing([Input.PEER_QUIESCED]),
    _fencing_ignores(
        (
            Input.BATCH_LANDED,
            Input.LAST_BATCH_LANDED,
            Input.PEER_ABORTED,
            Input.PEER_FAILED,
            Input.DUPLICATE,
            Input.INCOMPATIBLE,
        )
    ),
    _terminal_common(
        (
            Input.BATCH_LANDED,
            Input.LAST_BATCH_LANDED,
            Input.PEER_ABORTED,
            Input.PEER_FAILED,
            Input.PEER_QUIESCED,
            Input.DUPLICATE,
            Input.INCOMPATIBLE,
        )
    ),
)

# --------------------------------------------------------------------------------------------
# push, prefill side (initiator).  Registration and readiness may come in either order.
# --------------------------------------------------------------------------------------------


def _push_prefill_unpaired(state: State) -> Table:
    """No registration yet, so no WRITE was ever issued: failures release at once."""
    return {
        (state, Input.ABORT): _t(State.ABORTED, RESOLVE, RELEASE),
        (state, Input.DEADLINE): _t(State.EXPIRED, RESOLVE, RELEASE),
        (state, Input.PEER_LOST): _t(State.FAILED, RESOLVE, RELEASE),
        (state, Input.PEER_ABORTED): _t(State.ABORTED, RESOLVE, RELEASE, SEND_QUIESCED),
        (state, Input.PEER_FAILED): _t(State.FAILED, RESOLVE, RELEASE, SEND_QUIESCED),
        (state, Input.INCOMPATIBLE): _t(State.FAILED, RESOLVE, RELEASE, SEND_ABORT, SEND_QUIESCED),
        (state, Input.DUPLICATE): _t(state, IGNORE),
    }


def _push_prefill_writing(state: State) -> Table:
    """Registration known, WRITEs may be in flight: failures wait for them to drain."""
    return {
        (state, Input.OP_SUBMITTED): _t(state),
        (state, Input.OP_COMPLETED): _t(state),
        (state, Input.OP_FAILED): _t(State.FAILING, RESOLVE, SEND_ABORT),
        (state, Input.LAST_OP_FAILED): _t(State.FAILED, RESOLVE, SEND_ABORT, RELEASE, SEND_QUIESCED),
        (state, Input.ABORT): _t(State.ABORTING, RESOLVE, SEND_ABORT),
        (state, Input.DEADLINE): _t(State.EXPIRING, RESOLVE, SEND_ABORT),
        (state, Input.INCOMPATIBLE): _t(State.FAILING, RESOLVE, SEND_ABORT),
        (state, Input.PEER_ABORTED): _t(State.ABORTING, RESOLVE),
        (state, Input.PEER_FAILED): _t(State.FAILING, RESOLVE),
        (state, Input.PEER_LOST): _t(State.FAILED, RESOLVE, RELEASE),
        (state, Input.DUPLICATE): _t(state, IGNORE),
    }


PUSH_PREFILL: Table = _merge(
    {
        (State.PREFILL_RUNNING, Input.REGISTRATION_RECEIVED): _t(State.REGISTERED, SUBMIT),
        (State.PREFILL_RUNNING, Input.KV_READY): _t(State.PREFILL_RUNNING),
        (State.PREFILL_RUNNING, Input.PREFILL_FINISHED): _t(State.PREFILL_READY),
        (State.PREFILL_READY, Input.REGISTRATION_RECEIVED): _t(State.WRITING, SUBMIT),
        (State.REGISTERED, Input.KV_READY): _t(State.REGISTERED, SUBMIT),
        (State.REGISTERED, Input.PREFILL_FINISHED): _t(State.WRITING, SUBMIT),
        (State.REGISTERED, Input.LAST_OP_COMPLETED): _t(State.REGISTERED),  # more batches to come
        (State.WRITING, Input.LAST_OP_COMPLETED): _t(State.NOTIFIED, RESOLVE, RELEASE),
    },
    _push_prefill_unpaired(State.PREFILL_RUNNING),
    _push_prefill_unpaired(State.PREFILL_READY),
    _push_prefill_writing(State.REGISTERED),
    _push_prefill_writing(State.WRITING),
    {
        # Writes done and blocks released; waiting for D's acknowledgement, with a deadline.
        (State.NOTIFIED, Input.PEER_DONE): _t(State.DONE),
        (State.NOTIFIED, Input.DEADLINE): _t(State.DONE),
        (State.NOTIFIED, Input.PEER_LOST): _t(State.DONE),
        (State.NOTIFIED, Input.ABORT): _t(State.NOTIFIED),
        # D gave up just before the last notification reached it: it waits for this fence.
        (State.NOTIFIED, Input.PEER_ABORTED): _t(State.DONE, SEND_QUIESCED),
        (State.NOTIFIED, Input.PEER_FAILED): _t(State.DONE, SEND_QUIESCED),
        (State.NOTIFIED, Input.DUPLICATE): _t(State.NOTIFIED, IGNORE),
        (State.NOTIFIED, Input.INCOMPATIBLE): _t(State.NOTIFIED, IGNORE),
        (State.NOTIFIED, Input.KV_READY): _t(State.NOTIFIED, RETURN_BATCH),
        (State.NOTIFIED, Input.PREFILL_FINISHED): _t(State.NOTIFIED, RETURN_BATCH),
    },
    _initiator_fencing(extra_local=(Input.KV_READY, Input.PREFILL_FINISHED)),
    _fencing_ignores(
        (
            Input.PEER_ABORTED,
            Input.PEER_FAILED,
            Input.PEER_QUIESCED,
            Input.PEER_DONE,
            Input.DUPLICATE,
            Input.INCOMPATIBLE,
        )
    ),
    _absorbing(TERMINAL, (Input.KV_READY, Input.PREFILL_FINISHED), (RETURN_BATCH,)),
    # An initiator that is finished has nothing in flight: answer a late abort with the fence.
    _absorbing(TERMINAL, (Input.PEER_ABORTED, Input.PEER_FAILED), (SEND_QUIESCED,)),
    # A registration for a transfer that ended before it arrived: tell D at once.
    _absorbing(_FAILED_STATES, [Input.REGISTRATION_RECEIVED], (SEND_ABORT, SEND_QUIESCED)),
    _terminal_common((Input.PEER_DONE, Input.PEER_QUIESCED, Input.DUPLICATE, Input.INCOMPATIBLE)),
)

# --------------------------------------------------------------------------------------------
# pull, prefill side (target).  P's blocks are read by D; P may release only once D is fenced.
# --------------------------------------------------------------------------------------------

PULL_PREFILL: Table = _merge(
    {
        (State.PREFILL_RUNNING, Input.KV_READY): _t(State.PREFILL_RUNNING),
        (State.PREFILL_RUNNING, Input.PREFILL_FINISHED): _t(State.PREFILL_READY, Act.SEND_READY),
        # D was never told where to read: release at once.
        (State.PREFILL_RUNNING, Input.ABORT): _t(State.ABORTED, RESOLVE, RELEASE, SEND_ABORT),
        (State.PREFILL_RUNNING, Input.DEADLINE): _t(State.EXPIRED, RESOLVE, RELEASE, SEND_ABORT),
        (State.PREFILL_RUNNING, Input.PEER_ABORTED): _t(State.ABORTED, RESOLVE, RELEASE),
        (State.PREFILL_RUNNING, Input.PEER_FAILED): _t(State.FAILED, RESOLVE, RELEASE),
        (State.PREFILL_RUNNING, Input.PEER_LOST): _t(State.FAILED, RESOLVE, RELEASE),
        (State.PREFILL_RUNNING, Input.DUPLICATE): _t(State.PREFILL_RUNNING, IGNORE),
        # D may be reading: its DONE both acknowledges and fences.
        (State.PREFILL_READY, Input.PEER_DONE): _t(State.DONE, RESOLVE, RELEASE),
        (State.PREFILL_READY, Input.ABORT): _t(State.ABORTING, RESOLVE, SEND_ABORT, QUARANTINE),
        (State.PREFILL_READY, Input.DEADLINE): _t(State.EXPIRING, RESOLVE, SEND_ABORT, QUARANTINE),
        (State.PREFILL_READY, Input.PEER_ABORTED): _t(State.ABORTING, RESOLVE, QUARANTINE),
        (State.PREFILL_READY, Input.PEER_FAILED): _t(State.FAILING, RESOLVE, QUARANTINE),
        (State.PREFILL_READY, Input.PEER_LOST): _t(State.FAILED, RESOLVE, RELEASE),
        (State.PREFILL_READY, Input.DUPLICATE): _t(State.PREFILL_READY, IGNORE),
    },
    # A fence without a notice: D gave up before this side started and the notice was missed.
    # "Nothing in flight" is always safe to hear.
    _absorbing((State.PREFILL_RUNNING, State.PREFILL_READY), [Input.PEER_QUIESCED]),
    _target_fencing([Input.PEER_QUIESCED, Input.PEER_DONE]),
    _fencing_ignores((Input.PEER_ABORTED, Input.PEER_FAILED, Input.DUPLICATE, Input.INCOMPATIBLE)),
    _absorbing(FENCING, (Input.KV_READY, Input.PREFILL_FINISHED), (RETURN_BATCH,)),
    _absorbing(TERMINAL, (Input.KV_READY, Input.PREFILL_FINISHED), (RETURN_BATCH,)),
    _terminal_common(
        (
            Input.PEER_ABORTED,
            Input.PEER_FAILED,
            Input.PEER_QUIESCED,
            Input.PEER_DONE,
            Input.DUPLICATE,
            Input.INCOMPATIBLE,
        )
    ),
)

# --------------------------------------------------------------------------------------------
# pull, decode side (initiator).  D READs P's blocks into its own, then releases P with DONE.
# --------------------------------------------------------------------------------------------

PULL_DECODE: Table = _merge(
    {
        (State.ALLOCATED, Input.READY_RECEIVED): _t(State.READING, SUBMIT),
        # No READ was issued: release at once, and fence P so it can release too.
        (State.ALLOCATED, Input.ABORT): _t(State.ABORTED, RESOLVE, RELEASE, SEND_ABORT, SEND_QUIESCED),
        (State.ALLOCATED, Input.DEADLINE): _t(State.EXPIRED, RESOLVE, RELEASE, SEND_ABORT, SEND_QUIESCED),
        (State.ALLOCATED, Input.INCOMPATIBLE): _t(State.FAILED, RESOLVE, RELEASE, SEND_ABORT, SEND_QUIESCED),
        (State.ALLOCATED, Input.PEER_ABORTED): _t(State.ABORTED, RESOLVE, RELEASE, SEND_QUIESCED),
        (State.ALLOCATED, Input.PEER_FAILED): _t(State.FAILED, RESOLVE, RELEASE, SEND_QUIESCED),
        (State.ALLOCATED, Input.PEER_LOST): _t(State.FAILED, RESOLVE, RELEASE),
        (State.ALLOCATED, Input.DUPLICATE): _t(State.ALLOCATED, IGNORE),
        (State.READING, Input.OP_SUBMITTED): _t(State.READING),
        (State.READING, Input.OP_COMPLETED): _t(State.READING),
        (State.READING, Input.LAST_OP_COMPLETED): _t(State.NOTIFIED, RESOLVE, SEND_DONE),
        (State.READING, Input.OP_FAILED): _t(State.FAILING, RESOLVE, SEND_ABORT),
        (State.READING, Input.LAST_OP_FAILED): _t(State.FAILED, RESOLVE, SEND_ABORT, RELEASE, SEND_QUIESCED),
        (State.READING, Input.ABORT): _t(State.ABORTING, RESOLVE, SEND_ABORT),
        (State.READING, Input.DEADLINE): _t(State.EXPIRING, RESOLVE, SEND_ABORT),
        (State.READING, Input.PEER_ABORTED): _t(State.ABORTING, RESOLVE),
        (State.READING, Input.PEER_FAILED): _t(State.FAILING, RESOLVE),
        (State.READING, Input.PEER_LOST): _t(State.FAILED, RESOLVE, RELEASE),
        (State.READING, Input.DUPLICATE): _t(State.READING, IGNORE),
        (State.NOTIFIED, Input.DELIVERED): _t(State.DONE, RELEASE),
        (State.NOTIFIED, Input.ABORT): _t(State.ABORTED, RELEASE),
        (State.NOTIFIED, Input.PEER_ABORTED): _t(State.NOTIFIED, SEND_QUIESCED),
        (State.NOTIFIED, Input.PEER_FAILED): _t(State.NOTIFIED, SEND_QUIESCED),
    },
    _absorbing([State.NOTIFIED], (Input.DUPLICATE, Input.INCOMPATIBLE, Input.PEER_QUIESCED)),
    _absorbing([State.NOTIFIED], (Input.DEADLINE, Input.PEER_LOST), ()),
    _initiator_fencing(),
    _fencing_ignores((Input.PEER_ABORTED, Input.PEER_FAILED, Input.PEER_QUIESCED, Input.DUPLICATE, Input.INCOMPATIBLE)),
    _absorbing(TERMINAL, (Input.PEER_ABORTED, Input.PEER_FAILED), (SEND_QUIESCED,)),
    # P became ready after D had given up: tell P at once, so it need not wait for its lease.
    _absorbing(_FAILED_STATES, [Input.READY_RECEIVED], (SEND_ABORT, SEND_QUIESCED)),
    _terminal_common((Input.PEER_QUIESCED, Input.DUPLICATE, Input.INCOMPATIBLE)),
)

TABLES: Mapping[tuple[Mode, Role], Table] = {
    (Mode.PUSH, Role.DECODE): PUSH_DECODE,
    (Mode.PUSH, Role.PREFILL): PUSH_PREFILL,
    (Mode.PULL, Role.DECODE): PULL_DECODE,
    (Mode.PULL, Role.PREFILL): PULL_PREFILL,
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


def transition(mode: Mode, role: Role, state: State, input_: Input, transfer: str = "?") -> Transition:
    """Look up what `input_` does in `state`.

    :raises InvalidTransition: the table has no entry; nothing changes.
    """
    try:
        return TABLES[(mode, role)][(state, input_)]
    except KeyError:
        raise InvalidTransition(transfer, state.name, input_.name) from None
