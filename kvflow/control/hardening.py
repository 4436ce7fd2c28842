"""Connection-level defences of the ZeroMQ control plane.

CURVE keys, the ZAP handler, the connection monitor, and a rate-limited log of what is
dropped.

Why: an HMAC per frame authenticates messages only after ZeroMQ has accepted a connection, read
whole messages into memory and handed them to the event loop, so a stranger without the secret
could still hold descriptors, grow memory, starve the loop and squat a peer's identity.  With
CURVE a connection is authenticated during ZeroMQ's handshake, before any message of it is read:
the server's and the clients' key pairs are derived from the shared secret (HKDF, `Secret.derive`),
so only holders of the secret know the server's public key, and our ZAP handler admits only the
derived client key.  A stranger gets a TCP connection that is closed when the handshake interval
runs out, and nothing else.  ZeroMQ reports each connection's fate on a monitor socket, counted
on a thread (`kvflow.control.connections`) and logged here at most once per interval per kind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils import z85

from kvflow.control.auth import Secret
from kvflow.control.counts import ControlCounts

__all__ = (
    "ZAP_DOMAIN",
    "ZAP_ENDPOINT",
    "CurveKeys",
    "DropLog",
    "curve_keys",
    "serve_zap",
    "zap_reply",
)

log = logging.getLogger("kvflow.control.zeromq")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks; one handler per context
ZAP_DOMAIN = "kvflow"
LOG_INTERVAL = 10.0  # seconds between two log lines about the same kind of drop
MONITORED = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_ACCEPT_FAILED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """Z85-encoded CURVE key pairs of the server (every ROUTER) and the client (every DEALER)."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)


def curve_keys(secret: Secret) -> CurveKeys:
    """The key pairs every holder of `secret` derives alike.  Never raises."""
    server = z85.encode(secret.derive(b"curve server"))
    client = z85.encode(secret.derive(b"curve client"))
    return CurveKeys(zmq.curve_public(server), server, zmq.curve_public(client), client)


def zap_reply(request: list[bytes], allowed: frozenset[bytes] | None) -> tuple[list[bytes], bool]:
    """The ZAP reply to `request` (RFC 27) and whether it admits the connection: CURVE with a
    client key in `allowed` (raw 32-byte keys), or, where `allowed` is None (no secret: the
    channel runs ZAP only to refuse connections while short of descriptors), NULL; nothing
    else.  Never raises."""
    if len(request) < 6 or request[0] != b"1.0":
        return [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"bad request", b"", b""], False
    _, request_id, domain, _address, _identity, mechanism, *credentials = request
    key = credentials[0] if len(credentials) == 1 else None
    if domain == ZAP_DOMAIN.encode() and (
        mechanism == b"NULL" and not credentials if allowed is None else mechanism == b"CURVE" and key in allowed
    ):
        return [b"1.0", request_id, b"200", b"OK", b"kvflow", b""], True
    return [b"1.0", request_id, b"400", b"unknown client key", b"", b""], False


async def serve_zap(
    sock: zmq.asyncio.Socket,
    allowed: frozenset[bytes] | None,
    counts: ControlCounts,
    room: Callable[[], bool] = lambda: True,
) -> None:
    """Answer ZAP requests on `sock` until it closes.  Each is answered at once, without
    blocking (a reply ZeroMQ cannot take is dropped, and the handshake runs out).  A key that
    is admitted is refused still when `room()` is false (the process is short of descriptors)."""
    while True:
        try:
            request = await sock.recv_multipart()
            reply, admitted = zap_reply(request, allowed)
            if admitted and not room():
                reply, admitted = [*reply[:2], b"400", b"no room", b"", b""], False
            if admitted:
                counts.zap_admitted += 1
            else:
                counts.zap_refused += 1
            await sock.send_multipart(reply, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            if sock.closed:
                return
            await asyncio.sleep(0.01)  # not expected: do not spin


class DropLog:
    """Logs a kind of drop the first time, then at most once per `interval` seconds, saying how
    many more there were in between."""

    def __init__(self, owner: str, interval: float = LOG_INTERVAL, clock: Callable[[], float] = time.monotonic):
        self._owner = owner
        self._interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._quiet: Counter[str] = Counter()

    def note(self, kind: str, detail: str) -> None:
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval:
            self._quiet[kind] += 1
            return
        self._last[kind] = now
        more = self._quiet.pop(kind, 0)
        since = f" ({more} more since the last report)" if more else ""
        log.warning("%s: control plane dropped %s: %s%s", self._owner, kind, detail, since)
