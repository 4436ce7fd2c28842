"""Watching the connections of a ZeroMQ control channel: is the link to a peer up or down?

Why: a peer whose process dies stops sending, but a lease (30 s by default) is a long time to
notice it, while the kernel closes its sockets at once.  ZeroMQ reports that on a socket monitor:
the DEALER to the peer sees `EVENT_DISCONNECTED`, and then either `EVENT_CONNECTED` again (the
peer is back: a transient drop) or only refused reconnection attempts (it is gone).  This module
turns those events into `listener(peer, up)` calls on the channel's loop; what a lost link means
(a suspect peer, confirmed dead if the link stays down) is the associations' decision, not ours.
A channel without a listener starts no monitor.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

__all__ = ("LinkListener", "LinkMonitors", "open_monitor")

LinkListener = Callable[[str, bool], None]  # (peer, link up?)
EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
_Reader = TypeVar("_Reader", bound="zmq.Socket[Any]")
_SERIAL = itertools.count()  # inproc endpoints are never reused, even for a socket at the same address


def open_monitor(sock: zmq.Socket[Any], events: int, kind: type[_Reader]) -> _Reader:
    """A PAIR socket of class `kind` (in `sock`'s context) receiving `events` of `sock`.

    The reader exists, and is connected, before libzmq starts sending: pyzmq's
    `get_monitor_socket` enables the monitor first, and when its reader then cannot be made (one
    descriptor short) the monitor stays on with no peer, so libzmq's I/O thread blocks for good
    on the first event it sends (a send to a PAIR without a peer waits), and with it every
    connection, timer and close of the context, while stopping such a monitor blocks its caller
    the same way.  An inproc connect may come before the bind.

    :raises zmq.ZMQError: the reader or the monitor cannot be made (out of descriptors); then
        `sock` is left unmonitored (libzmq undoes a half-made monitor itself).
    """
    endpoint = f"inproc://kvflow-monitor-{id(sock):x}-{next(_SERIAL)}"
    reader = kind(sock.context, zmq.PAIR)
    try:
        reader.setsockopt(zmq.LINGER, 0)
        reader.connect(endpoint)
        sock.monitor(endpoint, events)
    except zmq.ZMQError:
        reader.close(linger=0)
        raise
    return reader


class LinkMonitors:
    """The monitors of one channel's DEALERs, one per peer socket."""

    def __init__(self) -> None:
        self.listener: LinkListener | None = None
        self._watched: dict[zmq.Socket[Any], tuple[zmq.asyncio.Socket, asyncio.Task[None]]] = {}

    def watch(self, sock: zmq.Socket[Any], peer: str, loop: asyncio.AbstractEventLoop | None) -> None:
        """Report the links of `sock` (connected to `peer`) to the listener, if one is set, on
        `loop`.  Never raises: a socket that cannot be monitored is only watched by the lease."""
        if self.listener is None or loop is None:
            return
        try:
            monitor = open_monitor(sock, EVENTS, zmq.asyncio.Socket)
        except zmq.ZMQError:  # out of sockets: the lease still notices a silent peer
            return
        task = loop.create_task(self._read(monitor, peer), name=f"kvflow-link-{peer}")
        self._watched[sock] = (monitor, task)

    def watching(self) -> int:
        """How many sockets' links are watched now."""
        return len(self._watched)

    def unwatch(self, sock: zmq.Socket[Any]) -> None:
        """Stop watching `sock` (before it closes).  Never raises."""
        watched = self._watched.pop(sock, None)
        if watched is None:
            return
        monitor, task = watched
        task.cancel()
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(linger=0)

    def close(self) -> None:
        """Stop every monitor (before the channel's context terminates)."""
        for sock in list(self._watched):
            self.unwatch(sock)

    async def _read(self, monitor: zmq.asyncio.Socket, peer: str) -> None:
        while not monitor.closed:
            try:
                frames = await monitor.recv_multipart()
            except zmq.ZMQError:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_MONITOR_STOPPED:
                return
            listener = self.listener
            if listener is not None:
                listener(peer, event == zmq.EVENT_CONNECTED)
