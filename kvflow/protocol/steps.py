"""Carrying out a transfer machine's steps: what each effect of its table does to one engine's state.

Why its own module: the tables (`kvflow.protocol.state`) decide what a transfer does next, and
`TransferCore` decides which input a local call, a deadline or an op's completion becomes.
Between the two lies one concern with records of its own: feeding an input and carrying out the
step the table selects.  That is resolving the transfer, releasing, returning or quarantining
its blocks (a torn-down peer's target blocks are held until the peer is fenced), numbering the
ops it submits and finding their transfer again when they finish, re-timing the machine and
counting its end, and following the state-triggered hops.  Every input, whatever its source,
reaches a machine through `StepRunner.feed`, so each effect means the same thing wherever it
came from.  Pure code: time is an argument.
"""

from __future__ import annotations

from collections.abc import Callable

from kvflow.protocol.actions import Action, DeclarePeerLost, ReleaseBlocks, Resolve, SendMessage, SubmitOp
from kvflow.protocol.machine import Machine
from kvflow.protocol.messages import Claim, Done, Notice, Quiesced, Ready, Registration
from kvflow.protocol.state import (
    Effect,
    Input,
    Outcome,
    State,
    outcome_of,
    state_triggered,
    transition,
)
from kvflow.protocol.transfer_tables import ACTIVE, FENCING, TERMINAL
from kvflow.protocol.transfers import CoreConfig, CoreStats, Owner, TransferStore
from kvflow.protocol.vocabulary import ADDRESSED

__all__ = ("StepRunner",)


