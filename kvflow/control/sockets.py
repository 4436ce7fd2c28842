"""The control channel's ZeroMQ sockets: their routing ids, which endpoints are loopback, and their options.

Why a module of its own: what each socket is called and what it lets a peer make it hold
(size and queue limits, the handshake deadline, TCP keepalive, its CURVE role) is decided once
per socket, before any frame moves, and depends on nothing of a running channel: the channel
(`kvflow.control.zeromq`) opens a socket, has it set up here, and from then on only sends,
reads and closes.  The loopback check is also what launchers and the connector ask before
they let a control plane run without a secret.

Every DEALER's routing id is the engine id, a NUL byte and a random part of its own
(`routing_id`): the ROUTER checks the engine id part (`sender_of`) against the envelope's
sender.  Parts over `SOCKET_LIMIT` make ZeroMQ drop the connection, and at most
`RECEIVE_QUEUE` messages wait per connection.
"""

from __future__ import annotations

import ipaddress
import os
from urllib.parse import urlsplit

import zmq

from kvflow.control.hardening import ZAP_DOMAIN, CurveKeys
from kvflow.control.wire import MAX_FRAME_BYTES

__all__ = (
    "RECEIVE_QUEUE",
    "SOCKET_LIMIT",
    "harden",
    "is_loopback",
    "routing_id",
    "sender_of",
    "set_up_dealer",
    "set_up_router",
)

SOCKET_LIMIT = MAX_FRAME_BYTES + 4096  # per part: ZeroMQ drops a connection sending more; we count up to it
RECEIVE_QUEUE = 128  # messages queued per connection (a frame is at most 2 parts of SOCKET_LIMIT): 256 MiB
# TCP keepalive on every control connection: one whose other end is gone without a word (its
# FIN lost behind a cut link, its host dead) is probed after this much silence and closed when
# the probes go unanswered or are answered with a reset: within 10 + 3 x 5 = 25 s, where it
# would otherwise stay open for good (a descriptor per link flap).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3
# No ZMTP heartbeats and no ROUTER_HANDOVER.  With one routing id per engine and handover, a
# peer's connection of an earlier association was handed over to the new one and left with no
# pipe: libzmq stops reading such a connection, and when its socket then fails it only marks
# the error (libzmq 4.3.5, stream_engine_base.cpp: in_event_internal with input stopped): the
# descriptor stayed open for good, and with ZMTP heartbeats on, the next heartbeat's write
# aborted the process (``Assertion failed: !_io_error``, stream_engine_base.cpp:310; 2 of 4
# link-flap runs on a loaded machine).  With a routing id per DEALER no connection is ever
# handed over: every one keeps its pipe, which the reader drains, so a failed socket is closed
# (`restart_input` ends it) and TCP keepalive (above) finds the dead ones.


def routing_id(engine_id: str) -> bytes:
    """A DEALER's ZeroMQ routing id: the engine id, NUL, and 8 random bytes of this socket's
    own (engine ids hold no NUL)."""
    return engine_id.encode() + b"\0" + os.urandom(8)


def sender_of(identity: bytes) -> bytes:
    """The engine id part of a routing id (the whole of one without a NUL)."""
    return identity.partition(b"\0")[0]


def is_loopback(address: str) -> bool:
    """True for ipc:// and inproc:// endpoints and tcp:// on 127.0.0.0/8, ::1 or localhost."""
    parts = urlsplit(address)
    if parts.scheme in ("ipc", "inproc"):
        return True
    if parts.scheme != "tcp":
        return False
    host = (parts.hostname or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def harden(sock: zmq.Socket[bytes], handshake_ms: int) -> None:
    """The options every control socket gets: no linger, `SOCKET_LIMIT` per part, `handshake_ms`
    to authenticate, and TCP keepalive."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, SOCKET_LIMIT)
    sock.setsockopt(zmq.HANDSHAKE_IVL, handshake_ms)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)


def set_up_router(router: zmq.Socket[bytes], keys: CurveKeys | None, handshake_ms: int, send_queue: int) -> None:
    """Set up the channel's ROUTER before it binds: hardened, at most `RECEIVE_QUEUE` (or
    `send_queue`, if fewer) messages queued per connection, a CURVE server with `keys`, and
    every handshake through the ZAP handler."""
    harden(router, handshake_ms)
    router.setsockopt(zmq.RCVHWM, min(send_queue, RECEIVE_QUEUE))
    if keys is not None:
        router.setsockopt(zmq.CURVE_SERVER, 1)
        router.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())  # with NULL too: see `serve_zap`'s `room`


def set_up_dealer(
    dealer: zmq.Socket[bytes], engine_id: str, keys: CurveKeys | None, handshake_ms: int, send_queue: int
) -> None:
    """Set up a DEALER of engine `engine_id` before it connects: hardened, a routing id of its
    own, `send_queue` messages queued at most, and a CURVE client with `keys`."""
    harden(dealer, handshake_ms)
    dealer.setsockopt(zmq.IDENTITY, routing_id(engine_id))
    dealer.setsockopt(zmq.SNDHWM, send_queue)
    if keys is not None:
        dealer.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        dealer.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
        dealer.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
