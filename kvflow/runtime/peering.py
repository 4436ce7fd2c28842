"""Executing what `Associations` decides: routes, transport peers, Hellos, teardowns.

Why apart from the engine: the engine drives transfers; this drives *peers*.  Every decision
about who may associate, and when a peer is lost, is pure (`kvflow.protocol.association`); this
module performs the effects in the order they were decided and feeds each outcome that can fail
(a route refused, a transport refusing a peer's memory) back as an input.  It keeps no state of
its own beyond its collaborators: the engine hands it the transfer core's entry points as
callbacks, so the core stays the engine's.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvflow.control.channel import ControlChannel
from kvflow.errors import KVFlowError, TransportError
from kvflow.layout import KVLayout, layout_to_wire
from kvflow.protocol.actions import Action
from kvflow.protocol.association import (
    AddRoute,
    AddTransportPeer,
    AssociationAction,
    Associations,
    AwaitHandshake,
    Deliver,
    HandshakeSettled,
    PeerConnected,
    Refused,
    RenewLeases,
    SendControl,
    SendHeartbeat,
    SendHello,
    TearDown,
    UnknownSender,
)
from kvflow.protocol.core import TransferCore
from kvflow.protocol.messages import ControlMessage, Goodbye, Heartbeat, Hello
from kvflow.runtime.config import EngineConfig
from kvflow.runtime.handshakes import Handshakes
from kvflow.transports.base import Transport

__all__ = ("EngineHooks", "PeerExecutor")

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineHooks:
    """What the executor needs from its engine, as callbacks (the engine's loop and state)."""

    run: Callable[[list[Action]], None]  # execute the transfer core's actions
    now: Callable[[], float]
    loop: Callable[[], asyncio.AbstractEventLoop]  # :raises EngineClosed: not started
    later: Callable[..., None]  # later(delay, fn, *args): call fn on the loop, guarded, after delay
    running: Callable[[], bool]
    closed: Callable[[], bool]


class PeerExecutor:
    """Executes association actions for one engine."""

    def __init__(
        self,
        engine_id: str,
        layout: KVLayout,
        transport: Transport,
        control: ControlChannel,
        config: EngineConfig,
        assoc: Associations,
        core: TransferCore,
        counters: dict[str, int],
        hooks: EngineHooks,
    ) -> None:
        self.engine_id = engine_id
        self.layout = layout
        self.transport = transport
        self.control = control
        self.config = config
        self.assoc = assoc
        self.core = core
        self.counters = counters
        self.hooks = hooks
        self.handshakes = Handshakes()  # a local connect waits on these

    def associate(self, actions: list[AssociationAction]) -> None:
        """Execute, in order, what `Associations` decided.

        :raises PeerUnknown, PeerUnreachable, EngineClosed: a local connect's Hello cannot be sent.
        :raises ConfigError: the channel refused the address of a local connect.
        """
        queue = deque(actions)
        while queue:
            action = queue.popleft()
            if isinstance(action, Deliver):
                self.hooks.run(self.core.receive(action.peer, action.message, self.hooks.now()))
            elif isinstance(action, SendHeartbeat):
                self.try_send(action.peer, Heartbeat(self.core.waiting_on(action.peer)))
            elif isinstance(action, SendControl):
                self.try_send(action.peer, action.message)
            elif isinstance(action, SendHello):
                queue.extendleft(reversed(self._send_hello(action)))
            elif isinstance(action, RenewLeases):
                self.hooks.run(self.core.renew(action.peer, action.keys, action.now, action.lease))
            elif isinstance(action, TearDown):
                self.remove_peer(action.peer, action.reason, expected=action.expected)
            elif isinstance(action, AddTransportPeer):
                queue.extendleft(reversed(self._add_transport_peer(action)))
            elif isinstance(action, PeerConnected):
                self.hooks.run(self.core.peer_connected(action.peer, action.now))
            elif isinstance(action, AddRoute):
                queue.extendleft(reversed(self._add_route(action)))
            elif isinstance(action, AwaitHandshake):
                self.handshakes.begin(action.peer, self.hooks.loop())
            elif isinstance(action, HandshakeSettled):
                self.handshakes.settle(action.peer, action.error)
            elif isinstance(action, Refused):
                self.counters["peers_refused"] += 1
                log.error("%s: refusing peer %s: %s", self.engine_id, action.peer, action.error)
            elif isinstance(action, UnknownSender):
                self.counters["messages_from_unknown_peers"] += 1

    def try_send(self, peer: str, message: ControlMessage) -> KVFlowError | None:
        """Send; a failure is counted, logged and returned, never raised."""
        try:
            self.control.send(peer, message)
        except KVFlowError as exc:
            self.counters["sends_failed"] += 1
            # A goodbye often races the peer's own: the peer may have left first.
            level = logging.DEBUG if isinstance(message, Goodbye) else logging.WARNING
            log.log(level, "%s: cannot send to %s: %s", self.engine_id, peer, exc)
            return exc
        return None

    def tear_down(self, peer: str, reason: str) -> None:
        """End the association with `peer`, then remove it (see `remove_peer`)."""
        self.assoc.dropped(peer)
        self.remove_peer(peer, reason, expected=False)

    def remove_peer(self, peer: str, reason: str, *, expected: bool) -> None:
        """Remove the peer from the transport, then tell the core that nothing of it can land.

        Done here, on the loop: by the transport contract a submission still queued on the
        writer thread for this peer is refused once `remove_peer` has returned.
        """
        log.log(
            logging.INFO if expected else logging.WARNING, "%s: tearing down peer %s: %s", self.engine_id, peer, reason
        )
        self.transport.remove_peer(peer)
        grace = 0.0 if self.transport.capabilities.fences_inbound else self.config.unfenced_grace
        if grace > 0 and self.hooks.running():
            # The peer's own WRITEs (or READs) may still be in flight towards us: give them time
            # to land before its transfers' blocks may go back.  No new association meanwhile.
            self.assoc.start_cooling(peer, self.hooks.now() + grace)
            self.hooks.later(grace, self._peer_gone, peer)
        elif not self.hooks.closed():
            self.hooks.run(self.core.peer_lost(peer, self.hooks.now()))

    def _peer_gone(self, peer: str) -> None:
        self.assoc.stop_cooling(peer)
        self.hooks.run(self.core.peer_lost(peer, self.hooks.now()))

    def _add_route(self, action: AddRoute) -> list[AssociationAction]:
        """:raises ConfigError: the channel refused the address of a local connect."""
        try:
            self.control.add_route(action.peer, action.address)
        except KVFlowError as exc:
            if action.pending is None:
                raise
            return self.assoc.pending_refused(action.peer, action.pending, exc)
        return [] if action.pending is None else self.assoc.route_added(action.peer, action.pending, self.hooks.now())

    def _add_transport_peer(self, action: AddTransportPeer) -> list[AssociationAction]:
        """A transport refusing a peer's metadata refuses the peer; it never crashes the engine."""
        try:
            pending = action.pending
            self.transport.add_peer(action.peer, pending.hello.transport_metadata, pending.layout.regions)
        except TransportError as exc:
            return self.assoc.pending_refused(action.peer, action.pending, exc)
        return self.assoc.transport_peer_added(action.peer, action.pending, self.hooks.now())

    def _send_hello(self, action: SendHello) -> list[AssociationAction]:
        """Send our Hello; when it answers a peer's, its outcome is an input of the associations.

        :raises PeerUnknown, PeerUnreachable, EngineClosed: a local connect's Hello was not sent.
        """
        try:
            wire_layout, metadata = layout_to_wire(self.layout), self.transport.local_metadata()
            hello = Hello(
                self.engine_id, self.assoc.fingerprint, wire_layout, metadata, action.reply, self.control.address
            )
            self.control.send(action.peer, hello)
        except KVFlowError as exc:
            if action.associating:
                self.counters["sends_failed"] += 1
                return self.assoc.hello_unsent(action.peer, exc)
            if not action.best_effort:
                raise
            log.warning("%s: cannot answer %s: %s", self.engine_id, action.peer, exc)
            return []
        return self.assoc.hello_sent(action.peer, self.hooks.now()) if action.associating else []
