"""How what a peer sends becomes input to the transfer core.

Why separate: everything here is about untrusted input.  A registration, ready message, notice
or WRITE notification is checked against the transfer it names (right peer? right epoch? a
duplicate? sizes that fit?) and refined into a table input; anything unexpected is counted in
the core's stats and dropped, so that no peer can make the core raise or change a transfer it
does not take part in.  Pure code, like the core it feeds.

The inbox sees the core only through two narrow doors: the `TransferStore` both of them keep
transfers in (find, open, re-time, hold early messages) and a `Feed`, the core's one public
entry point for an input to a machine.  It does not know the core's class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvflow.errors import InvalidBatch, InvalidTransition, PeerProtocolError
from kvflow.protocol.actions import Action, SendMessage
from kvflow.protocol.early import heaviest
from kvflow.protocol.machine import Machine, check_block_ids, next_batch
from kvflow.protocol.messages import (
    OPEN_BATCHES,
    Claim,
    Done,
    Message,
    Notice,
    Quiesced,
    Ready,
    Registration,
    TransferKey,
    decode_notification,
)
from kvflow.protocol.state import Input, Mode, Outcome, Role, transition
from kvflow.protocol.transfer_tables import TERMINAL
from kvflow.protocol.transfers import CoreStats, TransferStore

__all__ = ("Feed", "PeerInbox")

_DECODE, _PREFILL = Role.DECODE, Role.PREFILL


class Feed(Protocol):
    """Feed one input to a machine; returns the actions decided.  :raises InvalidTransition."""

    def __call__(self, m: Machine, input_: Input, now: float, *, reason: str = "") -> list[Action]: ...


class PeerInbox:
    """Refines one core's inbound peer events; holds no state of its own (what it reads of the
    core's, it reads through the store and `ratio_of`)."""

    def __init__(
        self, store: TransferStore, stats: CoreStats, num_layers: int, feed: Feed, ratio_of: Callable[[str], int]
    ) -> None:
        """`ratio_of(peer)`: its block size over this side's or this side's over its (the
        larger over the smaller), as `TransferCore.peer_connected` was told."""
        self.ratio_of = ratio_of
        self.store = store
        self.stats = stats
        self.config = store.config
        self.num_layers = num_layers
        self.feed = feed

    def _allowed(self, m: Machine, input_: Input, what: str) -> bool:
        """Whether the table lets a peer's `input_` reach `m` now: the check made before anything
        of `m` changes, so that an event the table refuses changes nothing (it is counted as a
        protocol violation)."""
        try:
            transition(m.mode, m.role, m.state, input_, what)
        except InvalidTransition:
            self.stats.protocol_violations += 1
            return False
        return True

    def notification(self, peer: str, payload: bytes, now: float, problem: str | None = None) -> list[Action]:
        """A WRITE notification arrived from `peer` (push, on D); `problem`: why what it carried
        cannot be D's KV (this side's integrity check found it so), which fails the transfer."""
        try:
            key, batch, last, _ = decode_notification(payload)
        except PeerProtocolError:
            self.stats.malformed_notifications += 1
            return []
        m = self.lookup(key, _DECODE)
        if m is None:
            return []
        if m.mode is not Mode.PUSH or m.peer != peer:
            self.stats.foreign_peer += 1
            return []
        if batch in m.landed:
            return self.remote(m, Input.DUPLICATE, now)
        problem = problem or self._count_problem(m, batch, last)
        if problem is not None:
            return self.remote(m, Input.INCOMPATIBLE, now, problem)
        total = batch + 1 if last else m.total if m.expected_batches == OPEN_BATCHES else m.expected_batches
        done = total is not None and len(m.landed) + 1 == total
        input_ = Input.LAST_BATCH_LANDED if done else Input.BATCH_LANDED
        if not self._allowed(m, input_, str(key)):
            return []
        m.landed.add(batch)
        if last:
            m.total = total
        return self.feed(m, input_, now)

    def _count_problem(self, m: Machine, batch: int, last: bool) -> str | None:
        """Why batch `batch` (P's last if `last`) cannot belong to D's transfer `m`, or None.

        With a fixed count, batches are 0..count-1 and the last one is count-1.  With an open
        count, P's last batch fixes the count: no batch may come after it, nor a second last.
        """
        fixed = m.expected_batches != OPEN_BATCHES
        total = m.expected_batches if fixed else m.total
        if batch >= self.config.max_batches or (total is not None and batch >= total):
            return f"notification for batch {batch}, but P makes {total or self.config.max_batches}"
        if last and fixed and batch + 1 != total:
            return f"P's last batch is batch {batch}, but D expects {total} writes"
        if last and m.total is not None:
            return f"P's last batch is batch {batch}, after it said batch {m.total - 1}"
        if last and any(landed > batch for landed in m.landed):
            return f"P's last batch is batch {batch}, but batch {max(m.landed)} landed"
        return None

    def receive(self, peer: str, message: Message, now: float) -> list[Action]:
        """A control message from `peer`.  Never raises for anything the peer sent."""
        if isinstance(message, Registration):
            return self._on_registration(peer, message, now)
        if isinstance(message, Ready):
            return self._on_ready(peer, message, now)
        if isinstance(message, Claim):
            return self._on_claim(peer, message, now)
        key = message.key
        if isinstance(message, Notice):
            self._bind_unclaimed(key, peer)  # D gave up before its claim reached this side
        role = _PREFILL if isinstance(message, Done) else None
        m = self._lookup_any(key, peer, role)
        if isinstance(message, Notice):
            input_ = Input.PEER_ABORTED if message.outcome is Outcome.ABORTED else Input.PEER_FAILED
            reason = f"peer {message.outcome.value}: {message.reason}"
            if m is None:
                # The peer gave up before this side started: remember it, so that the transfer
                # fails at once if it starts here later.  Nothing of it can be in flight here.
                self._hold_unless_stale(peer, message, (_DECODE, _PREFILL), now)
                return [SendMessage(peer, Quiesced(key))]
            return self.remote(m, input_, now, reason)
        if m is None:
            if isinstance(message, Quiesced) and self.store.early.has(key):
                self._hold(peer, message, now)  # it follows a notice kept above
            return []
        if isinstance(message, Quiesced):
            return self.remote(m, Input.PEER_QUIESCED, now)
        return self.remote(m, Input.PEER_DONE, now)

    def _on_registration(self, peer: str, reg: Registration, now: float) -> list[Action]:
        key = reg.key
        m = self.store.get(key, _PREFILL)
        if m is None:
            problem = self._registration_problem(reg)
            newer = [e for e in self.store.epochs(key.transfer_id, _PREFILL) if e > key.epoch]
            promisee = self.store.promisee(key)
            if newer:
                self.stats.stale_epoch += 1
                problem = f"epoch {key.epoch} is older than {max(newer)}"
            elif promisee not in (None, peer):  # P holds this request for another D
                self.stats.foreign_peer += 1
                problem = "transfer is for another engine"
            elif problem is None:
                problem = self._quota_problem(peer, len(reg.block_ids), opens=True)
            pushed_out: list[Action] = []
            if problem is None and self.store.load(peer).unstarted >= self.config.max_unstarted:
                problem, pushed_out = self._make_room(peer, now)
            if problem is not None:
                self.stats.rejected_registrations += 1
                return [SendMessage(peer, Notice(key, Outcome.FAILED, problem)), SendMessage(peer, Quiesced(key))]
            deadline = now + min(reg.ttl, self.config.max_ttl)
            m = self.store.create(key, _PREFILL, Mode.PUSH, peer, deadline, now, started_locally=False)
            if pushed_out:  # room was made: the registration goes on as any other would
                return pushed_out + self._on_registration(peer, reg, now)
        if m.mode is not Mode.PUSH or m.peer not in (None, peer):
            self.stats.foreign_peer += 1
            return []
        if m.remote_blocks is not None:
            return self.remote(m, Input.DUPLICATE, now)
        if not self._allowed(m, Input.REGISTRATION_RECEIVED, str(key)):
            return []
        self.store.set_peer(m, peer)
        problem = self._registration_problem(reg) or self._quota_problem(peer, len(reg.block_ids), opens=False)
        if problem is None:
            self.store.set_remote_blocks(m, reg.block_ids)
            m.remote_first, m.remote_expected = reg.first_position, reg.expected_batches
            self.store.set_deadline(m, min(m.deadline, now + min(reg.ttl, self.config.max_ttl)))
            problem = m.push_mismatch(ratio=self.ratio_of(peer))
        if problem is not None and m.state not in TERMINAL:
            return self.remote(m, Input.INCOMPATIBLE, now, problem)
        return self.feed(m, Input.REGISTRATION_RECEIVED, now, reason=m.reason or "transfer already ended")

    def _registration_problem(self, reg: Registration) -> str | None:
        try:
            check_block_ids(reg.block_ids, "registration", unique=True, allow_empty=True)
        except InvalidBatch as exc:
            return str(exc)
        batches = reg.expected_batches
        # with blocks: a count, or open; without: D needs nothing, and no WRITE comes
        counted = (
            (batches == OPEN_BATCHES or 1 <= batches <= self.config.max_batches) if reg.block_ids else batches == 0
        )
        if not counted or not reg.ttl > 0:
            return "registration has a bad batch count or time-to-live"
        if reg.first_position < 0:
            return "registration has a negative first position"
        return None

    def _on_ready(self, peer: str, ready: Ready, now: float) -> list[Action]:
        m = self.store.get(ready.key, _DECODE)
        if m is None:  # P may be ready before D allocates: keep it until D does
            self._hold_unless_stale(peer, ready, (_DECODE,), now)
            return []
        if m.mode is not Mode.PULL or m.peer != peer:
            self.stats.foreign_peer += 1
            return []
        if m.remote_blocks is not None:
            return self.remote(m, Input.DUPLICATE, now)
        try:
            blocks = check_block_ids(ready.block_ids, "ready", unique=False)
        except InvalidBatch as exc:
            return self.remote(m, Input.INCOMPATIBLE, now, str(exc))
        ratio = self.ratio_of(peer)  # D's blocks hold `ratio` of P's each
        wanted = m.first_position + len(m.block_ids)  # D reads only those after its prefix hit
        start, stop = ready.first_position, ready.first_position + len(blocks)  # P's positions
        if -(-stop // ratio) != wanted or start > m.first_position * ratio:
            problem = f"P is ready with positions {start}..{stop} (its blocks), D expects {m.first_position}..{wanted}"
            return self.remote(m, Input.INCOMPATIBLE, now, problem)
        if not self._allowed(m, Input.READY_RECEIVED, str(m.key)):
            return []
        if m.state in TERMINAL:  # ended before P was ready: tell P, nothing will be read
            return self.feed(m, Input.READY_RECEIVED, now)
        self.store.set_remote_blocks(m, blocks[m.first_position * ratio - start :])
        m.batches.append(next_batch(m.key, (), 0, m.block_ids, m.span or (0, self.num_layers)))
        return self.feed(m, Input.READY_RECEIVED, now)

    def _on_claim(self, peer: str, claim: Claim, now: float) -> list[Action]:
        """Pull: `peer` asks for a transfer as its decode side.  The first claimant of a
        transfer made ready for nobody in particular becomes its peer; a claim from the peer
        it already has changes nothing; any other claimant is refused with a notice."""
        key = claim.key
        m = self.store.get(key, _PREFILL)
        if m is None:  # D may claim before P's KV is ready here: keep it until it is
            self._hold_unless_stale(peer, claim, (_PREFILL,), now)
            return []
        if m.mode is not Mode.PULL:
            self.stats.foreign_peer += 1
            return []
        if m.peer == peer:
            return []  # P was told its decode peer, or this is the claimant again
        if m.peer is not None:
            self.stats.refused_claims += 1
            return [SendMessage(peer, Notice(key, Outcome.FAILED, "transfer already claimed by another engine"))]
        self.store.set_peer(m, peer)
        return self.remote(m, Input.CLAIM_RECEIVED, now)

    def _bind_unclaimed(self, key: TransferKey, peer: str) -> None:
        m = self.store.get(key, _PREFILL)
        if m is not None and m.mode is Mode.PULL and m.peer is None and m.state not in TERMINAL:
            self.store.set_peer(m, peer)

    def lookup(self, key: TransferKey, role: Role) -> Machine | None:
        m = self.store.get(key, role)
        if m is None:
            if self.store.epochs(key.transfer_id, role):
                self.stats.stale_epoch += 1
            else:
                self.stats.unknown_transfer += 1
        return m

    def _lookup_any(self, key: TransferKey, peer: str, role: Role | None) -> Machine | None:
        roles = (role,) if role is not None else (_DECODE, _PREFILL)
        candidates = [m for r in roles if (m := self.store.get(key, r)) is not None]
        for m in candidates:
            # a push P learns its peer from the registration; before it, the promise names it
            if m.peer == peer or (m.peer is None and self.store.promisee(key) == peer):
                return m
        if candidates:
            self.stats.foreign_peer += 1
        elif any(self.store.epochs(key.transfer_id, r) for r in roles):
            self.stats.stale_epoch += 1
        else:
            self.stats.unknown_transfer += 1
        return None

    def remote(self, m: Machine, input_: Input, now: float, reason: str = "") -> list[Action]:
        """Feed an input that a peer caused: a disallowed one is counted, never raised."""
        try:
            return self.feed(m, input_, now, reason=reason)
        except InvalidTransition:
            self.stats.protocol_violations += 1
            return []

    def _hold_unless_stale(
        self, peer: str, message: Notice | Ready | Claim, roles: tuple[Role, ...], now: float
    ) -> None:
        seen = [e for role in roles for e in self.store.epochs(message.key.transfer_id, role)]
        if seen and max(seen) > message.key.epoch:
            self.stats.stale_epoch += 1
            return
        self._hold(peer, message, now)

    def _hold(self, peer: str, message: Message, now: float) -> None:
        early = self.store.early
        pushed_out = early.pushed_out
        if early.hold(peer, message, now):
            self.stats.early_messages += 1
        else:
            self.stats.over_quota += 1  # beyond the peer's max_peer_early, or its share of the pools
        self.stats.pushed_out += early.pushed_out - pushed_out

    def _quota_problem(self, peer: str, blocks: int, *, opens: bool) -> str | None:
        """Why a registration from `peer` naming `blocks` blocks (and opening a transfer here,
        if `opens`) goes beyond the peer's quotas or what P keeps for all peers, or None; every
        refusal is counted in `over_quota`."""
        load, config = self.store.load(peer), self.config
        problem = None
        if opens and load.transfers >= config.max_peer_transfers:
            problem = f"over quota: {load.transfers} live transfers with this peer (max_peer_transfers)"
        elif load.blocks + blocks > config.max_peer_blocks:
            problem = f"over quota: {load.blocks + blocks} blocks registered by this peer (max_peer_blocks)"
        elif load.registered + blocks > config.max_registered_blocks:
            problem = f"over quota: {load.registered + blocks} blocks registered by all peers (max_registered_blocks)"
        if problem is not None:
            self.stats.over_quota += 1
        return problem

    def _make_room(self, peer: str, now: float) -> tuple[str | None, list[Action]]:
        """The registrations P keeps for transfers it has not started are all taken: the
        newest of the heaviest holder's goes (it expires, as at its time-to-live) when `peer`
        holds fewer, else `peer` is refused (why, counted in `over_quota`)."""
        opened = self.store.openers()
        victim = heaviest(opened, opened.get(peer, 0), 1)
        m = None if victim is None else self.store.newest_unstarted(victim)
        if m is None:
            self.stats.over_quota += 1
            limit = self.config.max_unstarted
            return f"too many registrations for transfers not started here (max_unstarted {limit})", []
        self.stats.pushed_out += 1
        reason = f"pushed out: registrations full, and {victim!r} held the most of them"
        return None, self.feed(m, Input.DEADLINE, now, reason=reason)
