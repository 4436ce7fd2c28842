"""The words the transfer tables are written in: modes, roles, states, inputs, effects, outcomes.

Why apart from the tables: every layer speaks these names (the core, messages on the wire, the
runtime's results, the vLLM connector), while only the tables (`kvflow.protocol.transfer_tables`)
decide which state follows which input.  `kvflow.protocol.state` re-exports them all.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class _Word(enum.Enum):
    """Members are singletons compared by identity, so identity is also their hash: the tables
    are looked up on every input, and `Enum.__hash__` (hashing the name, in Python) showed up
    first in profiles of the control plane."""

    __hash__ = object.__hash__


__all__ = ("ADDRESSED", "Effect", "Condition", "Input", "Mode", "Outcome", "Role", "State", "Transition")


class Mode(_Word):
    PUSH = "push"
    PULL = "pull"


class Role(_Word):
    PREFILL = "prefill"
    DECODE = "decode"


class State(_Word):
    # decode side
    ALLOCATED = "allocated"  # destination blocks held, registration not sent yet
    REGISTERED = "registered"  # push: D sent its registration / P received it, prefill running
    # prefill side
    PREFILL_RUNNING = "prefill_running"
    PREFILL_READY = "prefill_ready"  # all KV ready; push: waiting for registration, pull: D may read
    # data movement
    WRITING = "writing"
    READING = "reading"
    NOTIFIED = "notified"  # D: every batch landed (or read); the transfer succeeded
    # push P: every WRITE completed and its blocks are back; the verdict is D's, still to come
    WRITTEN = "written"
    # push P: D's verdict (done) came before its own WRITEs completed here; blocks still held
    CONFIRMED = "confirmed"
    DONE = "done"
    # outcome decided, blocks quarantined until the peer's ops are fenced
    ABORTING = "aborting"
    FAILING = "failing"
    EXPIRING = "expiring"
    # terminal
    ABORTED = "aborted"
    FAILED = "failed"
    EXPIRED = "expired"


class Input(_Word):
    # from the embedding engine
    REGISTER = "register"  # D: the peer is reachable: send the registration (push) or the claim (pull)
    KV_READY = "kv_ready"  # P: a batch of KV (a chunk or some layers) is ready
    PREFILL_FINISHED = "prefill_finished"  # P: the last batch is ready
    DELIVERED = "delivered"  # D: the consumer took the blocks
    ABORT = "abort"
    # from the clock and liveness
    DEADLINE = "deadline"
    PEER_LOST = "peer_lost"  # fed only after the peer was torn down: nothing of it can land
    # ... or, when it was torn down for falling silent on a transport that cannot fence its
    # one-sided ops, what it wrote or reads may still land: see `Effect.HOLD_FOR_FENCE`
    PEER_LOST_UNFENCED = "peer_lost_unfenced"
    # from the data plane, about this engine's own ops
    OP_SUBMITTED = "op_submitted"
    OP_COMPLETED = "op_completed"  # others still in flight
    LAST_OP_COMPLETED = "last_op_completed"  # none in flight any more
    OP_FAILED = "op_failed"
    LAST_OP_FAILED = "last_op_failed"
    OPS_DRAINED = "ops_drained"  # entered a fencing state with nothing in flight
    NOTHING_TO_LAND = "nothing_to_land"  # push D registered no block: its registration was its verdict
    # from the peer
    REGISTRATION_RECEIVED = "registration_received"
    READY_RECEIVED = "ready_received"
    CLAIM_RECEIVED = "claim_received"  # pull P: the transfer's decode peer asks where to read
    BATCH_LANDED = "batch_landed"  # a WRITE notification, more batches expected
    LAST_BATCH_LANDED = "last_batch_landed"
    PEER_ABORTED = "peer_aborted"
    PEER_FAILED = "peer_failed"
    PEER_QUIESCED = "peer_quiesced"  # the initiator has nothing in flight and will issue nothing
    PEER_DONE = "peer_done"  # D is done with the transfer (push: ack, pull: release)
    DUPLICATE = "duplicate"  # a message already seen for this transfer and epoch
    INCOMPATIBLE = "incompatible"  # the peer's request cannot be served (sizes, counts, ranges)


class Effect(_Word):
    """What a table row says to do, by name; the core turns each into concrete `Action`s with
    their payloads (which message, which blocks)."""

    SEND_REGISTRATION = "send_registration"
    SEND_READY = "send_ready"
    SEND_CLAIM = "send_claim"  # pull D: ask P for the transfer (P may not know this side yet)
    SUBMIT_PENDING = "submit_pending"  # submit an op for every ready, unsubmitted batch
    SEND_ABORT = "send_abort"  # notice carrying this machine's outcome and reason
    SEND_QUIESCED = "send_quiesced"
    SEND_DONE = "send_done"
    RESOLVE = "resolve"  # the outcome is known: tell whoever waits
    QUARANTINE = "quarantine"  # blocks stay held until the peer is fenced
    RELEASE = "release"  # give every block this machine holds back to its owner
    # target of a lost peer's ops (D in push, P in pull): the blocks it may still write or read
    # stay quarantined until the peer is fenced (`TransferCore.peer_fenced`); nothing held: RELEASE
    HOLD_FOR_FENCE = "hold_for_fence"
    RETURN_BATCH = "return_batch"  # a batch that arrived too late goes straight back
    DECLARE_PEER_LOST = "declare_peer_lost"
    IGNORE = "ignore"  # a late, duplicate or stray message: count it, do nothing


# Effects addressed to the machine's peer.  A machine whose peer is not known yet (a pull
# transfer nobody has claimed, a push prefill D has not registered) has nobody to write to or
# tell: the effect does nothing there and is counted (`CoreStats.unaddressed`).
ADDRESSED = frozenset(
    {
        Effect.SUBMIT_PENDING,
        Effect.SEND_REGISTRATION,
        Effect.SEND_READY,
        Effect.SEND_CLAIM,
        Effect.SEND_ABORT,
        Effect.SEND_QUIESCED,
        Effect.SEND_DONE,
    }
)


class Condition(_Word):
    """A fact about a machine that the tables cannot see and the core can: see `STATE_TRIGGERED`."""

    NOTHING_IN_FLIGHT = "nothing_in_flight"  # none of this machine's own ops is in flight
    # push: D's registration names no block (a full prefix-cache hit on D): nothing is written
    NOTHING_WANTED = "nothing_wanted"
    UNCLAIMED = "unclaimed"  # no peer has claimed this transfer: nobody can have an op on it


class Outcome(_Word):
    SUCCEEDED = "succeeded"
    ABORTED = "aborted"
    FAILED = "failed"
    EXPIRED = "expired"


class Transition(NamedTuple):
    target: State
    effects: tuple[Effect, ...]
