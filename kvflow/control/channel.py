"""The control channel contract, and an in-process implementation joining engines by name.

Why a separate contract: the engine only needs "send this message to that peer" and "call me
when a message arrives".  The in-process hub here serves tests, examples and simulations with
engines in one process (each possibly on its own thread and loop); the authenticated
msgpack-over-ZeroMQ channel serves engines in different processes.

Messages are delivered on the receiving engine's own event loop, in the order they were sent
between each pair of engines, never re-entrantly inside `send`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections.abc import Callable
from typing import Protocol

from kvflow.control import wire
from kvflow.errors import EngineClosed, KVFlowError, PeerUnknown, PeerUnreachable
from kvflow.protocol.messages import ControlMessage

__all__ = (
    "MAX_CLOCK_SKEW",
    "ControlChannel",
    "Crashed",
    "LocalControl",
    "LocalControlHub",
    "MessageHandler",
    "incarnation_ceiling",
    "new_incarnation",
)

MessageHandler = Callable[[str, int, ControlMessage], None]  # (sender, its incarnation, message)
Crashed = Callable[[BaseException], None]  # told of a failure of the channel's own receiving
MAX_CLOCK_SKEW = 300  # seconds one host's clock may run ahead of another's


def new_incarnation() -> int:
    """An id for one run of an engine, larger than any earlier run's (clock, in microseconds) and
    unique (random low bits); below 2**63, the wire's limit, until the year 3100."""
    return ((time.time_ns() // 1000) << 8) | secrets.randbits(8)


def incarnation_ceiling(now_ns: int) -> int:
    """The largest incarnation a run started by now can have, with `MAX_CLOCK_SKEW` seconds
    for hosts' clocks that disagree.  A larger one is no clock reading: accepted, it would make
    every frame of the sender's real runs look like a replay until the clocks caught up."""
    return ((now_ns // 1000 + MAX_CLOCK_SKEW * 1_000_000) << 8) | 0xFF


class ControlChannel(Protocol):
    @property
    def address(self) -> str:
        """Where peers reach this channel ("" when routes are implicit, as in-process)."""

    @property
    def incarnation(self) -> int:
        """This run's incarnation, stamped on every message sent."""

    def start(self, loop: asyncio.AbstractEventLoop, handler: MessageHandler, on_crash: Crashed | None = None) -> None:
        """Begin delivering messages to `handler(sender, incarnation, message)` on `loop`; a
        failure of the channel's own receiving (a bug, not a peer's bad frame) goes to
        `on_crash` (logged where none), never only to a task nobody awaits.

        :raises ConfigError: the channel cannot listen where it was told to.
        :raises UsageError: the channel was started before (where it can tell).
        """

    def add_route(self, peer: str, address: str) -> None:
        """Tell the channel where `peer` listens (a no-op where routes are implicit).

        :raises ConfigError: the address is unusable (for instance, unauthenticated off loopback).
        """

    def set_link_listener(self, listener: Callable[[str, bool], None] | None) -> None:
        """Call `listener(peer, up)` on the loop when the connection to a peer drops (`up` False)
        or comes back (True), where the channel can tell; a no-op where it cannot.  Never raises."""

    def forget(self, peer: str) -> None:
        """`peer` is not (or no longer) associated: close the connection to it (what was queued
        on it still leaves, briefly) and drop the route it taught; a route the channel was
        configured with stays.  A later `add_route` (or the peer's next Hello) brings it back.
        Never raises."""

    def send(self, peer: str, message: ControlMessage) -> None:
        """Queue a message for `peer`; never blocks.

        :raises PeerUnknown: no route to `peer`.
        :raises PeerUnreachable: `peer` is known but cannot take the message now (it is not
            reading, its connection failed, or it stopped).
        :raises EngineClosed: the channel was closed.
        """

    def answer(self, peer: str, incarnation: int, message: ControlMessage) -> None:
        """From inside the handler: send `message` to run `incarnation` of `peer`, the sender of
        the message being handled, the way that message came (there may be no route to it), at
        most once a second per peer; best effort.  Never raises."""

    def close(self) -> None:
        """Stop sending and delivering.  Idempotent."""


class LocalControlHub:
    """Routes messages between `LocalControl` endpoints in one process."""

    def __init__(self) -> None:
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, MessageHandler]] = {}
        self._lock = threading.Lock()
        self.delivered = 0

    def channel(self, name: str) -> LocalControl:
        """The endpoint of engine `name`; it receives once started.  Never raises."""
        return LocalControl(self, name)

    def register(self, name: str, loop: asyncio.AbstractEventLoop, handler: MessageHandler) -> None:
        """Deliver messages for `name` to `handler`, on `loop` (replacing any earlier handler)."""
        with self._lock:
            self._routes[name] = (loop, handler)

    def unregister(self, name: str) -> None:
        with self._lock:
            self._routes.pop(name, None)

    def route(self, sender: str, incarnation: int, peer: str, message: ControlMessage) -> None:
        """Hand `message` to `peer`'s loop.  :raises PeerUnknown: `peer` is not registered or gone."""
        with self._lock:
            route = self._routes.get(peer)
        if route is None:
            raise PeerUnknown(f"no engine named {peer!r} on this control hub")
        loop, handler = route
        try:
            loop.call_soon_threadsafe(self._deliver, handler, peer, sender, incarnation, message)
        except RuntimeError as exc:  # the peer's loop is closed: it is gone
            raise PeerUnreachable(f"engine {peer!r} is no longer running") from exc

    def _deliver(
        self, handler: MessageHandler, peer: str, sender: str, incarnation: int, message: ControlMessage
    ) -> None:
        with self._lock:
            live = peer in self._routes
        if live:
            self.delivered += 1
            handler(sender, incarnation, message)


class LocalControl:
    def __init__(self, hub: LocalControlHub, name: str) -> None:
        self.hub = hub
        self.name = name
        self._incarnation = new_incarnation()
        self._closed = False

    @property
    def address(self) -> str:
        return ""

    @property
    def incarnation(self) -> int:
        return self._incarnation

    def add_route(self, peer: str, address: str) -> None:
        return None

    def set_link_listener(self, listener: Callable[[str, bool], None] | None) -> None:
        return None  # in one process, a peer that goes away says goodbye or falls silent

    def start(self, loop: asyncio.AbstractEventLoop, handler: MessageHandler, on_crash: Crashed | None = None) -> None:
        self.hub.register(self.name, loop, handler)  # delivered by the hub: no receiving of its own

    def forget(self, peer: str) -> None:
        return None  # no connection per peer in one process

    def send(self, peer: str, message: ControlMessage) -> None:
        """:raises UnsendableMessage: the message could not cross a process (`wire.encode`): in
        one process too, so what the wire refuses is refused here alike."""
        if self._closed:
            raise EngineClosed(f"control channel of {self.name!r} is closed")
        wire.encode(wire.Envelope(self.name, self._incarnation, peer, 0, message))
        self.hub.route(self.name, self._incarnation, peer, message)

    def answer(self, peer: str, incarnation: int, message: ControlMessage) -> None:
        """Sent each time: in one process there is no connection to flood.  Never raises."""
        with contextlib.suppress(KVFlowError):  # routes are implicit here: the peer may be gone
            self.send(peer, message)

    def close(self) -> None:
        self._closed = True
        self.hub.unregister(self.name)
