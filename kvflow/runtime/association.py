"""Peer associations: handshake, incarnations, heartbeats and leases.

Why separate from the engine: this is about *peers*, not transfers.  An association starts with
a Hello each way (KV layouts compared field by field, transport metadata exchanged) and lasts
for one incarnation of each side.  While it lasts, each side sends a Heartbeat every
`heartbeat_interval`; D's heartbeats list the transfers it still waits on, which renews P's lease
on their blocks.  A peer silent for a whole `lease`, a Goodbye, or a Hello from a new
incarnation ends the association, and the engine tears the peer down so that nothing of it can
land afterwards.

`Liveness` is the pure part (time is an input); `Associations` drives it for one engine.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from kvflow.errors import KVFlowError, LayoutMismatch, PeerProtocolError, TransferTimeout
from kvflow.layout import KVLayout, check_compatible, layout_from_wire, layout_to_wire
from kvflow.protocol.messages import (
    ControlMessage,
    Done,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    Notice,
    Quiesced,
    Ready,
    Registration,
    Reject,
)

if TYPE_CHECKING:
    from kvflow.runtime.engine import Engine

__all__ = ("Associations", "Liveness")

log = logging.getLogger(__name__)


class Liveness:
    """When each peer is due a heartbeat, and when a silent one counts as lost."""

    def __init__(self, lease: float, interval: float) -> None:
        self.lease = lease
        self.interval = interval
        self._heard: dict[str, float] = {}
        self._next_beat: dict[str, float] = {}

    def add(self, peer: str, now: float) -> None:
        self._heard[peer] = now
        self._next_beat[peer] = now + self.interval

    def remove(self, peer: str) -> None:
        self._heard.pop(peer, None)
        self._next_beat.pop(peer, None)

    def heard(self, peer: str, now: float) -> None:
        if peer in self._heard:
            self._heard[peer] = max(self._heard[peer], now)

    def due(self, now: float) -> list[str]:
        """Peers to send a heartbeat to now (each is then scheduled one interval later)."""
        peers = [p for p, at in self._next_beat.items() if at <= now]
        for peer in peers:
            self._next_beat[peer] = now + self.interval
        return sorted(peers)

    def expired(self, now: float) -> list[str]:
        return sorted(p for p, at in self._heard.items() if at + self.lease <= now)

    def next_deadline(self) -> float | None:
        times = list(self._next_beat.values()) + [at + self.lease for at in self._heard.values()]
        return min(times, default=None)


class Associations:
    """The engine's peers: handshakes in progress, live associations and their liveness."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        config = engine.config
        self.layouts: dict[str, KVLayout] = {}
        self.incarnations: dict[str, int] = {}
        self.liveness = Liveness(config.lease, config.heartbeat_interval or config.lease / 6)
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self.cooling: dict[str, float] = {}  # torn-down peers whose late ops may still land: until when

    async def connect(self, peer: str, address: str, timeout: float) -> None:
        """:raises LayoutMismatch, PeerProtocolError, TransferTimeout, PeerUnknown, ConfigError."""
        if peer in self.layouts:
            return
        if address:
            self.engine.control.add_route(peer, address)
        waiter = self._waiters.get(peer)
        if waiter is None or waiter.done():
            waiter = self._waiters[peer] = self.engine._running_loop().create_future()
        self._send_hello(peer, reply=False)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            raise TransferTimeout(f"handshake with {peer!r} got no answer within {timeout}s") from None

    def dropped(self, peer: str) -> None:
        """The engine tore `peer` down: forget the association."""
        self.layouts.pop(peer, None)
        self.incarnations.pop(peer, None)
        self.liveness.remove(peer)

    # ---------------------------------------------------------------- inbound

    def receive(self, sender: str, incarnation: int, message: ControlMessage) -> Message | None:
        """Handle what is about the association; return a transfer message for the core, or
        None when the message was consumed here (or dropped)."""
        engine = self.engine
        if isinstance(message, Hello):
            self._on_hello(sender, incarnation, message)
            return None
        if isinstance(message, Reject):
            self._fail_waiter(sender, PeerProtocolError(f"{sender!r} refused the handshake: {message.reason}"))
            return None
        known = self.incarnations.get(sender)
        if known is None or known != incarnation:
            engine.counters["messages_from_unknown_peers"] += 1  # not associated, or an old run
            return None
        self.liveness.heard(sender, engine._now())
        if isinstance(message, Goodbye):
            engine._tear_down(sender, f"peer said goodbye: {message.reason}", expected=True)
            return None
        if isinstance(message, Heartbeat):
            engine._run(engine.core.renew(sender, message.keys, engine._now(), self.liveness.lease))
            return None
        return message if isinstance(message, Registration | Ready | Notice | Quiesced | Done) else None

    def _on_hello(self, sender: str, incarnation: int, hello: Hello) -> None:
        engine = self.engine
        known = self.incarnations.get(sender)
        if hello.reply and known == incarnation:
            self._resolve_waiter(sender)
            return  # the answer to our Hello, after the peer's own Hello had connected us
        try:
            if sender in self.cooling:
                wait = self.cooling[sender] - engine._now()
                raise PeerProtocolError(f"{engine.engine_id!r} tore {sender!r} down moments ago; retry in {wait:.1f}s")
            if hello.engine_id != sender:
                raise PeerProtocolError(f"hello from {sender!r} claims to be {hello.engine_id!r}")
            check_compatible(engine._fingerprint, hello.fingerprint)
            layout = layout_from_wire(hello.layout)
            if hello.control_address:
                engine.control.add_route(sender, hello.control_address)
        except KVFlowError as exc:
            log.error("%s: refusing peer %s: %s", engine.engine_id, sender, exc)
            if not hello.reply:
                if isinstance(exc, LayoutMismatch):  # our Hello lets the peer name the field too
                    self._try_send_hello(sender)
                else:
                    self._try_send(sender, Reject(str(exc)))
            self._fail_waiter(sender, exc)
            return
        if sender in self.layouts:
            # The peer started over (a new run, or a new association after tearing us down):
            # nothing of the old association may survive it.
            engine._tear_down(sender, "peer started a new association")
        engine.transport.add_peer(sender, hello.transport_metadata, layout.regions)
        self.layouts[sender] = layout
        self.incarnations[sender] = incarnation
        self.liveness.add(sender, engine._now())
        if not hello.reply:
            self._send_hello(sender, reply=True)
        self._resolve_waiter(sender)
        engine._run(engine.core.peer_connected(sender, engine._now()))

    # ---------------------------------------------------------------- timer

    def tick(self, now: float) -> None:
        """Send due heartbeats; end associations whose peer stayed silent for a lease."""
        engine = self.engine
        for peer in self.liveness.expired(now):
            engine._tear_down(peer, f"no message for {self.liveness.lease}s")
        for peer in self.liveness.due(now):
            self._try_send(peer, Heartbeat(engine.core.waiting_on(peer)))

    def goodbye_all(self, reason: str) -> None:
        for peer in sorted(self.layouts):
            self._try_send(peer, Goodbye(reason))

    # ---------------------------------------------------------------- plumbing

    def _send_hello(self, peer: str, *, reply: bool) -> None:
        engine = self.engine
        hello = Hello(
            engine.engine_id,
            "both",
            engine._fingerprint,
            layout_to_wire(engine.layout),
            engine.transport.local_metadata(),
            reply,
            engine.control.address,
        )
        engine.control.send(peer, hello)

    def _try_send_hello(self, peer: str) -> None:
        try:
            self._send_hello(peer, reply=True)
        except KVFlowError as exc:
            log.warning("%s: cannot answer %s: %s", self.engine.engine_id, peer, exc)

    def _try_send(self, peer: str, message: ControlMessage) -> None:
        try:
            self.engine.control.send(peer, message)
        except KVFlowError as exc:
            self.engine.counters["sends_failed"] += 1
            log.warning("%s: cannot send to %s: %s", self.engine.engine_id, peer, exc)

    def _resolve_waiter(self, peer: str) -> None:
        waiter = self._waiters.pop(peer, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail_waiter(self, peer: str, exc: KVFlowError) -> None:
        waiter = self._waiters.pop(peer, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def close(self) -> None:
        for peer, waiter in list(self._waiters.items()):
            if not waiter.done():
                waiter.set_exception(TransferTimeout(f"engine closed during the handshake with {peer!r}"))
        self._waiters.clear()
