"""Attacks on a live control plane, for the attack tests and for soak runs at any scale.

Why: the control plane must hold up against a stranger on the network (no secret), not only
against malformed frames.  Each attack here is what such a stranger can do with a plain pyzmq
socket or a raw TCP connection: an unfinished multipart message, a flood of large badly signed
frames, a flood of idle connections, squatting a peer's ZeroMQ identity, and replaying a recorded
TCP stream at a restarted engine.  Each is a plain blocking function (run it on a thread next to
an event loop) parameterised by scale, returning an `AttackStats`; none raises on what the target
does (refuses, closes, never answers): that is the outcome being measured (an address that is
not ``tcp://host:port`` raises `ValueError`).  `insider_dealer`, and `keys` (from
`hardening.curve_keys`) where an attack takes them, play an insider holding the secret's CURVE
keys, to test what is left once a connection is authenticated.  At large scale the attacker needs its own
resources: `connection_flood` one descriptor per connection held, the floods the bandwidth.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq

from kvflow.control.auth import Secret
from kvflow.control.hardening import CurveKeys, curve_keys

__all__ = (
    "AttackStats",
    "RecordingProxy",
    "bad_mac_flood",
    "carries_messages",
    "connection_flood",
    "insider_dealer",
    "replay",
    "squat_identity",
    "unfinished_multipart",
)


GREETING = 64  # bytes of a ZMTP 3 greeting


@dataclass(frozen=True, slots=True)
class AttackStats:
    """What an attack did: `sent` frames, parts or connections; `refused`, those the target
    visibly turned down (connections it closed, handshakes it failed, sends ZeroMQ would not
    queue); `duration` in seconds; `opened`, for a connection flood, the seconds until its last
    connection was opened (the rest of `duration` waits for the target to close them)."""

    attack: str
    sent: int
    refused: int
    duration: float
    opened: float = 0.0

    @property
    def rate(self) -> float:
        return self.sent / self.duration if self.duration > 0 else 0.0


def _dealer(
    ctx: zmq.Context[zmq.Socket[bytes]], identity: bytes, address: str, keys: CurveKeys | None
) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    sock.connect(address)
    return sock


def insider_dealer(
    ctx: zmq.Context[zmq.Socket[bytes]], identity: bytes, address: str, secret: Secret | None
) -> zmq.Socket[bytes]:
    """A DEALER with `identity` connected to `address` the way an engine holding `secret` (None:
    an engine without one) connects.  :raises zmq.ZMQError: the address is unusable."""
    return _dealer(ctx, identity, address, curve_keys(secret) if secret is not None else None)


def _handshakes_failed(monitor: zmq.Socket[bytes]) -> tuple[int, int]:
    """(succeeded, failed) handshakes reported on `monitor` so far."""
    ok = failed = 0
    while monitor.poll(0):
        event = int.from_bytes(monitor.recv_multipart()[0][:2], "little")
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            ok += 1
        elif event & (
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        ):
            failed += 1
    return ok, failed


def _frame(payload: bytes, *, more: bool = False, command: bool = False) -> bytes:
    """One ZMTP 3 frame."""
    flags = (0x01 if more else 0) | (0x04 if command else 0)
    if len(payload) > 255:
        return bytes([flags | 0x02]) + len(payload).to_bytes(8, "big") + payload
    return bytes([flags, len(payload)]) + payload


def _stranger(address: str, identity: bytes = b"") -> socket.socket:
    """A raw TCP connection that has done ZMTP 3's NULL handshake as a DEALER, as anyone
    without keys can.  :raises ConnectionError: the target refused (it wants another mechanism)."""
    sock = socket.create_connection(_host_port(address), timeout=5.0)
    try:
        sock.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\0") + b"\0" * 32)
        greeting = b""
        while len(greeting) < GREETING:
            data = sock.recv(GREETING - len(greeting))
            if not data:
                raise ConnectionError("the target closed the connection during the greeting")
            greeting += data
        if greeting[12:16] != b"NULL":
            raise ConnectionError(f"the target wants {greeting[12:32].rstrip(bytes(1)).decode(errors='replace')}")
        props = b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
        props += b"\x08Identity" + len(identity).to_bytes(4, "big") + identity
        sock.sendall(_frame(b"\x05READY" + props, command=True))
        _answer(sock, 1)  # its READY, or the end of the connection
    except (OSError, ConnectionError):
        sock.close()
        raise
    return sock


def unfinished_multipart(address: str, *, parts: int, part_bytes: int = 64 * 1024) -> AttackStats:
    """Send `parts` parts of one multipart message that never ends (a raw ZMTP connection: no
    ZeroMQ library sends an unfinished message), then disconnect.  `refused`: 1 if the target
    refused the connection or closed it."""
    start = time.monotonic()
    part = _frame(os.urandom(part_bytes), more=True)
    sent = 0
    try:
        with _stranger(address) as sock:
            for _ in range(parts):
                sock.sendall(part)
                sent += 1
            _answer(sock, 0, quiet=0.2)  # give the target a moment with it before leaving
    except (OSError, ConnectionError):
        return AttackStats("unfinished_multipart", sent, 1, time.monotonic() - start)
    return AttackStats("unfinished_multipart", sent, 0, time.monotonic() - start)


def bad_mac_flood(
    address: str, *, frames: int, frame_bytes: int = 1 << 20, senders: int = 4, seconds: float = 60.0
) -> AttackStats:
    """Send `frames` two-part frames, `frame_bytes` random bytes and a random MAC, over
    `senders` raw ZMTP connections at once, as fast as the target takes them (at most `seconds`).
    `sent` counts frames the target's TCP stack took; `refused`, connections it refused or closed."""
    start = time.monotonic()
    message = _frame(os.urandom(frame_bytes), more=True) + _frame(os.urandom(32))
    counts = [0] * senders
    refusals = [0] * senders

    def flood(i: int) -> None:
        try:
            with _stranger(address) as sock:
                sock.settimeout(max(start + seconds - time.monotonic(), 0.001))
                for _ in range(i, frames, senders):
                    sock.sendall(message)
                    counts[i] += 1
        except (OSError, ConnectionError):  # refused, closed, or out of time
            refusals[i] += 1

    threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return AttackStats("bad_mac_flood", sum(counts), sum(refusals), time.monotonic() - start)


