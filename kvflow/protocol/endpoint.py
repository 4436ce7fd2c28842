"""One engine's whole pure state: its transfers, its peers and their teardowns, behind one door.

Why one object: the transfer core (`TransferCore`), the associations (`Associations`) and the
teardowns they own each decide part of what an engine does, and the decisions feed each other
(a Hello's association connects the peer's transfers; a transfer whose peer cannot be reached
tears the peer down; a removed peer's transfers fail, and a peer with nothing left to fence
leaves).  Coordinating them is itself a decision, so it lives here, pure, and not in the driver:
as aioquic's `QuicConnection`, the `Endpoint` takes every event with the time as an argument,
answers with one ordered list of effects (`Effect`) and tells the driver one `next_deadline`.

The driver executes effects in order and feeds each outcome that can fail back in (a send that
failed, a route refused, a transport peer added or refused, a removal done or failed); it decides
nothing.  Effects that are only bookkeeping between the machines (`Deliver`, `RenewLeases`,
`PeerConnected`, `Redeliver`, `PeerFenced`, `DeclarePeerLost`, `SendHeartbeat`) never leave
this module; `TearDown`, `PeerGone` and `Refused` do, after their consequences here, so that the
driver can log, count and close the peer's connection.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from kvflow.errors import KVFlowError, PeerUnknown, UnsendableMessage
from kvflow.layout import KVLayout
from kvflow.protocol.actions import Action, DeclarePeerLost, ReleaseBlocks, Resolve, SendMessage, SubmitOp
from kvflow.protocol.association import Associations
from kvflow.protocol.core import TransferCore
from kvflow.protocol.machine import Machine
from kvflow.protocol.messages import MAX_HEARTBEAT_KEYS, ControlMessage, FirstToken, Heartbeat, Message, TransferKey
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
    TokenArrived,
    UnknownSender,
)
from kvflow.protocol.requests import Abort, Expect, KvReady
from kvflow.protocol.state import Outcome, Role
from kvflow.protocol.teardown import HoldReport, PeerFenced, PeerGone, RemovalFailed, RemovePeer, TeardownAction

__all__ = ("Effect", "Endpoint", "PeerEffect")

# What the driver executes about peers: I/O, and the records it logs and counts.
PeerEffect = (
    SendControl
    | SendHello
    | AddRoute
    | AddTransportPeer
    | AwaitHandshake
    | HandshakeSettled
    | Refused
    | UnknownSender
    | AnswerUnassociated
    | TearDown
    | RemovePeer
    | RemovalFailed
    | PeerGone
    | TokenArrived
)
# ... and everything it executes: transfer effects too (messages, ops, outcomes, released blocks)
Effect = SendMessage | SubmitOp | ReleaseBlocks | Resolve | PeerEffect


class Endpoint:
    """The pure state of one engine.  Every input takes `now`; none raises unless it says so."""

    def __init__(self, core: TransferCore, associations: Associations, layout: KVLayout, *, auto_deliver: bool) -> None:
        """`core` and `associations` are fresh and from now on driven only through this object.
        `auto_deliver`: D's consumer takes a succeeded transfer's blocks as soon as it resolves."""
        self._core = core
        self._assoc = associations
        self._block_size = layout.spec.block_size
        self._auto_deliver = auto_deliver

    # ------------------------------------------------------------------ what there is

    @property
    def core(self) -> TransferCore:
        """The transfer core, to read (its inputs go through the endpoint)."""
        return self._core

    @property
    def associations(self) -> Associations:
        """The associations, to read (their inputs go through the endpoint)."""
        return self._assoc

    @property
    def fingerprint(self) -> dict[str, int | str]:
        return self._assoc.fingerprint

    def next_deadline(self) -> float | None:
        """When `timer` has something to do next (None: nothing is due, as things stand)."""
        core, peers = self._core.next_deadline(), self._assoc.next_deadline()
        return peers if core is None else core if peers is None else min(core, peers)

    def live(self) -> list[Machine]:
        return self._core.live()

    def live_count(self) -> int:
        return self._core.live_count()

    def machine(self, key: TransferKey, role: Role) -> Machine:
        """:raises UnknownTransfer: no such machine (or it was already forgotten)."""
        return self._core.machine(key, role)

    def registered(self, key: TransferKey) -> tuple[int, ...]:
        return self._core.registered(key)

    def peers(self) -> list[str]:
        """The peers associated now."""
        return self._assoc.peers()

    def peer_layout(self, peer: str) -> KVLayout | None:
        """The layout `peer` announced (None: not associated)."""
        return self._assoc.layout(peer)

    def keeps_connection(self, peer: str) -> bool:
        """Whether `peer` is associated or being added: its control connection stays open."""
        return self._assoc.engaged(peer)

    def unremoved(self) -> dict[str, int]:
        """Peers whose removal has not succeeded yet (their blocks stay held), and failures each."""
        return self._assoc.teardowns.unremoved()

    def backing_off(self) -> bool:
        """Whether a failed removal waits for its retry."""
        return self._assoc.teardowns.backing_off()

    def hold_report(self, now: float) -> HoldReport:
        return self._assoc.teardowns.report(now)

    def refuse_handshakes(self, reason: str) -> None:
        """Refuse every Hello for `reason` from now on (empty: accept them again)."""
        self._assoc.refusing = reason

    def closing(self) -> None:
        """The engine is closing: teardowns stop waiting out their graces."""
        self._assoc.teardowns.closing()

    # ------------------------------------------------------------------ transfers

    def expect(self, request: Expect, now: float, deadline: float) -> list[Effect]:
        """:raises InvalidBatch, BlockConflict, StaleEpoch, ConfigError: see `TransferCore.expect`."""
        return self._transfers(self._core.expect(request, now, deadline), now)

    def kv_ready(self, request: KvReady, now: float, deadline: float) -> list[Effect]:
        """:raises InvalidBatch, InvalidTransition, StaleEpoch, ConfigError: see `TransferCore.kv_ready`."""
        return self._transfers(self._core.kv_ready(request, now, deadline), now)

    def abort(self, request: Abort, now: float) -> list[Effect]:
        """:raises UnknownTransfer, StaleEpoch: see `TransferCore.abort`."""
        return self._transfers(self._core.abort(request, now), now)

    def abort_all(self, now: float, reason: str) -> list[Effect]:
        return self._transfers(self._core.abort_all(now, reason), now)

    def promise(self, key: TransferKey, peer: str, now: float) -> None:
        self._core.promise(key, peer, now)

    def delivered(self, key: TransferKey, now: float) -> list[Effect]:
        """:raises UnknownTransfer, InvalidTransition: not a finished D transfer here."""
        return self._transfers(self._core.delivered(key, now), now)

    def op_submitted(self, op_id: int, now: float) -> list[Effect]:
        return self._transfers(self._core.op_submitted(op_id, now), now)

    def op_finished(self, op_id: int, now: float, error: str | None = None) -> list[Effect]:
        return self._transfers(self._core.op_finished(op_id, now, error), now)

    def notification(self, peer: str, payload: bytes, now: float, problem: str | None) -> list[Effect]:
        return self._transfers(self._core.notification(peer, payload, now, problem), now)

    def send_failed(self, peer: str, message: Message, error: KVFlowError, now: float) -> list[Effect]:
        """A `SendMessage` could not be sent: a message the channel refuses fails only its own
        transfer; a peer that cannot be reached any more is torn down."""
        if isinstance(error, UnsendableMessage):
            return self._transfers(self._core.unsent(message.key, now, f"its {type(message).__name__}: {error}"), now)
        if self._assoc.layout(peer) is not None:
            return self.tear_down(peer, f"cannot send to it: {error}", now)
        return []

    def first_token(self, peer: str, key: TransferKey, token: int) -> list[Effect]:
        """Tell `peer` the first token sampled for transfer `key`'s request (best effort).

        :raises PeerUnknown: `peer` is not associated with this engine.
        """
        if self._assoc.layout(peer) is None:
            raise PeerUnknown(f"cannot send the first token of {key} to {peer!r}: not associated")
        return [SendControl(peer, FirstToken(key, token))]

    # ------------------------------------------------------------------ peers

    def connect(self, peer: str, address: str, now: float) -> list[Effect]:
        return self._peers(self._assoc.connect(peer, address), now)

    def receive(self, sender: str, incarnation: int, message: ControlMessage, now: float) -> list[Effect]:
        return self._peers(self._assoc.receive(sender, incarnation, message, now), now)

    def link_changed(self, peer: str, up: bool, now: float) -> list[Effect]:
        return self._peers(self._assoc.link_changed(peer, up, now), now)

    def tear_down(self, peer: str, reason: str, now: float) -> list[Effect]:
        """Tell `peer` why (best effort), end the association, remove the peer."""
        return self._peers(self._assoc.tear_down(peer, reason), now)

    def tear_down_unfenced(self, reason: str, now: float) -> list[Effect]:
        """Transfers are still live after their abort had time to fence: tear down every peer
        they wait on and every associated peer (none of them then gets a Goodbye it could act
        on), so that the transport's removals fence what is left."""
        waited_on = {m.peer for m in self._core.live() if m.peer is not None}
        effects: list[Effect] = []
        for peer in sorted(waited_on | set(self._assoc.peers())):
            effects += self.tear_down(peer, f"{reason}: fence not confirmed", now)
        return effects

    def goodbye_all(self, reason: str, now: float) -> list[Effect]:
        return self._peers(self._assoc.goodbye_all(reason), now)

    def route_added(self, peer: str, pending: PendingHello, now: float) -> list[Effect]:
        return self._peers(self._assoc.route_added(peer, pending, now), now)

    def pending_refused(self, peer: str, pending: PendingHello, error: KVFlowError, now: float) -> list[Effect]:
        return self._peers(self._assoc.pending_refused(peer, pending, error), now)

    def transport_peer_added(self, peer: str, pending: PendingHello, now: float) -> list[Effect]:
        return self._peers(self._assoc.transport_peer_added(peer, pending, now), now)

    def hello_sent(self, peer: str, now: float) -> list[Effect]:
        return self._peers(self._assoc.hello_sent(peer, now), now)

    def hello_unsent(self, peer: str, error: KVFlowError, now: float) -> list[Effect]:
        return self._peers(self._assoc.hello_unsent(peer, error), now)

    def removed(self, number: int, now: float) -> list[Effect]:
        return self._peers(self._assoc.teardowns.removed(number, now), now)

    def removal_failed(self, number: int, now: float, error: KVFlowError) -> list[Effect]:
        return self._peers(self._assoc.teardowns.removal_failed(number, now, error), now)

    # ------------------------------------------------------------------ time

    def timer(self, now: float) -> list[Effect]:
        """What is due at `now`: peers first (silent ones lost, heartbeats, teardowns), then
        transfers (expiries, retention)."""
        return [*self._peers(self._assoc.tick(now), now), *self._transfers(self._core.timer(now), now)]

    # ------------------------------------------------------------------ coordination

    def _transfers(self, actions: Iterable[Action], now: float) -> list[Effect]:
        """The core's actions as effects, in order, with what each one means for the peers."""
        effects: list[Effect] = []
        for action in actions:
            if isinstance(action, DeclarePeerLost):
                effects += self.tear_down(action.peer, action.reason, now)
                continue
            effects.append(action)
            if isinstance(action, Resolve) and self._delivers(action):
                effects += self._transfers(self._core.delivered(action.key, now), now)
        return effects

    def _delivers(self, resolved: Resolve) -> bool:
        return self._auto_deliver and resolved.role is Role.DECODE and resolved.outcome is Outcome.SUCCEEDED

    def _peers(self, actions: Sequence[AssociationAction | TeardownAction], now: float) -> list[Effect]:
        """The associations' and teardowns' actions as effects, in order, each followed by its
        consequences for the transfers and for the other peer actions."""
        effects: list[Effect] = []
        queue: deque[AssociationAction | TeardownAction] = deque(actions)
        while queue:
            action = queue.popleft()
            if isinstance(action, Deliver):
                message = action.message
                if isinstance(message, FirstToken):  # not the core's business: the host's
                    effects.append(TokenArrived(action.peer, message))
                else:
                    effects += self._transfers(self._core.receive(action.peer, message, now), now)
            elif isinstance(action, SendHeartbeat):
                keys = self._core.heartbeat_keys(action.peer, now)
                for start in range(0, max(len(keys), 1), MAX_HEARTBEAT_KEYS):  # what one frame may name
                    effects.append(SendControl(action.peer, Heartbeat(keys[start : start + MAX_HEARTBEAT_KEYS])))
            elif isinstance(action, RenewLeases):
                effects += self._transfers(self._core.renew(action.peer, action.keys, action.now, action.lease), now)
            elif isinstance(action, TearDown):
                effects.append(action)
                gone = self._assoc.teardowns.torn_down(action.peer, action.reason, now, answered=action.answered)
                queue.extendleft(reversed(gone))
            elif isinstance(action, PeerGone):
                effects.append(action)
                lost = self._core.peer_lost(action.peer, now, action.reason, unfenced=action.unfenced)
                effects += self._transfers(lost, now)
                if action.unfenced and not self._core.unfenced(action.peer):
                    queue.extendleft(reversed(self._assoc.teardowns.nothing_held(action.peer, now)))
            elif isinstance(action, PeerFenced):
                effects += self._transfers(self._core.peer_fenced(action.peer), now)
            elif isinstance(action, Redeliver):
                queue.extendleft(reversed(self._assoc.receive(action.peer, action.incarnation, action.hello, now)))
            elif isinstance(action, PeerConnected):
                ratio = self._block_ratio(action.peer)
                effects += self._transfers(self._core.peer_connected(action.peer, action.now, ratio), now)
            elif isinstance(action, Refused):
                effects.append(action)
                if action.abandon:
                    why = f"its handshake was refused: {action.error}"
                    effects += self._transfers(self._core.peer_lost(action.peer, now, why, refused=True), now)
            else:
                effects.append(action)
        return effects

    def _block_ratio(self, peer: str) -> int:
        """The larger of our and `peer`'s block sizes over the smaller (1: equal, not multiples,
        or no layout known)."""
        remote = self._assoc.layout(peer)
        if remote is None:
            return 1
        small, large = sorted((self._block_size, remote.spec.block_size))
        return large // small if large % small == 0 else 1