class StepRunner:
    """Feeds inputs to one core's machines and carries out their steps; keeps the records the
    steps make: the ops in flight (by op id) and, per torn-down peer, the machines whose target
    blocks wait for `fenced`."""

    def __init__(
        self,
        store: TransferStore,
        stats: CoreStats,
        num_layers: int,
        ratio_of: Callable[[str], int],
        config_of: Callable[[], CoreConfig],
    ) -> None:
        """`ratio_of(peer)`: its block size over this side's or this side's over its (the larger
        over the smaller), as `TransferCore.peer_connected` was told.  `config_of()`: the core's
        config as it stands (its fence timeout bounds each fencing state)."""
        self.store = store
        self.ledger = store.ledger
        self.stats = stats
        self.config_of = config_of
        self.num_layers = num_layers
        self.ratio_of = ratio_of
        self._ops: dict[int, Owner] = {}
        self._next_op = 1
        # target blocks of torn-down peers that the peer's late one-sided ops may still reach
        self._unfenced: dict[str, list[Machine]] = {}

    # ------------------------------------------------------------------ ops and fences

    def op_submitted(self, op_id: int, now: float) -> list[Action]:
        """The op `op_id` was handed to the transport (see `TransferCore.op_submitted`)."""
        owner = self._ops.get(op_id)
        m = self.store.get_owner(owner) if owner is not None else None
        if m is None or op_id not in m.inflight:
            return []
        return self.feed(m, Input.OP_SUBMITTED, now)

    def op_finished(self, op_id: int, now: float, error: str | None = None) -> list[Action]:
        """The op `op_id` completed or failed (see `TransferCore.op_finished`)."""
        owner = self._ops.pop(op_id, None)
        m = self.store.get_owner(owner) if owner is not None else None
        if m is None or op_id not in m.inflight:
            return []
        m.inflight.discard(op_id)
        last = not m.inflight
        if error is None:
            input_ = Input.LAST_OP_COMPLETED if last else Input.OP_COMPLETED
        else:
            input_ = Input.LAST_OP_FAILED if last else Input.OP_FAILED
        return self.feed(m, input_, now, reason=error or "")

    def op_owner(self, op_id: int) -> Owner | None:
        """The transfer and side the op `op_id` runs for (None: no such op in flight)."""
        return self._ops.get(op_id)

    def forgotten(self, machines: list[Machine]) -> None:
        """The store forgot these finished machines: so do the op records of any still in flight."""
        for m in machines:
            for op in m.inflight:
                self._ops.pop(op, None)

    def fenced(self, peer: str) -> list[Action]:
        """Release the target blocks kept for `peer` until it was fenced (see `TransferCore.peer_fenced`)."""
        actions: list[Action] = []
        for m in self._unfenced.pop(peer, []):
            blocks = self.ledger.release(m.owner)
            m.released.update(blocks)
            if blocks:
                actions.append(ReleaseBlocks(m.key, m.role, blocks, m.outcome or Outcome.FAILED))
        return actions

    def unfenced(self, peer: str) -> bool:
        """Whether target blocks of `peer`'s torn-down transfers wait for `fenced`."""
        return peer in self._unfenced

    # ------------------------------------------------------------------ steps

    def feed(
        self, m: Machine, input_: Input, now: float, *, reason: str = "", returned: tuple[int, ...] = ()
    ) -> list[Action]:
        """Feed one input to `m`, carry out the step and the hops it triggers, and return the
        actions decided.  `returned`: the blocks of a batch the step may give back unwritten.

        :raises InvalidTransition: the machine's table does not allow `input_` in its state.
        """
        step = transition(m.mode, m.role, m.state, input_, str(m.key))
        old, m.state = m.state, step.target
        actions: list[Action] = []
        for effect in step.effects:
            self._apply(m, effect, now, reason, returned, actions)
        if step.target is not old or input_ is Input.DEADLINE:
            self._retime(m, old, input_, now)
        triggered = state_triggered(m.mode, m.role, m.state, m.holds)
        if triggered is not None:
            actions += self.feed(m, triggered, now)  # which looks again: until no hop applies
        return actions

    def _retime(self, m: Machine, old: State, input_: Input, now: float) -> None:
        target = m.state
        if target in ACTIVE:
            self.store.set_timer(m, m.deadline)
        elif target in FENCING and (old not in FENCING or input_ is Input.DEADLINE):
            self.store.set_timer(m, now + self.config_of().fence_timeout)
        elif target is State.WRITTEN:
            self.store.set_timer(m, now + self.config_of().fence_timeout)  # wait for D's verdict
        elif target not in FENCING:
            self.store.set_timer(m, None)
        if target in TERMINAL and old not in TERMINAL:
            self.forgotten(self.store.ended(m, now))
            if m.outcome is Outcome.SUCCEEDED or (m.outcome is None and target is State.DONE):
                self.stats.completed += 1
            else:
                self.stats.failed += 1

    def _apply(
        self, m: Machine, effect: Effect, now: float, reason: str, returned: tuple[int, ...], out: list[Action]
    ) -> None:
        key = m.key
        if effect is Effect.IGNORE:
            self.stats.ignored += 1
        elif effect is Effect.RESOLVE:
            outcome = outcome_of(m.state) or Outcome.FAILED  # RESOLVE only leads to decided states
            m.outcome = outcome
            m.reason = reason or ("ok" if outcome is Outcome.SUCCEEDED else m.state.value)
            out.append(Resolve(key, m.role, outcome, m.reason))
        elif effect is Effect.QUARANTINE:
            self.ledger.quarantine(m.owner)
        elif effect is Effect.HOLD_FOR_FENCE and m.peer is not None and self.ledger.holds(m.owner):
            # the torn-down peer may still write (push) or read (pull) these blocks
            self.ledger.quarantine(m.owner)
            self._unfenced.setdefault(m.peer, []).append(m)
        elif effect is Effect.RELEASE or effect is Effect.HOLD_FOR_FENCE:  # (holding nothing: nothing to hold)
            blocks = self.ledger.release(m.owner)
            m.released.update(blocks)
            if blocks:
                out.append(ReleaseBlocks(key, m.role, blocks, m.outcome or Outcome.SUCCEEDED))
        elif effect is Effect.RETURN_BATCH:
            # A batch that will never be written: it joins the hold while the hold may still be
            # read by an op in flight (and leaves with it), else it goes back now.  Either way
            # each block of the transfer is released once.
            if self.ledger.holds(m.owner):
                self.ledger.add(m.owner, returned)
            else:
                fresh = tuple(dict.fromkeys(b for b in returned if b not in m.released))
                m.released.update(fresh)
                if fresh:
                    out.append(ReleaseBlocks(key, m.role, fresh, m.outcome or Outcome.ABORTED))
        elif effect is Effect.DECLARE_PEER_LOST:
            if m.peer is not None:
                out.append(
                    DeclarePeerLost(m.peer, f"no fence from peer for {key} within {self.config_of().fence_timeout}s")
                )
        elif m.peer is None:
            assert effect in ADDRESSED, effect  # every other effect was handled above
            self.stats.unaddressed += 1
        elif effect is Effect.SUBMIT_PENDING:
            self._submit(m, out)
        elif effect is Effect.SEND_REGISTRATION:
            ttl = max(m.deadline - now, 0.0)
            out.append(SendMessage(m.peer, Registration(key, m.block_ids, m.expected_batches, ttl, m.first_position)))
        elif effect is Effect.SEND_READY:
            out.append(SendMessage(m.peer, Ready(key, *m.pull_source_blocks())))
        elif effect is Effect.SEND_CLAIM:
            out.append(SendMessage(m.peer, Claim(key)))
        elif effect is Effect.SEND_ABORT:
            outcome = m.outcome or outcome_of(m.state) or Outcome.FAILED
            out.append(SendMessage(m.peer, Notice(key, outcome, m.reason or reason)))
        elif effect is Effect.SEND_QUIESCED:
            out.append(SendMessage(m.peer, Quiesced(key)))
        elif effect is Effect.SEND_DONE:
            out.append(SendMessage(m.peer, Done(key)))

    def _submit(self, m: Machine, out: list[Action]) -> None:
        if m.peer is None:
            return  # the table submits only once the peer's blocks are known
        for kind, local, remote, layers, note, fine_start in m.due_ops(self.ratio_of(m.peer), self.num_layers):
            op_id, self._next_op = self._next_op, self._next_op + 1
            self._ops[op_id] = m.owner
            m.inflight.add(op_id)
            out.append(SubmitOp(op_id, m.key, m.peer, kind, local, remote, layers, note, fine_start))