def _host_port(address: str) -> tuple[str, int]:
    parts = urlsplit(address)
    if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
        raise ValueError(f"not a tcp://host:port address: {address}")
    return parts.hostname, parts.port


def connection_flood(
    address: str,
    *,
    connections: int,
    hold: float = 5.0,
    per_second: float = 0.0,
    halfway: threading.Event | None = None,
    stop: threading.Event | None = None,
) -> AttackStats:
    """Open `connections` idle TCP connections to `address` (at most `per_second` a second; 0:
    as fast as possible), each held until the target closes it or `hold` seconds pass (`math.inf`:
    until the target closes it); `halfway` is set once half of them were opened.  Once `stop` is
    set, no more are opened and every one held is closed.  `refused` counts connections the target
    refused or closed."""
    host, port = _host_port(address)
    start = time.monotonic()
    selector = selectors.DefaultSelector()
    opened: dict[socket.socket, float] = {}
    sent = refused = 0

    def reap(timeout: float) -> None:
        nonlocal refused
        for key, _ in selector.select(timeout):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                closed = sock.recv(4096) == b""
            except OSError:
                closed = True
            if closed:
                refused += 1
                selector.unregister(sock)
                opened.pop(sock, None)
                sock.close()
        now = time.monotonic()
        for sock, at in list(opened.items()):
            if now - at > hold:
                selector.unregister(sock)
                del opened[sock]
                sock.close()

    try:
        for i in range(connections):
            if stop is not None and stop.is_set():
                break
            if per_second > 0:
                while time.monotonic() < start + i / per_second:
                    reap(0.001)
            try:
                sock = socket.create_connection((host, port), timeout=1.0)
            except OSError:
                refused += 1
                continue
            sent += 1
            if halfway is not None and sent * 2 >= connections:
                halfway.set()
            sock.setblocking(False)
            opened[sock] = time.monotonic()
            selector.register(sock, selectors.EVENT_READ)
            if i % 64 == 0:
                reap(0)
        opened_in = time.monotonic() - start
        while opened and not (stop is not None and stop.is_set()):
            reap(0.05)
    finally:
        for sock in opened:
            sock.close()
        selector.close()
    return AttackStats("connection_flood", sent, refused, time.monotonic() - start, opened_in)


