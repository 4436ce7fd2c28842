"""The transfer store: one engine's machines, their epochs, deadlines and early messages.

Why its own module: two parts of the core change transfers, and both need the same bookkeeping.
`TransferCore` runs the local API, the data plane and time; `PeerInbox` refines what peers
send.  Neither may reach into the other: both open, find, re-time and forget transfers through
this store, and feed inputs to machines through `TransferCore.feed`.  The store decides nothing
about states; it only keeps each record, its epoch set, its block account and its timer
consistent with one another.  Pure code: time is an argument.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import NamedTuple

from kvflow.errors import ConfigError, UnknownTransfer
from kvflow.protocol.early import EarlyMessages
from kvflow.protocol.ledger import BlockLedger
from kvflow.protocol.machine import Machine
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Mode, Role
from kvflow.protocol.transfer_tables import ACTIVE, TERMINAL

__all__ = ("CoreConfig", "CoreStats", "Owner", "TransferStore")

Owner = tuple[TransferKey, Role]


@dataclass(frozen=True, slots=True)
class CoreConfig:
    fence_timeout: float = 10.0  # wait for a peer's fence (or D's ack) before declaring it lost
    retention: float = 60.0  # keep finished machines this long to absorb late messages
    # ... but no more than this many: beyond, the oldest finished is forgotten early, so that an
    # engine's memory (about 2 KiB a finished machine) stays bounded at any rate
    max_finished: int = 16384
    max_unstarted: int = 4096  # P: registrations for transfers it has not started itself
    max_ttl: float = 3600.0  # cap on a peer-supplied time-to-live
    max_batches: int = 4096
    # P: however often a peer's heartbeats renew the lease, a transfer's blocks are held at most
    # this long after it opened (a peer that keeps beating cannot pin them for ever)
    max_hold: float = 600.0
    # Per peer, so that one peer (buggy or hostile) cannot use up what every peer shares: the
    # live transfers a peer's registrations may open here, the blocks its registrations may name,
    # and its messages held for transfers not started here.  What goes beyond is refused.
    max_peer_transfers: int = 1024
    max_peer_blocks: int = 262144
    max_peer_early: int = 1024
    # What all peers share: the registrations for transfers not started here (`max_unstarted`,
    # above), the blocks live registrations name, and the block ids of messages held early (a
    # Python int each, about 36 bytes).  A full pool of registrations or early messages pushes
    # out the heaviest holder's newest registration or oldest message for a lighter peer's.
    max_registered_blocks: int = 2_097_152
    max_early_blocks: int = 1_048_576

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ConfigError(f"core config {f.name} must be > 0, got {getattr(self, f.name)}")


@dataclass(slots=True)
class CoreStats:
    ignored: int = 0  # late or duplicate messages absorbed by a state
    unaddressed: int = 0  # effects for a peer (`ADDRESSED`) of a machine that has none yet
    unknown_transfer: int = 0  # messages or notifications for no known transfer
    stale_epoch: int = 0  # for a transfer id known here, but another epoch
    malformed_notifications: int = 0
    foreign_peer: int = 0  # about a transfer, but from a peer that is not its peer
    protocol_violations: int = 0  # an input the table does not allow, from a peer
    rejected_registrations: int = 0
    refused_claims: int = 0  # pull P: a claim for a transfer another peer claimed first
    early_messages: int = 0  # about transfers not started here yet, kept until they start
    capped_renewals: int = 0  # lease renewals cut short by `CoreConfig.max_hold`
    over_quota: int = 0  # peer messages refused by a per-peer quota (`CoreConfig.max_peer_*`)
    pushed_out: int = 0  # registrations and early messages of the heaviest peer dropped for a lighter one's
    completed: int = 0
    failed: int = 0


class Load(NamedTuple):
    """What the live transfers weigh: in all, and for one peer."""

    unstarted: int  # transfers a peer's registration opened (not started here)
    registered: int  # blocks the registrations of every peer name
    transfers: int  # the peer's live transfers
    blocks: int  # the blocks the peer's registrations name
    opened: int  # the transfers the peer's registrations opened


class TransferStore:
    """Machines by (key, role), the epochs seen per (transfer id, role), the deadline heap, the
    block ledger's accounts and the messages held for transfers not started yet."""

    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self.ledger = BlockLedger()
        self._machines: dict[Owner, Machine] = {}
        # the machines not terminal yet, in the order they opened: kept as they open and end
        # (terminal states are final), so that no action scans the finished ones kept for
        # `retention`
        self._live: dict[Owner, Machine] = {}
        # the finished machines kept, in the order they ended (so the oldest is first): they
        # leave `retention` after they ended, or early once more than `max_finished` are kept
        self._finished: dict[Owner, Machine] = {}
        self.visited = 0  # machines handed out by `live()`: what per-action scans cost
        self._epochs: dict[tuple[str, Role], set[int]] = {}
        self._timers: list[tuple[float, int, Owner, int]] = []  # (when, seq, owner, timer generation)
        self._seq = 0
        # messages about transfers not started here yet (a peer's notice or ready came first)
        c = config
        self.early = EarlyMessages(c.retention, c.max_unstarted, c.max_peer_early, c.max_early_blocks)
        # what the live transfers weigh, kept as they change (so that a quota check is O(1)):
        # how many a peer's registration opened, the blocks registrations name, and per peer
        # its live transfers, the blocks it registered and the transfers its registrations opened
        self._unstarted = 0
        self._registered = 0
        self._peer_load: dict[str, tuple[int, int, int]] = {}
        # P: transfers whose request this engine holds (queued or prefilling), for which peer
        # and since when: what heartbeats list, and whose notices a peerless transfer takes
        self._promises: dict[TransferKey, tuple[str, float]] = {}

    # ------------------------------------------------------------------ records

    def get(self, key: TransferKey, role: Role) -> Machine | None:
        return self._machines.get((key, role))

    def machine(self, key: TransferKey, role: Role) -> Machine:
        """:raises UnknownTransfer: no such machine (or it was already forgotten)."""
        m = self._machines.get((key, role))
        if m is None:
            raise UnknownTransfer(f"no {role.value} transfer {key}")
        return m

    def get_owner(self, owner: Owner) -> Machine | None:
        return self._machines.get(owner)

    def machines(self) -> list[Machine]:
        return list(self._machines.values())

    def live(self) -> list[Machine]:
        """Machines not yet terminal (including D's NOTIFIED awaiting delivery), oldest first;
        as many visited (`visited`) as there are live ones, however many finished are kept."""
        self.visited += len(self._live)
        return list(self._live.values())

    def live_count(self) -> int:
        return len(self._live)

    def load(self, peer: str) -> Load:
        """What the live transfers weigh, in all and for `peer`."""
        return Load(self._unstarted, self._registered, *self._peer_load.get(peer, (0, 0, 0)))

    def openers(self) -> dict[str, int]:
        """Per peer, the live transfers its registrations opened (not started here)."""
        return {peer: load[2] for peer, load in self._peer_load.items() if load[2]}

    def newest_unstarted(self, peer: str) -> Machine | None:
        """The live transfer `peer`'s registration opened last, not started here."""
        return next((m for m in reversed(self._live.values()) if m.peer == peer and not m.started_locally), None)

    def set_peer(self, m: Machine, peer: str | None) -> None:
        self._reweigh(m, lambda: setattr(m, "peer", peer))

    def set_remote_blocks(self, m: Machine, blocks: tuple[int, ...]) -> None:
        self._reweigh(m, lambda: setattr(m, "remote_blocks", blocks))

    def mark_started(self, m: Machine) -> None:
        """This side started the transfer itself (P's KV is ready)."""
        self._reweigh(m, lambda: setattr(m, "started_locally", True))

    def ended(self, m: Machine, now: float) -> list[Machine]:
        """The transfer has just become terminal at `now`: it weighs nothing any more, and is
        kept to absorb late messages (`retention`, at most `max_finished` of them).  Returns
        the finished machines forgotten to make room."""
        self._weigh(m, -1)
        self._live.pop(m.owner, None)
        m.finished_at = now
        self._finished[m.owner] = m
        forgotten = []
        while len(self._finished) > self.config.max_finished:
            forgotten.append(next(iter(self._finished.values())))
            self.forget(forgotten[-1])
        return forgotten

    def finished_count(self) -> int:
        return len(self._finished)

    def forget_finished(self, now: float) -> list[Machine]:
        """Forget (and return) the finished machines that ended `retention` or longer before `now`."""
        cutoff, forgotten = now - self.config.retention, []
        while self._finished:
            oldest = next(iter(self._finished.values()))
            if oldest.finished_at is None or oldest.finished_at > cutoff:
                break
            self.forget(oldest)
            forgotten.append(oldest)
        return forgotten

    def _reweigh(self, m: Machine, change: Callable[[], None]) -> None:
        live = m.state not in TERMINAL
        if live:
            self._weigh(m, -1)
        change()
        if live:
            self._weigh(m, +1)

    def _weigh(self, m: Machine, sign: int) -> None:
        unstarted, blocks = sign * (not m.started_locally), sign * len(m.remote_blocks or ())
        self._unstarted += unstarted
        if m.peer is not None:
            self._registered += blocks
            transfers, held, opened = self._peer_load.get(m.peer, (0, 0, 0))
            load = (transfers + sign, held + blocks, opened + unstarted)
            if load == (0, 0, 0):
                self._peer_load.pop(m.peer, None)
            else:
                self._peer_load[m.peer] = load

    def epochs(self, transfer_id: str, role: Role) -> frozenset[int]:
        """The epochs of `transfer_id` this side still has a machine for (empty: none)."""
        return frozenset(self._epochs.get((transfer_id, role), ()))

    def create(
        self,
        key: TransferKey,
        role: Role,
        mode: Mode,
        peer: str | None,
        deadline: float,
        now: float,
        *,
        started_locally: bool = True,
    ) -> Machine:
        """Open a transfer at `now`: its record, its epoch, its block account and its deadline.
        Not `started_locally`: a peer's registration opened it."""
        m = Machine(key, role, mode, peer, deadline, now, started_locally=started_locally)
        self._machines[m.owner] = m
        self._live[m.owner] = m
        self._weigh(m, +1)
        self._epochs.setdefault((key.transfer_id, role), set()).add(key.epoch)
        self.ledger.open(m.owner, exclusive=role is Role.DECODE)
        self.set_timer(m, deadline)
        return m

    def forget(self, m: Machine) -> None:
        del self._machines[m.owner]
        self._live.pop(m.owner, None)
        self._finished.pop(m.owner, None)
        epochs = self._epochs[(m.key.transfer_id, m.role)]
        epochs.discard(m.key.epoch)
        if not epochs:
            del self._epochs[(m.key.transfer_id, m.role)]

    # ------------------------------------------------------------------ time

    def set_deadline(self, m: Machine, deadline: float) -> None:
        """Move the transfer's deadline; its timer follows while the transfer is active."""
        m.deadline = deadline
        if m.state in ACTIVE:
            self.set_timer(m, deadline)

    def extend(self, m: Machine, until: float) -> bool:
        """Hold the transfer's deadline at least until `until`, but never past `max_hold` after it
        opened here; False when the cap cut the extension short."""
        cap = m.created + self.config.max_hold
        self.set_deadline(m, max(m.deadline, min(until, cap)))
        return until <= cap

    def set_timer(self, m: Machine, when: float | None) -> None:
        """Arm the machine's one timer at `when` (None: disarm); an earlier arming no longer fires."""
        if when is not None and when == m.timer_at:
            return
        m.timer_gen += 1
        m.timer_at = when
        if when is not None:
            self._push(when, m.owner, m.timer_gen)

    def next_deadline(self) -> float | None:
        """The earliest armed timer, or the moment the oldest finished machine is to be forgotten."""
        forget = None
        if self._finished:
            oldest = next(iter(self._finished.values())).finished_at
            forget = None if oldest is None else oldest + self.config.retention
        while self._timers:
            when, _, owner, gen = self._timers[0]
            m = self._machines.get(owner)
            if m is not None and m.timer_gen == gen and m.timer_at == when:
                return when if forget is None else min(when, forget)
            heapq.heappop(self._timers)
        return forget

    def pop_due(self, now: float) -> tuple[float, Machine | None, int] | None:
        """The earliest timer entry due at `now` (when, its machine if still known, its
        generation), removed from the heap; None when nothing is due."""
        if not self._timers or self._timers[0][0] > now:
            return None
        when, _, owner, gen = heapq.heappop(self._timers)
        return when, self._machines.get(owner), gen

    def _push(self, when: float, owner: Owner, gen: int) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (when, self._seq, owner, gen))

    # ------------------------------------------------------------------ promises

    def promise(self, key: TransferKey, peer: str, now: float) -> None:
        """Record that this engine holds the request of `key` for `peer` (the first promise
        counts): P its queued or prefilling request, D its request queued before allocation."""
        self._promises.setdefault(key, (peer, now))

    def drop_promise(self, key: TransferKey) -> None:
        self._promises.pop(key, None)

    def _promise_kept(self, key: TransferKey, since: float, now: float, max_hold: float) -> bool:
        if since + max_hold <= now or self.get(key, Role.DECODE) is not None:
            return False  # D: once it registered, its transfer itself says whether it waits
        m = self.get(key, Role.PREFILL)
        return m is None or m.state in ACTIVE

    def live_promises(self, peer: str, now: float, max_hold: float) -> tuple[TransferKey, ...]:
        """The transfers whose request this side holds for `peer`: promises younger than
        `max_hold` whose transfer has not ended here (P) or not started here (D).  A query:
        changes nothing."""
        kept = self._promise_kept
        return tuple(
            k for k, (owner, since) in self._promises.items() if owner == peer and kept(k, since, now, max_hold)
        )

    def expire_promises(self, now: float, max_hold: float) -> None:
        """Forget the promises `live_promises` no longer lists."""
        for key, (_, since) in list(self._promises.items()):
            if not self._promise_kept(key, since, now, max_hold):
                self.drop_promise(key)

    def promisee(self, key: TransferKey) -> str | None:
        """The peer a promise on `key` names, if any."""
        promise = self._promises.get(key)
        return promise[0] if promise is not None else None
