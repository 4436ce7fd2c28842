"""Peer associations, decided without I/O: handshake, incarnations, heartbeats and leases.

Why separate from the transfer core: this is about *peers*, not transfers.  An association
starts with a Hello each way (KV layouts compared field by field, transport metadata exchanged)
and lasts for one incarnation of each side; each side numbers it, so that a Hello sent again for
the same association (a retry) is told from one that starts a new association.  While it
lasts, each side sends a Heartbeat every `heartbeat_interval`; D's heartbeats list the transfers
it still waits on, which renews P's lease on their blocks.  A peer silent for a whole `lease`, a
Goodbye, or a Hello from a new incarnation or of a new association ends the association, and the
engine tears the peer down so that nothing of it can land afterwards.  The side that ends an
association tells the peer, best effort, with a Goodbye naming the reason, so that both sides
settle their transfers with each other.

Why pure, like the core: who may associate, when a peer is lost and in which order the effects
happen are decisions worth testing without sockets or a loop.  `Associations` takes inputs
(a connect request, a received message with its sender and incarnation, `tick(now)`, a peer
dropped) and returns the effects as frozen dataclasses, in the order the runtime must execute
them.  Time is always an argument; nothing here logs, reads a clock or touches asyncio.  Each
input moves the peer's phase by a row of `kvflow.protocol.phases.TABLE` and takes the row's step.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from kvflow.errors import (
    ConfigError,
    KVFlowError,
    LayoutMismatch,
    PeerNotAllowed,
    PeerProtocolError,
    UnsupportedVersion,
)
from kvflow.layout import KVLayout, check_compatible, layout_from_wire
from kvflow.protocol.admission import PeerAllowList
from kvflow.protocol.early import message_blocks
from kvflow.protocol.liveness import Liveness
from kvflow.protocol.messages import ControlMessage, Goodbye, Heartbeat, Hello, Reject
from kvflow.protocol.peer_actions import (
    AddRoute,
    AddTransportPeer,
    AnswerUnassociated,
    AssociationAction,
    AwaitHandshake,
    Deliver,
    HandshakeSettled,
    PeerConnected,
    PendingHello,
    Redeliver,
    Refused,
    RenewLeases,
    SendControl,
    SendHeartbeat,
    SendHello,
    TearDown,
    UnknownSender,
)
from kvflow.protocol.peer_record import PeerRecord
from kvflow.protocol.phases import TABLE, Do, Event, Phase, relate_hello, relate_message, relate_reject
from kvflow.protocol.teardown import Teardowns

__all__ = (
    "ATTEMPTS_KEPT",
    "EARLY_BLOCKS_KEPT",
    "EARLY_MESSAGES_KEPT",
    "Associations",
    "Liveness",
)

# Messages kept per peer between its side of an association and ours being in place: a handful
# in practice (a transfer's first messages); bounded because a peer decides how many it sends.
EARLY_MESSAGES_KEPT = 256
EARLY_BLOCKS_KEPT = 262_144  # ... and the block ids they may carry in all (a Python int each)
# Our numbers for associations attempted but never answered, kept so that a retry keeps its
# number: bounded, since every connect to a new name adds one.
ATTEMPTS_KEPT = 1024


class Associations:
    """One engine's peers: live associations, their incarnations and liveness, and the peers
    it tore down moments ago and will not associate with yet."""

    def __init__(
        self,
        engine_id: str,
        fingerprint: dict[str, int | str],
        lease: float,
        interval: float,
        max_peers: int = 256,
        confirm: float = 1.0,
        allowed: PeerAllowList | None = None,
        *,
        grace: float = 0.0,
        hold: float = 120.0,
    ) -> None:
        """`grace` and `hold`: see `Teardowns` (`grace` 0: the transport fences inbound ops)."""
        self.engine_id = engine_id
        self.allowed = allowed or PeerAllowList()  # whom this engine may associate with and dial
        self.max_peers = max_peers  # each association costs sockets and transport state: bounded
        self.fingerprint = fingerprint
        self.liveness = Liveness(lease, interval, confirm)
        # torn-down peers on their way out; those whose late ops may still land cool: no new association
        self.teardowns = Teardowns(grace, hold, lease)
        # every peer something is kept about, and only those: a record is made when a peer first
        # needs one and goes once it keeps nothing.  A handshake that timed out here may still be
        # answered, or retried: both keep our number for it (and the address it dialled), so the
        # attempts kept are bounded over all peers, live ones first.
        self._peers: dict[str, PeerRecord] = {}
        # what the bounds count, kept beside the records so that no input scans them all: records
        # not in `Phase.NONE` (`_move` counts them), those with an address, and our numbers kept
        # (each with its peer), oldest first
        self._engaged = 0
        self._addressed = 0
        self._numbers: dict[int, str] = {}
        self._numbered = 0
        self.refusing = ""  # why every Hello is refused now (the engine asleep); empty: none is

    @property
    def records(self) -> Mapping[str, PeerRecord]:
        """Each peer's record, to read: a peer without one has nothing kept about it."""
        return MappingProxyType(self._peers)

    def peers(self) -> list[str]:
        """The peers associated now (the association's data in place), sorted."""
        return sorted(peer for peer, record in self._peers.items() if record.layout is not None)

    def phase(self, peer: str) -> Phase:
        record = self._peers.get(peer)
        return Phase.NONE if record is None else record.phase

    def layout(self, peer: str) -> KVLayout | None:
        """The layout `peer` announced (None: not associated)."""
        record = self._peers.get(peer)
        return None if record is None else record.layout

    def engaged(self, peer: str) -> bool:
        """Whether `peer` is associated or being added (it counts toward `max_peers`)."""
        record = self._peers.get(peer)
        return record is not None and record.engaged

    def _record(self, peer: str) -> PeerRecord:
        """`peer`'s record, made now if it has none."""
        record = self._peers.get(peer)
        if record is None:
            record = self._peers[peer] = PeerRecord()
        return record

    def _release(self, peer: str) -> None:
        """Drop `peer`'s record once it keeps nothing (called wherever something of it goes)."""
        record = self._peers.get(peer)
        if record is not None and record.keeps_nothing():
            del self._peers[peer]

    def _move(self, peer: str, event: Event) -> Do | None:
        """Move `peer` by the table's row for `event` in its phase; the row's step (None: none)
        is the caller's to take."""
        before = self.phase(peer)
        to, steps = TABLE[before, event]
        self._engaged += (to is not Phase.NONE) - (before is not Phase.NONE)
        if to is not Phase.NONE or peer in self._peers:
            self._record(peer).phase = to
            self._release(peer)
        return steps[0] if steps else None

    def _run(self, peer: str) -> int | None:
        """The run of `peer` in place: the associated one, or the one the transport is adding."""
        record = self._peers.get(peer)
        if record is None:
            return None
        pending = record.adding if record.phase is Phase.ADDING else None
        return record.incarnation if pending is None else pending.incarnation

    # ---------------------------------------------------------------- local inputs

    def connect(self, peer: str, address: str) -> list[AssociationAction]:
        """Start a handshake with `peer` (nothing to do when already associated)."""
        if self._move(peer, Event.CONNECT) is not Do.DIAL:
            return []
        problem = self._not_permitted(peer, address, local=True)
        if problem is not None or self._full(peer):
            error: KVFlowError = PeerNotAllowed(problem) if problem else self._full_error()
            return [AwaitHandshake(peer), HandshakeSettled(peer, error)]
        return [
            *self._route(peer, address),
            AwaitHandshake(peer),
            SendHello(peer, False, association=self._number(peer)),
        ]

    def _route(self, peer: str, address: str, pending: PendingHello | None = None) -> list[AssociationAction]:
        if not address:
            return []
        record = self._record(peer)
        if not record.address:  # records keep the order addresses came in (`_not_permitted` reads it)
            self._addressed += 1
            self._peers[peer] = self._peers.pop(peer)
        record.address = address
        if self._addressed > ATTEMPTS_KEPT:  # the addresses of attempts go, all but this one
            for stale, kept in list(self._peers.items()):
                if kept.address and not kept.engaged and stale != peer:
                    kept.address = ""
                    self._addressed -= 1
                    self._release(stale)
        return [AddRoute(peer, address, pending)]

    def _number(self, peer: str) -> int:
        """Our number for the association with `peer`: the one held or attempted, else a new one."""
        record = self._record(peer)
        if record.ours is not None:
            return record.ours
        self._numbered += 1
        record.ours = number = self._numbered
        self._numbers[number] = peer
        if len(self._numbers) > ATTEMPTS_KEPT:  # the oldest attempt never answered goes
            stale = next((n for n, p in self._numbers.items() if self._peers[p].phase is Phase.NONE), None)
            if stale is not None:
                dropped = self._numbers.pop(stale)
                self._peers[dropped].ours = None
                self._release(dropped)
        return number

    def _forget(self, peer: str) -> None:
        """`peer` is being torn down: forget the association's data (the caller moved its phase)."""
        record = self._peers.get(peer)
        if record is not None:
            record.early = []
            record.layout = record.incarnation = record.theirs = None
            if record.ours is not None:  # the next association with it is numbered anew
                del self._numbers[record.ours]
                record.ours = None
            self._addressed -= bool(record.address)
            record.address = ""
            self._release(peer)
        self.liveness.remove(peer)

    def tear_down(self, peer: str, reason: str, *, answered: bool = False) -> list[AssociationAction]:
        """This side ends the association with `peer` (silent for a lease, no fence, cannot be
        sent to): tell the peer why, best effort, then tear it down.  Without the goodbye a peer
        that was only paused (stopped, swapped out) would learn nothing and keep its side of
        every transfer alive, so that the two sides could end the same transfer differently."""
        record = self._peers.get(peer)
        if record is not None and record.phase is Phase.ADDING and record.adding is not None:
            record.given_up.append(record.adding)  # given up: the transport's answer about it is stale
            record.adding = record.deferred = None
        self._move(peer, Event.LOST)
        goodbye: list[AssociationAction] = [SendControl(peer, Goodbye(reason))] if self.layout(peer) is not None else []
        self._forget(peer)
        return [*goodbye, TearDown(peer, reason, answered=answered)]

    def goodbye_all(self, reason: str) -> list[AssociationAction]:
        return [SendControl(peer, Goodbye(reason)) for peer in self.peers()]

    def next_deadline(self) -> float | None:
        """When `tick` has something to do next (None: nothing is due ever, as things stand)."""
        times = [t for t in (self.liveness.next_deadline(), self.teardowns.next_deadline()) if t is not None]
        return min(times, default=None)

    def tick(self, now: float) -> list[AssociationAction]:
        """End associations whose peer stayed silent for a lease; send due heartbeats; move
        teardowns whose deadline passed."""
        actions: list[AssociationAction] = []
        for peer in self.liveness.expired(now):
            dropped = self.liveness.is_suspect(peer)
            if dropped:
                reason = f"its connection dropped and did not come back within {self.liveness.confirm}s"
            else:
                reason = f"no message for {self.liveness.lease}s"
            actions += self.tear_down(peer, reason, answered=dropped)
        actions += [SendHeartbeat(peer) for peer in self.liveness.due(now)]
        return [*actions, *self.teardowns.tick(now)]

    def link_changed(self, peer: str, up: bool, now: float) -> list[AssociationAction]:
        """The control channel's connection to `peer` dropped (`up` False) or came back.  A drop
        makes an associated peer suspect: lost at `now + confirm` unless the link comes back or
        the peer is heard from first.  Never raises; changes nothing for peers not associated."""
        if up:
            self.liveness.cleared(peer)
            return []
        self.liveness.suspect(peer, now)
        return []

    # ---------------------------------------------------------------- inbound

    def receive(self, sender: str, incarnation: int, message: ControlMessage, now: float) -> list[AssociationAction]:
        """A control message from `sender` (in its run `incarnation`).  Never raises."""
        if isinstance(message, Hello):
            return self._on_hello(sender, incarnation, message, now)
        if isinstance(message, Reject):
            refused = HandshakeSettled(sender, PeerProtocolError(f"{sender!r} refused the handshake: {message.reason}"))
            record = self._peers.get(sender)
            associated = None if record is None else record.incarnation
            if self._move(sender, relate_reject(associated, incarnation)) is Do.END_RUN:
                self._forget(sender)  # a later run of an associated peer: the old one is gone
                return [TearDown(sender, f"a later run of it says: {message.reason}", answered=True), refused]
            return [refused]
        do = self._move(sender, relate_message(self._run(sender), incarnation, isinstance(message, Goodbye)))
        if do is Do.KEEP_EARLY:
            early = self._record(sender).early
            if len(early) < EARLY_MESSAGES_KEPT and sum(map(message_blocks, early)) + message_blocks(message) <= (
                EARLY_BLOCKS_KEPT
            ):
                # The sender's side of the association is in place (it answered, or it started
                # the handshake) and it already speaks; ours will be in a moment.
                early.append(message)
                return []
            return [UnknownSender(sender)]  # too much too early
        if do is Do.ANSWER_UNASSOCIATED:
            return [AnswerUnassociated(sender, incarnation)]
        if do is not Do.DELIVER and do is not Do.SAY_GOODBYE:
            return [UnknownSender(sender)]  # an old run, or being added or answered
        self.liveness.heard(sender, now)
        if isinstance(message, Goodbye):  # (`Do.SAY_GOODBYE`)
            self._forget(sender)
            return [TearDown(sender, f"it tore us down: {message.reason}", expected=True, answered=True)]
        if isinstance(message, Heartbeat):
            return [RenewLeases(sender, message.keys, now, self.liveness.lease)]
        return [Deliver(sender, message)]  # about one transfer: the core's business

    def route_added(self, peer: str, pending: PendingHello, now: float) -> list[AssociationAction]:
        """The route from a Hello's `AddRoute` is in place: hand the peer to the transport.
        Nothing of an old association may survive a new one (a new run of the peer, or a new
        association after it tore us down)."""
        actions: list[AssociationAction] = []
        if self._move(peer, Event.ROUTED) is Do.REPLACE:
            self._forget(peer)
            actions.append(TearDown(peer, "peer started a new association", answered=True))
        actions.append(AddTransportPeer(peer, pending))
        self._record(peer).adding = pending
        return actions

    def pending_refused(self, peer: str, pending: PendingHello, error: KVFlowError) -> list[AssociationAction]:
        """What a pending Hello needs was refused (the control channel refused its address, or
        the transport what it says about the peer's memory): refuse the peer.  The transport's
        refusal of an addition given up since is dropped."""
        if self._stale(peer, pending):
            return []
        self._move(peer, Event.PENDING_REFUSED)
        dropped = [UnknownSender(peer) for _ in self._take_early(peer)]
        return [*self._refuse(peer, pending.hello, error), *dropped, *self._added(peer, pending)]

    def transport_peer_added(self, peer: str, pending: PendingHello, now: float) -> list[AssociationAction]:
        """The transport accepted the peer: the association begins (once our answer, when the
        peer started it, is sent: see `hello_sent`).  An addition given up since is dropped: the
        teardown's removal, queued behind it, undoes it."""
        record = self._peers.get(peer)
        if self._stale(peer, pending) or record is None or record.adding is not pending:
            return []  # given up, or never handed to the transport: nothing of it goes in place
        do = self._move(peer, Event.ADDED_ANSWERED if pending.hello.reply else Event.ADDED)
        record.layout, record.incarnation = pending.layout, pending.incarnation
        record.theirs = pending.hello.association
        self.liveness.add(peer, now)
        if do is Do.ANSWER_HELLO:
            answer = SendHello(peer, reply=True, associating=True, association=self._number(peer))
            return [answer, *self._added(peer, pending)]
        return [*self._connected(peer, now), *self._added(peer, pending)]

    def _stale(self, peer: str, pending: PendingHello) -> bool:
        """The transport's answer about `pending` comes for an addition given up (`tear_down`)."""
        record = self._peers.get(peer)
        if record is None or not any(kept is pending for kept in record.given_up):
            return False
        record.given_up = [kept for kept in record.given_up if kept is not pending]
        self._release(peer)
        return True

    def _added(self, peer: str, pending: PendingHello) -> list[AssociationAction]:
        """The transport is done with `pending`: a Hello that came meanwhile is decided next."""
        record = self._peers.get(peer)
        if record is None or record.adding is not pending:
            return []
        deferred = record.deferred
        record.adding = record.deferred = None
        self._release(peer)
        return [] if deferred is None else [Redeliver(peer, *deferred)]

    def _take_early(self, peer: str) -> list[ControlMessage]:
        """What `peer` said early, in order, no longer kept."""
        record = self._peers.get(peer)
        if record is None:
            return []
        early, record.early = record.early, []
        self._release(peer)
        return early

    def hello_sent(self, peer: str, now: float) -> list[AssociationAction]:
        """Our answer to the Hello that started the association with `peer` went out: the
        association is in place, and what the peer said meanwhile is decided now, in order."""
        return self._connected(peer, now) if self._move(peer, Event.ANSWER_SENT) is Do.CONNECT else []

    def _connected(self, peer: str, now: float) -> list[AssociationAction]:
        actions: list[AssociationAction] = [
            HandshakeSettled(peer),
            *self.teardowns.heard_again(peer, now),
            PeerConnected(peer, now),
        ]
        incarnation = self._peers[peer].incarnation
        assert incarnation is not None  # the association's data is in place (a live phase)
        for message in self._take_early(peer):
            actions += self.receive(peer, incarnation, message, now)  # from no run once torn down by one of them
        return actions

    def hello_unsent(self, peer: str, error: KVFlowError) -> list[AssociationAction]:
        """Our answer to `peer`'s Hello cannot be sent (the address it gave is unusable, or it is
        not reading): the association it started ends before it began."""
        if self._move(peer, Event.ANSWER_UNSENT) is not Do.GIVE_UP:
            return []
        self._forget(peer)
        return [
            Refused(peer, error),
            TearDown(peer, f"cannot answer its hello: {error}"),
            HandshakeSettled(peer, error),
        ]

    def _on_hello(self, sender: str, incarnation: int, hello: Hello, now: float) -> list[AssociationAction]:
        record = self._peers.get(sender)
        theirs = None if record is None else record.theirs
        related = relate_hello(self._run(sender), theirs, incarnation, hello.reply, hello.association)
        do = self._move(sender, related)
        if do is Do.SETTLE:
            return [HandshakeSettled(sender)]
        if do is Do.ANSWER_AGAIN:
            return [SendHello(sender, reply=True, best_effort=True, association=self._number(sender))]
        if do is Do.DEFER:
            self._record(sender).deferred = (incarnation, hello)  # decided once the transport is done
            return []
        if do is Do.REFUSE_OLDER_RUN:
            return [Refused(sender, PeerProtocolError(f"hello from an earlier run of {sender!r} ({incarnation})"))]
        if do is not Do.VET:
            return []
        vetted, outcome = self._vet(sender, incarnation, hello, now)
        do = self._move(sender, vetted)
        if do is Do.REFUSE_SILENTLY:
            # no answer: a Reject would cost the very resources the limit bounds, and would go
            # to an address the deployment does not permit
            error = PeerNotAllowed(outcome) if isinstance(outcome, str) else self._full_error()
            return [Refused(sender, error, abandon=vetted is Event.NOT_PERMITTED), HandshakeSettled(sender, error)]
        if do is Do.REFUSE and isinstance(outcome, KVFlowError):
            return self._refuse(sender, hello, outcome)
        if do is not Do.ROUTE or not isinstance(outcome, PendingHello):
            return []
        if hello.control_address:
            return self._route(sender, hello.control_address, outcome)
        return self.route_added(sender, outcome, now)

    def _vet(
        self, sender: str, incarnation: int, hello: Hello, now: float
    ) -> tuple[Event, str | KVFlowError | PendingHello | None]:
        """A new Hello's checks: the event they make, with what names the problem, or the
        Hello to associate."""
        problem = self._not_permitted(sender, hello.control_address)
        if problem is not None:
            return Event.NOT_PERMITTED, problem
        if self._full(sender):
            return Event.FULL, None
        try:
            if self.refusing:
                raise PeerProtocolError(f"{self.engine_id!r} accepts no handshake now: {self.refusing}")
            cooling = self.teardowns.cooling_until(sender)
            if cooling is not None:
                wait = cooling - now
                raise PeerProtocolError(f"{self.engine_id!r} tore {sender!r} down moments ago; retry in {wait:.1f}s")
            if hello.engine_id != sender:
                raise PeerProtocolError(f"hello from {sender!r} claims to be {hello.engine_id!r}")
            check_compatible(self.fingerprint, hello.fingerprint)
            return Event.ACCEPTED, PendingHello(incarnation, hello, layout_from_wire(hello.layout))
        except KVFlowError as exc:
            return Event.UNACCEPTABLE, exc

    def _not_permitted(self, peer: str, address: str, *, local: bool = False) -> str | None:
        if peer == self.engine_id:
            return f"{peer!r} is this engine: an engine does not transfer with itself"
        # A second name for an associated peer's address (a request naming a made-up engine
        # there) would open a second connection under our identity, which the peer's socket
        # hands our live connection's place to: the live one is dropped with what it carries.
        if local and address:
            live = (p for p, record in self._peers.items() if record.address == address and record.layout is not None)
            owner = next(live, peer)
            if owner != peer:
                return f"{address!r:.80} is the control address of {owner!r}, not of {peer!r}"
        return self.allowed.problem(peer, address)

    def _full_error(self) -> KVFlowError:
        return PeerProtocolError(f"{self.engine_id!r} is at its limit of {self.max_peers} peers")

    def _full(self, peer: str) -> bool:
        return not self.engaged(peer) and self._engaged >= self.max_peers

    def _refuse(self, sender: str, hello: Hello, error: KVFlowError) -> list[AssociationAction]:
        lasting = isinstance(error, LayoutMismatch | ConfigError | PeerNotAllowed | UnsupportedVersion)
        actions: list[AssociationAction] = [Refused(sender, error, abandon=lasting and self.layout(sender) is None)]
        if not hello.reply:
            if isinstance(error, LayoutMismatch):  # our Hello lets the peer name the field too
                actions.append(SendHello(sender, reply=True, best_effort=True))
            else:
                actions.append(SendControl(sender, Reject(str(error))))
        actions.append(HandshakeSettled(sender, error))
        return actions
