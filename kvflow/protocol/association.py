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
        self.layouts: dict[str, KVLayout] = {}
        self.incarnations: dict[str, int] = {}
        self.liveness = Liveness(lease, interval, confirm)
        # torn-down peers on their way out; those whose late ops may still land cool: no new association
        self.teardowns = Teardowns(grace, hold, lease)
        # peers the transport is adding (off the loop), and the newest Hello each sent meanwhile
        self.adding: dict[str, PendingHello] = {}
        self.deferred: dict[str, tuple[int, Hello]] = {}
        # messages a peer sent once associated with us, before our side of the association was in
        # place (the transport still adding it): delivered, in order, once it is
        self.early: dict[str, list[ControlMessage]] = {}
        # the control address each peer was last routed at (kept for live ones; attempts bounded)
        self.addresses: dict[str, str] = {}
        # our number for each association we hold or are attempting (a handshake that timed out
        # here may still be answered, or retried: both keep the number), and the peer's number
        # for each live one; the attempts kept are bounded, live ones first
        self.ours: dict[str, int] = {}
        self.theirs: dict[str, int] = {}
        self._numbered = 0
        self.refusing = ""  # why every Hello is refused now (the engine asleep); empty: none is
        self.phases: dict[str, Phase] = {}  # every peer not in `Phase.NONE`
        # additions torn down before the transport answered (the peer cools meanwhile, so
        # rarely more than one; one per teardown whatever the runtime's order)
        self.given_up: dict[str, list[PendingHello]] = {}

    def peers(self) -> list[str]:
        return sorted(self.layouts)

    def phase(self, peer: str) -> Phase:
        return self.phases.get(peer, Phase.NONE)

    def _move(self, peer: str, event: Event) -> Do | None:
        """Move `peer` by the table's row for `event` in its phase; the row's step (None: none)
        is the caller's to take."""
        to, steps = TABLE[self.phase(peer), event]
        if to is Phase.NONE:
            self.phases.pop(peer, None)
        else:
            self.phases[peer] = to
        return steps[0] if steps else None

    def _run(self, peer: str) -> int | None:
        """The run of `peer` in place: the associated one, or the one the transport is adding."""
        pending = self.adding.get(peer) if self.phase(peer) is Phase.ADDING else None
        return self.incarnations.get(peer) if pending is None else pending.incarnation

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
        self.addresses[peer] = address
        if len(self.addresses) > ATTEMPTS_KEPT:
            for stale in [p for p in self.addresses if p not in self.layouts and p not in self.adding and p != peer]:
                del self.addresses[stale]
        return [AddRoute(peer, address, pending)]

    def _number(self, peer: str) -> int:
        """Our number for the association with `peer`: the one held or attempted, else a new one."""
        number = self.ours.get(peer)
        if number is None:
            self._numbered += 1
            number = self.ours[peer] = self._numbered
            if len(self.ours) > ATTEMPTS_KEPT:  # the oldest attempt never answered goes
                stale = next((p for p in self.ours if p not in self.layouts and p not in self.adding), None)
                if stale is not None:
                    del self.ours[stale]
        return number

    def _forget(self, peer: str) -> None:
        """`peer` is being torn down: forget the association's data (the caller moved its phase)."""
        self.early.pop(peer, None)
        self.layouts.pop(peer, None)
        self.incarnations.pop(peer, None)
        self.ours.pop(peer, None)  # the next association with it is numbered anew
        self.theirs.pop(peer, None)
        self.addresses.pop(peer, None)
        self.liveness.remove(peer)

    def tear_down(self, peer: str, reason: str, *, answered: bool = False) -> list[AssociationAction]:
        """This side ends the association with `peer` (silent for a lease, no fence, cannot be
        sent to): tell the peer why, best effort, then tear it down.  Without the goodbye a peer
        that was only paused (stopped, swapped out) would learn nothing and keep its side of
        every transfer alive, so that the two sides could end the same transfer differently."""
        if self.phase(peer) is Phase.ADDING:  # given up: the transport's answer about it is stale
            self.given_up.setdefault(peer, []).append(self.adding.pop(peer))
            self.deferred.pop(peer, None)
        self._move(peer, Event.LOST)
        goodbye: list[AssociationAction] = [SendControl(peer, Goodbye(reason))] if peer in self.layouts else []
        self._forget(peer)
        return [*goodbye, TearDown(peer, reason, answered=answered)]

    def goodbye_all(self, reason: str) -> list[AssociationAction]:
        return [SendControl(peer, Goodbye(reason)) for peer in sorted(self.layouts)]

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
            if self._move(sender, relate_reject(self.incarnations.get(sender), incarnation)) is Do.END_RUN:
                self._forget(sender)  # a later run of an associated peer: the old one is gone
                return [TearDown(sender, f"a later run of it says: {message.reason}", answered=True), refused]
            return [refused]
        do = self._move(sender, relate_message(self._run(sender), incarnation, isinstance(message, Goodbye)))
        if do is Do.KEEP_EARLY:
            early = self.early.setdefault(sender, [])
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
        self.adding[peer] = pending
        return actions

    def pending_refused(self, peer: str, pending: PendingHello, error: KVFlowError) -> list[AssociationAction]:
        """What a pending Hello needs was refused (the control channel refused its address, or
        the transport what it says about the peer's memory): refuse the peer.  The transport's
        refusal of an addition given up since is dropped."""
        if self._stale(peer, pending):
            return []
        self._move(peer, Event.PENDING_REFUSED)
        dropped = [UnknownSender(peer) for _ in self.early.pop(peer, ())]
        return [*self._refuse(peer, pending.hello, error), *dropped, *self._added(peer, pending)]

    def transport_peer_added(self, peer: str, pending: PendingHello, now: float) -> list[AssociationAction]:
        """The transport accepted the peer: the association begins (once our answer, when the
        peer started it, is sent: see `hello_sent`).  An addition given up since is dropped: the
        teardown's removal, queued behind it, undoes it."""
        if self._stale(peer, pending) or self.adding.get(peer) is not pending:
            return []  # given up, or never handed to the transport: nothing of it goes in place
        do = self._move(peer, Event.ADDED_ANSWERED if pending.hello.reply else Event.ADDED)
        self.layouts[peer] = pending.layout
        self.incarnations[peer] = pending.incarnation
        self.theirs[peer] = pending.hello.association
        self.liveness.add(peer, now)
        if do is Do.ANSWER_HELLO:
            answer = SendHello(peer, reply=True, associating=True, association=self._number(peer))
            return [answer, *self._added(peer, pending)]
        return [*self._connected(peer, now), *self._added(peer, pending)]

    def _stale(self, peer: str, pending: PendingHello) -> bool:
        """The transport's answer about `pending` comes for an addition given up (`tear_down`)."""
        given_up = self.given_up.get(peer, [])
        if not any(kept is pending for kept in given_up):
            return False
        given_up[:] = [kept for kept in given_up if kept is not pending]
        if not given_up:
            del self.given_up[peer]
        return True

    def _added(self, peer: str, pending: PendingHello) -> list[AssociationAction]:
        """The transport is done with `pending`: a Hello that came meanwhile is decided next."""
        if self.adding.get(peer) is not pending:
            return []
        del self.adding[peer]
        deferred = self.deferred.pop(peer, None)
        return [] if deferred is None else [Redeliver(peer, *deferred)]

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
        incarnation = self.incarnations[peer]
        for message in self.early.pop(peer, ()):
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
        related = relate_hello(self._run(sender), self.theirs.get(sender), incarnation, hello.reply, hello.association)
        do = self._move(sender, related)
        if do is Do.SETTLE:
            return [HandshakeSettled(sender)]
        if do is Do.ANSWER_AGAIN:
            return [SendHello(sender, reply=True, best_effort=True, association=self._number(sender))]
        if do is Do.DEFER:
            self.deferred[sender] = (incarnation, hello)  # decided once the transport is done
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
            owner = next((p for p, a in self.addresses.items() if a == address and p in self.layouts), peer)
            if owner != peer:
                return f"{address!r:.80} is the control address of {owner!r}, not of {peer!r}"
        return self.allowed.problem(peer, address)

    def _full_error(self) -> KVFlowError:
        return PeerProtocolError(f"{self.engine_id!r} is at its limit of {self.max_peers} peers")

    def _full(self, peer: str) -> bool:
        known = peer in self.layouts or peer in self.adding
        return not known and len(self.layouts) + len(self.adding) >= self.max_peers

    def _refuse(self, sender: str, hello: Hello, error: KVFlowError) -> list[AssociationAction]:
        lasting = isinstance(error, LayoutMismatch | ConfigError | PeerNotAllowed | UnsupportedVersion)
        actions: list[AssociationAction] = [Refused(sender, error, abandon=lasting and sender not in self.layouts)]
        if not hello.reply:
            if isinstance(error, LayoutMismatch):  # our Hello lets the peer name the field too
                actions.append(SendHello(sender, reply=True, best_effort=True))
            else:
                actions.append(SendControl(sender, Reject(str(error))))
        actions.append(HandshakeSettled(sender, error))
        return actions
