"""The sans-IO transfer core: every machine, the block ledger and the deadlines of one engine.

Why sans-IO: the rules that keep KV safe (release once, never while a write may land, fence
stale epochs, honour every deadline) must be testable exhaustively.  So this class does no I/O
and reads no clock.  It is driven by three kinds of sources, as in aioquic:

1. local API calls (`expect`, `kv_ready`, `abort`, each taking its typed request from
   `kvflow.protocol.requests`, and `delivered`),
2. events from the wire and the data plane (`receive`, `notification`, `op_submitted`,
   `op_finished`, `peer_connected`, `peer_lost`),
3. time: `timer(now)` when `next_deadline()` has passed.

Each call takes `now` and returns a list of actions (`kvflow.protocol.actions`).  Local misuse raises a
`KVFlowError` and changes nothing.  Whatever a peer sends never raises: an unexpected message is
counted in `stats` and ignored, because a peer's bug must not crash this engine.

The records themselves (machines, epochs, the deadline heap, early messages, block accounts)
live in a `TransferStore`; peers' messages are refined by a `PeerInbox`, which reaches the core
only through that store and `feed`.  Every input reaches its machine through a `StepRunner`,
which carries out the step the table selects (releases, quarantines and fence holds, submitted
ops, messages, timers) and keeps the op and fence records those steps make; this class decides
which input each call, deadline or op completion becomes.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.errors import ConfigError, StaleEpoch, UnknownTransfer
from kvflow.layout.groups import KVGroup, check_groups
from kvflow.protocol.actions import Action, SendMessage
from kvflow.protocol.inbox import PeerInbox
from kvflow.protocol.machine import Machine, check_block_ids, check_registration, ready_batch, transfer_layers
from kvflow.protocol.messages import Message, Notice, TransferKey
from kvflow.protocol.requests import Abort, Expect, KvReady
from kvflow.protocol.state import (
    Effect,
    Input,
    Mode,
    Outcome,
    Role,
    State,
    initial_state,
    transition,
)
from kvflow.protocol.steps import StepRunner
from kvflow.protocol.transfer_tables import ACTIVE, FENCING, TERMINAL
from kvflow.protocol.transfers import CoreConfig, CoreStats, Owner, TransferStore

__all__ = ("CoreConfig", "CoreStats", "TransferCore")


_DECODE, _PREFILL = Role.DECODE, Role.PREFILL


class TransferCore:
    def __init__(
        self, engine_id: str, num_layers: int, config: CoreConfig | None = None, groups: Sequence[KVGroup] = ()
    ) -> None:
        """`groups`: KV cache groups, each layers moved with blocks of their own (default: one).
        :raises ConfigError: no layers, or groups that do not cover the layers in order."""
        if num_layers <= 0:
            raise ConfigError(f"num_layers must be > 0, got {num_layers}")
        self.groups = check_groups(groups, num_layers)
        self.engine_id = engine_id
        self.num_layers = num_layers
        self.config = config or CoreConfig()
        self.store = TransferStore(self.config)
        self.ledger = self.store.ledger
        self.stats = CoreStats()
        self._connected: set[str] = set()
        self._ratios: dict[str, int] = {}  # a peer's blocks hold this many of the other side's
        self._refused: dict[str, str] = {}  # peers whose handshake was refused for good, and why
        ratio_of, config_of = (lambda peer: self._ratios.get(peer, 1)), (lambda: self.config)
        self._steps = StepRunner(self.store, self.stats, num_layers, ratio_of, config_of)
        self._inbox = PeerInbox(self.store, self.stats, num_layers, self.feed, lambda peer: self._ratios.get(peer, 1))

    # ------------------------------------------------------------------ introspection

    def machine(self, key: TransferKey, role: Role) -> Machine:
        """:raises UnknownTransfer: no such machine (or it was already forgotten)."""
        return self.store.machine(key, role)

    def machines(self) -> list[Machine]:
        return self.store.machines()

    def registered(self, key: TransferKey) -> tuple[int, ...]:
        """The blocks D registered for `key` while that transfer still takes WRITEs (none: no
        such transfer on D, or it is winding down or over: its blocks may be another's soon).
        Never raises."""
        m = self.store.get(key, Role.DECODE)
        return m.block_ids if m is not None and m.state in ACTIVE else ()

    def live(self) -> list[Machine]:
        """Machines not yet terminal (including D's NOTIFIED awaiting delivery)."""
        return self.store.live()

    def live_count(self) -> int:
        """How many machines `live()` would return, without building the list."""
        return self.store.live_count()

    def finished_count(self) -> int:
        """How many finished machines are kept (at most `CoreConfig.max_finished`)."""
        return self.store.finished_count()

    def next_deadline(self) -> float | None:
        return self.store.next_deadline()

    def op_owner(self, op_id: int) -> Owner | None:
        """The transfer and side an op submitted here runs for (None: no such op in flight)."""
        return self._steps.op_owner(op_id)

    # ------------------------------------------------------------------ local API

    def expect(self, request: Expect, now: float, deadline: float) -> list[Action]:
        """D: the destination blocks of `request` will receive transfer `request.key` from its
        peer, until `deadline`, for P's block positions ``first_position..`` (in D's blocks): D
        holds the KV of the positions before (a prefix-cache hit), so P writes (pull: D reads)
        none of them.  Push: `expected_batches` counts P's batches that reach D's positions
        (each is one WRITE); `OPEN_BATCHES` lets P decide how many (P's last WRITE's
        notification says it is the last, and the transfer completes when every batch up to it
        has landed).  No blocks (push only, with `expected_batches` 0): D needs nothing; P is
        told so and releases at once, and the transfer succeeds here as soon as the registration
        is sent.  Transfers naming the same non-empty `share` group may hold the same blocks
        (each writes its own part of them: a tensor-parallel rank's KV heads).  `layers`: the
        blocks' KV cache group (None: the one).  The request's `timeout` is the driver's: it
        made `deadline` of it.

        An older, unfinished epoch of the same transfer id is aborted (superseded).

        :raises InvalidBatch: the block list is empty in pull mode (or with WRITEs expected),
            repeats a block, or has a bad id; a negative first position; `layers` are not one KV
            cache group's.
        :raises BlockConflict: a block is held or quarantined by another transfer.
        :raises StaleEpoch: this epoch is not newer than one already seen for the id.
        :raises ConfigError: bad deadline or batch count.
        """
        key, mode, peer, first_position = request.key, request.mode, request.peer, request.first_position
        max_batches = self.config.max_batches
        ids = check_registration(key, request.block_ids, mode, request.expected_batches, first_position, max_batches)
        span = transfer_layers(f"expect {key}", self.groups, request.layers or (0, self.num_layers), Mode.PULL)
        if deadline <= now:
            raise ConfigError(f"deadline {deadline} is not after now {now}")
        self._check_epoch(key, _DECODE)
        self.ledger.check_free(ids, request.share)
        actions = self._supersede(key, _DECODE, now)
        m = self.store.create(key, _DECODE, mode, peer, deadline, now)
        m.block_ids, m.expected_batches, m.first_position, m.span = ids, request.expected_batches, first_position, span
        self.ledger.add(m.owner, ids, request.share)
        actions += self._replay_early(m, now)
        if peer in self._connected and m.state is State.ALLOCATED and m.remote_blocks is None:
            actions += self._steps.feed(m, Input.REGISTER, now)
        return actions

    def kv_ready(self, request: KvReady, now: float, deadline: float | None = None) -> list[Action]:
        """P: KV for block positions ``first_position..`` of the request's `layers` (None: all)
        is ready in its `block_ids`.  A transfer moves one KV cache group: every batch's layers
        lie in it.  `final` marks the last batch.  The first call creates the machine, with
        `deadline`, unless D's registration already did.  Pull without a `peer`: the KV waits,
        until `deadline`, for the first peer to claim the transfer (see `Claim`).  The request's
        `timeout` is the driver's: it made `deadline` of it.

        :raises InvalidBatch: bad ids or layers (see `ready_batch`), overlap with an earlier batch.
        :raises InvalidTransition: the transfer cannot take KV now (e.g. after its last batch).
        :raises StaleEpoch: a newer epoch of the id exists.
        :raises ConfigError: missing deadline, or mode differs from the transfer's.
        """
        key, mode, peer, final = request.key, request.mode, request.peer, request.final
        ids = check_block_ids(request.block_ids, f"kv_ready {key}", unique=False)
        span = request.layers if request.layers is not None else (0, self.num_layers)
        group = transfer_layers(f"kv_ready {key}", self.groups, span, mode, request.first_position)
        m = self.store.get(key, _PREFILL)
        if m is None:
            if deadline is None or deadline <= now:
                raise ConfigError(f"kv_ready {key}: a new transfer needs a deadline after now")
            self._check_epoch(key, _PREFILL)
        elif m.mode is not mode:
            raise ConfigError(f"kv_ready {key}: transfer is {m.mode.value}, not {mode.value}")
        elif peer is not None and m.peer not in (None, peer):
            raise ConfigError(f"kv_ready {key}: transfer's peer is {m.peer}, not {peer}")
        input_ = Input.PREFILL_FINISHED if final else Input.KV_READY
        state = m.state if m is not None else initial_state(_PREFILL)
        step = transition(mode, _PREFILL, state, input_, str(key))
        consumed = Effect.RETURN_BATCH not in step.effects
        pull_final = consumed and mode is Mode.PULL and final
        batch = ready_batch(key, m, ids, request.first_position, (span, group), self.config.max_batches, pull_final)
        # Validated: from here on nothing raises for the caller's input.
        actions: list[Action] = []
        if m is None:
            actions = self._supersede(key, _PREFILL, now)
            m = self.store.create(key, _PREFILL, mode, peer, deadline or now, now)
            actions += self._replay_early(m, now)  # D may have given up before P started
            consumed = Effect.RETURN_BATCH not in transition(mode, _PREFILL, m.state, input_).effects
        if not consumed:
            return actions + self._steps.feed(m, input_, now, returned=ids)
        if m.peer is None and peer is not None:
            self.store.set_peer(m, peer)
        self.store.mark_started(m)
        m.span = group
        ratio = self._ratios.get(m.peer, 1) if m.peer is not None else 1
        mismatch = m.push_mismatch(batch, final=final, ratio=ratio)
        m.batches.append(batch)
        m.final_seen = final
        self.ledger.add(m.owner, ids)
        if mismatch is not None:
            batch.submitted = True  # never write a batch of a transfer that cannot complete
            return actions + self._steps.feed(m, Input.INCOMPATIBLE, now, reason=mismatch)
        actions += self._steps.feed(m, input_, now)
        if m.peer in self._refused and m.state in ACTIVE:  # named after its handshake was refused
            actions += self._steps.feed(m, Input.PEER_LOST, now, reason=f"peer {m.peer} lost: {self._refused[m.peer]}")
        return actions

    def abort(self, request: Abort, now: float) -> list[Action]:
        """Give up on transfer `request.key` as `request.role`.  Idempotent once the transfer has
        ended.

        P may abort a transfer it has not seen yet (its request ended before D's registration
        arrived): the transfer is then remembered as aborted, and a registration for it, if one
        comes within `retention`, is answered with the abort and the fence at once.

        D may abort a transfer it never registered (its request ended while still queued, before
        any block was allocated) when it names the transfer's `peer` and `mode`: the transfer is
        remembered as aborted and the peer is told, so that P frees its blocks at once instead of
        holding them to its deadline.

        :raises UnknownTransfer: D has no such transfer and `peer` is None.
        :raises StaleEpoch: a newer epoch of the transfer id exists.
        """
        key, role, reason, peer, mode = request.key, request.role, request.reason, request.peer, request.mode
        self.store.drop_promise(key)
        m = self.store.get(key, role)
        if m is not None:
            return self._steps.feed(m, Input.ABORT, now, reason=reason)
        if role is _DECODE and peer is None:
            raise UnknownTransfer(f"no {role.value} transfer {key}")
        self._check_epoch(key, role)
        if role is _PREFILL:
            mode, peer = Mode.PUSH, None
        m = self.store.create(key, role, mode, peer, now + self.config.retention, now)
        actions = self._steps.feed(m, Input.ABORT, now, reason=reason)
        if role is _DECODE and peer is not None:  # nothing was registered, so nothing can land
            actions.append(SendMessage(peer, Notice(key, Outcome.ABORTED, reason)))
        return actions

    def delivered(self, key: TransferKey, now: float) -> list[Action]:
        """D: the consumer has taken the blocks of a NOTIFIED transfer.

        :raises UnknownTransfer: no such transfer.
        :raises InvalidTransition: the transfer is not NOTIFIED.
        """
        return self._steps.feed(self.machine(key, _DECODE), Input.DELIVERED, now)

    def unsent(self, key: TransferKey, now: float, reason: str) -> list[Action]:
        """A message about `key` could not be encoded (a value the wire cannot carry, a frame
        too large): the transfer fails here, with `reason`, and nothing else does.  Whichever
        side of it this engine holds is aborted (the peer is told, as for any abort)."""
        actions: list[Action] = []
        for role in (_DECODE, _PREFILL):
            m = self.store.get(key, role)
            if m is not None and m.state not in TERMINAL:
                actions += self._steps.feed(m, Input.ABORT, now, reason=reason)
        return actions

    def abort_all(self, now: float, reason: str) -> list[Action]:
        actions: list[Action] = []
        for m in self.live():
            actions += self._steps.feed(m, Input.ABORT, now, reason=reason)
        return actions

    # ------------------------------------------------------------------ peers and time

    def peer_connected(self, peer: str, now: float, block_ratio: int = 1) -> list[Action]:
        """The control channel to `peer` is up: send registrations that were waiting for it.
        `block_ratio`: the larger of the two sides' block sizes over the smaller (P's blocks land
        in D's at token offsets, `block_ratio` per D block)."""
        self._connected.add(peer)
        self._refused.pop(peer, None)
        self._ratios[peer] = max(1, block_ratio)
        actions: list[Action] = []
        for m in self.store.live():
            if m.peer == peer and m.state is State.ALLOCATED and m.role is _DECODE:
                actions += self._steps.feed(m, Input.REGISTER, now)
        return actions

    def peer_lost(
        self, peer: str, now: float, why: str = "", *, unfenced: bool = False, refused: bool = False
    ) -> list[Action]:
        """`peer` was declared dead *and torn down*: its transfers fail; `why` (the teardown's
        reason, or the peer's own) ends each failed transfer's reason.  `refused`: its handshake
        was refused for good, so a transfer naming it later fails at once too (until it connects).

        Without `unfenced`, nothing the peer issued can still land here, so their blocks go back.
        With it, the peer's one-sided ops may still land (a WRITE held in a TCP connection the
        teardown could not close lands when the link comes back): the blocks of transfers this
        side is the *target* of (D in push, P in pull) stay quarantined until `peer_fenced`.
        """
        if refused:
            self._refused[peer] = why
            while len(self._refused) > self.config.max_peer_early:  # the oldest names go first
                del self._refused[next(iter(self._refused))]
        self._connected.discard(peer)
        self._ratios.pop(peer, None)
        # What the peer said about transfers not started here refers to blocks its teardown
        # has released: forget it.
        self.store.early.drop_from(peer)
        actions: list[Action] = []
        lost = Input.PEER_LOST_UNFENCED if unfenced else Input.PEER_LOST
        for m in self.store.live():
            if m.peer == peer and m.state not in TERMINAL:
                unheard = " before its verdict on the written KV" if m.state is State.WRITTEN else ""
                reason = f"peer {peer} lost{unheard}{f': {why}' if why else ''}"
                actions += self._steps.feed(m, lost, now, reason=reason)
        return actions

    def peer_fenced(self, peer: str) -> list[Action]:
        """Nothing `peer` issued before its teardown can land any more: release the target
        blocks `peer_lost(..., unfenced=True)` kept.  Unknown peers are ignored."""
        return self._steps.fenced(peer)

    def unfenced(self, peer: str) -> bool:
        """Whether target blocks of `peer`'s torn-down transfers wait for `peer_fenced`."""
        return self._steps.unfenced(peer)

    def renew(self, peer: str, keys: Sequence[TransferKey], now: float, lease: float) -> list[Action]:
        """`peer` still has these transfers in hand (its heartbeat listed them): hold each one's
        deadline at least `lease` past `now`, but never past `max_hold` after the transfer
        opened here (such a renewal is cut short and counted in `stats.capped_renewals`).

        As P this is D waiting on the transfer (P keeps its blocks); as D it is P holding the
        transfer's request, queued or prefilling (D keeps waiting for the KV).  Keys of other
        peers' transfers, unknown ones and finished ones are ignored."""
        for key in keys:
            for role in (_PREFILL, _DECODE):
                m = self.store.get(key, role)
                if m is not None and m.peer == peer and m.state in ACTIVE and not self.store.extend(m, now + lease):
                    self.stats.capped_renewals += 1
        return []

    def waiting_on(self, peer: str) -> tuple[TransferKey, ...]:
        """The transfers this side, as D, still waits on from `peer` (what a heartbeat renews)."""
        return tuple(m.key for m in self.store.live() if m.role is _DECODE and m.peer == peer and m.state in ACTIVE)

    def promise(self, key: TransferKey, peer: str, now: float) -> None:
        """This engine holds the request of transfer `key` for `peer`: P's queued or
        prefilling, or D's queued before its blocks are allocated.

        Heartbeats to `peer` list it (`heartbeat_keys`) until the transfer ends or is aborted
        here (P), starts here (D: its transfer is then listed while it waits), or `max_hold`
        has passed, so that the peer's deadline for it does not run out while the request waits
        in a long queue: D's wait for P's KV, or P's hold on KV it made ready before D could
        register.  Repeated promises keep the first one's time."""
        self.store.promise(key, peer, now)

    def heartbeat_keys(self, peer: str, now: float) -> tuple[TransferKey, ...]:
        """What a heartbeat to `peer` lists: the transfers this side waits on from it (as D) and
        those whose request it holds for it (`promise`; promises that ended are left out).  A query."""
        return self.waiting_on(peer) + self.store.live_promises(peer, now, self.config.max_hold)

    def timer(self, now: float) -> list[Action]:
        """Feed DEADLINE to every machine whose timer has passed; forget old finished ones and
        promises that ended."""
        actions: list[Action] = []
        self._steps.forgotten(self.store.forget_finished(now))
        self.store.expire_promises(now, self.config.max_hold)
        while (due := self.store.pop_due(now)) is not None:
            when, m, gen = due
            if m is None:
                continue
            if m.timer_gen == gen and m.timer_at == when:
                m.timer_at = None
                if m.state in FENCING:
                    reason = "fence timed out"
                elif m.state is State.WRITTEN:
                    reason = f"written, but no verdict from the decode side within {self.config.fence_timeout}s"
                else:
                    reason = "deadline reached"
                actions += self._steps.feed(m, Input.DEADLINE, now, reason=reason)
        return actions

    # ------------------------------------------------------------------ data plane

    def op_submitted(self, op_id: int, now: float) -> list[Action]:
        return self._steps.op_submitted(op_id, now)

    def op_finished(self, op_id: int, now: float, error: str | None = None) -> list[Action]:
        """An op this engine submitted completed (`error` None) or failed.  Per the transport
        contract, either way it will not touch memory any more."""
        return self._steps.op_finished(op_id, now, error)

    def notification(self, peer: str, payload: bytes, now: float, problem: str | None = None) -> list[Action]:
        """A WRITE notification arrived from `peer` (push, on D); with a `problem` (the bytes it
        announces are not what P wrote), it fails its transfer instead of counting.  Never raises.

        Deadlines that passed before `now` are honoured first: a notification handled after a
        transfer's deadline (the engine was stopped, or busy) comes too late for it.
        """
        return self.timer(now) + self._inbox.notification(peer, payload, now, problem)

    # ------------------------------------------------------------------ control messages

    def receive(self, peer: str, message: Message, now: float) -> list[Action]:
        """A control message from `peer`.  Never raises for anything the peer sent.

        Unlike a notification, a message is taken before the deadlines that passed meanwhile:
        a P that was stopped while D's acknowledgement waited for it takes D's verdict instead
        of failing the transfer for a fence timeout that ran out while it was stopped.
        """
        return self._inbox.receive(peer, message, now)

    # ------------------------------------------------------------------ machinery

    def _check_epoch(self, key: TransferKey, role: Role) -> None:
        seen = self.store.epochs(key.transfer_id, role)
        if seen and max(seen) >= key.epoch:
            raise StaleEpoch(f"{role.value} transfer {key}: the id already has epoch {max(seen)}")

    def _supersede(self, key: TransferKey, role: Role, now: float) -> list[Action]:
        actions: list[Action] = []
        for epoch in sorted(self.store.epochs(key.transfer_id, role)):
            old = self.store.machine(TransferKey(key.transfer_id, epoch), role)
            if old.state in ACTIVE:
                actions += self._steps.feed(old, Input.ABORT, now, reason=f"superseded by epoch {key.epoch}")
        return actions

    def _replay_early(self, m: Machine, now: float) -> list[Action]:
        """Feed what the peer said before this transfer started here, in the order it came."""
        actions: list[Action] = []
        for peer, message in self.store.early.pop(m.key, now):
            actions += self._inbox.receive(peer, message, now)
        return actions

    def feed(self, m: Machine, input_: Input, now: float, *, reason: str = "") -> list[Action]:
        """Feed one input to a machine of this core and return what it decides: the single way
        in for inputs decided outside the core's own methods (a peer's message, refined).

        :raises InvalidTransition: the machine's table does not allow `input_` in its state.
        """
        return self._steps.feed(m, input_, now, reason=reason)