def squat_identity(
    address: str,
    identity: bytes,
    *,
    hold: float,
    settle: float = 2.0,
    keys: CurveKeys | None = None,
    holding: threading.Event | None = None,
) -> AttackStats:
    """Connect with a peer's `identity` (and send it a frame), wait up to `settle` seconds for
    the handshake, then hold the connection `hold` seconds, with `holding` set meanwhile.
    `refused`: failed handshakes."""
    start = time.monotonic()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = _dealer(ctx, identity, address, keys)
    monitor = sock.get_monitor_socket()
    ok = failed = 0
    try:
        sock.send_multipart([b"squat", b"\0" * 32], flags=zmq.NOBLOCK)
        end = time.monotonic() + settle
        while not ok and time.monotonic() < end:
            monitor.poll(50)
            more_ok, more_failed = _handshakes_failed(monitor)
            ok, failed = ok + more_ok, failed + more_failed
        if holding is not None:
            holding.set()
        time.sleep(hold)  # the attack is holding the identity: nothing to poll for
        failed += _handshakes_failed(monitor)[1]
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()
    return AttackStats("squat_identity", 1, failed, time.monotonic() - start)


class RecordingProxy:
    """A TCP proxy in front of `target` that records every byte clients send through it: the
    attacker on the path, recording what it cannot read or forge.  :raises OSError: it cannot listen."""

    def __init__(self, target: str) -> None:
        self._target = _host_port(target)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.streams: list[bytearray] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self._target)
            except OSError:
                return
            recorded = bytearray()
            self.streams.append(recorded)
            threading.Thread(target=self._pump, args=(client, server, recorded), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, recorded: bytearray | None) -> None:
        try:
            while data := src.recv(65536):
                if recorded is not None:
                    recorded += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


def _command_ends(stream: bytes) -> list[int]:
    """Where the greeting and each handshake command of a ZMTP client stream end."""
    ends, at = [GREETING], GREETING
    while at + 2 <= len(stream) and stream[at] & 0x04:  # a command frame
        flags = stream[at]
        head, size = (9, int.from_bytes(stream[at + 1 : at + 9], "big")) if flags & 0x02 else (2, stream[at + 1])
        at += head + size
        ends.append(at)
    return ends


def carries_messages(stream: bytes) -> bool:
    """Whether a recorded client stream holds anything after its greeting and handshake."""
    return _command_ends(stream)[-1] < len(stream)


def _commands(stream: bytes) -> list[bytes]:
    """`stream` cut into the greeting, each handshake command, and the rest (the messages)."""
    ends = _command_ends(stream)
    pieces = [stream[start:end] for start, end in zip([0, *ends], [*ends, len(stream)], strict=True)]
    return [piece for piece in pieces if piece]


def _answer(sock: socket.socket, least: int, quiet: float = 0.05) -> None:
    """Read what the target answers: at least `least` bytes, then until it is `quiet`.

    :raises ConnectionResetError: the target closed the connection.
    :raises TimeoutError: it did not answer within the socket's timeout.
    """
    got = 0
    while True:
        sock.settimeout(1.0 if got < least else quiet)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            if got < least:
                raise
            return
        if not data:
            raise ConnectionResetError
        got += len(data)


def replay(address: str, streams: list[bytearray] | list[bytes], *, hold: float = 0.5) -> AttackStats:
    """Write each recorded client stream to `address` on a new TCP connection, as a client
    would: the greeting and each handshake command after the target's answer to the one before,
    then the messages; read and drop what comes back for `hold` seconds, then close.
    `refused`: connections the target closed."""
    host, port = _host_port(address)
    start = time.monotonic()
    sent = refused = 0
    for stream in streams:
        try:
            sock = socket.create_connection((host, port), timeout=1.0)
        except OSError:
            refused += 1
            continue
        with sock:
            try:
                *handshake, messages = _commands(bytes(stream))
                for i, piece in enumerate(handshake):
                    sock.sendall(piece)
                    _answer(sock, GREETING if i == 0 else 0)  # a command may be answered already
                sock.sendall(messages)
                sent += 1
                end = time.monotonic() + hold
                while (left := end - time.monotonic()) > 0:
                    sock.settimeout(left)
                    if sock.recv(65536) == b"":
                        raise ConnectionResetError
            except TimeoutError:  # the target said nothing more: it kept the connection
                pass
            except OSError:
                refused += 1
    return AttackStats("replay", sent, refused, time.monotonic() - start)
