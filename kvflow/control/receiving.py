"""Reading a control channel's sockets on the event loop: whole frames out, without blocking.

Why a module of its own: how parts become frames (at most a frame's parts kept, the rest of an
oversized message thrown away uncopied, the loop given back every `YIELD_EVERY` parts or
`YIELD_AFTER` seconds, ZeroMQ's edge-triggered descriptor drained each time and looked at again
after every send) is one concern, and what a frame means (`kvflow.control.zeromq`: admission,
routes, answers) another.  Plain sockets under a reader callback, not pyzmq's asyncio sockets:
those go through a future per part read, which cost 0.7 ms of CPU per control frame in an
engine process (see `kvflow.control.zeromq`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import zmq

__all__ = ("YIELD_AFTER", "YIELD_EVERY", "SocketReaders")

log = logging.getLogger("kvflow.control.zeromq")

YIELD_EVERY = 64  # parts read before the receive loop lets the event loop run
YIELD_AFTER = 0.005  # seconds of receiving before it does

# (frames, socket, the descriptor of the connection it came on or -1): [identity,] envelope, mac
FramesHandler = Callable[[list[bytes], "zmq.Socket[bytes]", int], None]
ExcessHandler = Callable[[bytes, str], None]  # (identity, detail): a message of too many parts


class _Reader:
    """A watched socket: its descriptor, its peer (None: the ROUTER), and the message read so far."""

    __slots__ = ("excess", "fd", "frames", "peer", "scheduled", "source")

    def __init__(self, peer: bytes | None, fd: int) -> None:
        self.peer = peer
        self.fd = fd
        self.source = -1  # on the ROUTER: the descriptor of the connection the message came on
        self.frames: list[bytes] = []
        self.excess = False  # the message has more parts than a frame: dropped when it ends
        self.scheduled = False  # a drain waits in the loop's queue


class SocketReaders:
    """The sockets one channel reads on `loop`: whole frames go to `on_frames`, a message of
    more parts than a frame to `on_excess` (once, when it has one too many), a bug in either
    to `on_crash`; `owner` names the channel in the log."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        owner: str,
        on_frames: FramesHandler,
        on_excess: ExcessHandler,
        on_crash: Callable[[BaseException], None],
    ) -> None:
        self._loop = loop
        self._owner = owner
        self._on_frames = on_frames
        self._on_excess = on_excess
        self._on_crash = on_crash
        self._readers: dict[zmq.Socket[bytes], _Reader] = {}
        self.closed = False

    def watch(self, sock: zmq.Socket[bytes], peer: bytes | None) -> None:
        """Read `sock` whenever the loop sees its descriptor ready: the ROUTER (`peer` None:
        frames carry the sender's identity) or a DEALER to `peer` (frames come from it only)."""
        reader = _Reader(peer, int(sock.getsockopt(zmq.FD)))
        self._readers[sock] = reader
        self._loop.add_reader(reader.fd, self._drain, sock)
        self._loop.call_soon(self._drain, sock)  # what arrived before the reader was added

    def unwatch(self, sock: zmq.Socket[bytes]) -> None:
        """Stop reading `sock` (before it closes).  Never raises."""
        reader = self._readers.pop(sock, None)
        if reader is not None and not self._loop.is_closed():
            self._loop.remove_reader(reader.fd)

    def close(self) -> None:
        """Stop reading every socket.  Never raises."""
        self.closed = True
        for sock in list(self._readers):
            self.unwatch(sock)

    def after_send(self, sock: zmq.Socket[bytes]) -> None:
        """A send may take the descriptor's edge a message that arrived meanwhile would have
        raised: read `sock` in a later turn if it holds one.  Never raises."""
        reader = self._readers.get(sock)
        if reader is None or reader.scheduled:
            return
        with contextlib.suppress(zmq.ZMQError):
            if int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                reader.scheduled = True
                self._loop.call_soon(self._drain, sock)

    def _drain(self, sock: zmq.Socket[bytes]) -> None:
        """Read what `sock` holds, without blocking (what it raises, other than ZeroMQ's
        errors, goes to `on_crash`).

        Parts are read one at a time: a message with more parts than a frame is dropped when it
        has one too many, and its further parts are thrown away without being copied.  After
        `YIELD_EVERY` parts or `YIELD_AFTER` seconds the rest waits for a later turn of the
        loop (even mid-message), so one busy peer cannot keep the loop from everything else.
        """
        reader = self._readers.get(sock)
        if reader is None or self.closed or sock.closed:
            return
        reader.scheduled = False
        limit = 3 if reader.peer is None else 2  # [identity,] envelope, mac
        parts, since = 0, time.monotonic()
        try:
            while reader.frames or int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                if parts >= YIELD_EVERY or time.monotonic() - since >= YIELD_AFTER:
                    reader.scheduled = True
                    self._loop.call_soon(self._drain, sock)
                    return
                part = sock.recv(flags=zmq.NOBLOCK, copy=False)  # a zmq.Frame: dropped parts are never copied
                parts += 1
                if reader.peer is None and not reader.frames and not reader.excess:
                    reader.source = part.get(zmq.SRCFD)  # libzmq's descriptor of its connection
                if len(reader.frames) < limit and not reader.excess:
                    reader.frames.append(part.bytes)
                elif not reader.excess:
                    reader.excess = True
                    self._on_excess(reader.frames[0] if reader.peer is None else reader.peer, f"over {limit} parts")
                if part.more:
                    continue
                frames, excess = reader.frames, reader.excess
                reader.frames, reader.excess = [], False
                if not excess:
                    self._on_frames(frames if reader.peer is None else [reader.peer, *frames], sock, reader.source)
        except zmq.Again:
            return  # nothing more now: the descriptor tells when there is
        except zmq.ZMQError as exc:
            if self.closed or sock.closed or exc.errno == zmq.ENOTSOCK:
                return
            log.error("%s: control socket error: %s", self._owner, exc)
            self._loop.call_later(0.01, self._drain, sock)
        except Exception as exc:  # a bug, not a peer's frame (those are refused, counted)
            self._on_crash(exc)
