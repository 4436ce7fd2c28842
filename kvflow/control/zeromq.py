"""The control channel between engines in different processes: msgpack over ZeroMQ.

Why ZeroMQ: peers (vLLM, SGLang) already speak it, it reconnects by itself, and it keeps
message order per connection.  Each engine binds one ROUTER socket (loopback by default) and
opens one DEALER per peer, whose routing id is the engine id, a NUL byte and a random part of
its own.  A frame is ``[envelope, mac]``; the ROUTER adds the sender's routing id in front,
whose engine id part must be the envelope's sender.  How each socket is named and set up (its
routing id, limits, keepalive and CURVE role) is `kvflow.control.sockets`; this module opens,
sends on and closes them.

A connection costs a stranger's effort, not ours: with a secret, every connection is CURVE
authenticated by ZeroMQ before any of its messages is read (`kvflow.control.hardening`), an
unauthenticated connection is closed when `handshake_timeout` runs out, no connection can take
a name another holds (every DEALER's routing id is its own: nothing to squat or hand over),
parts over `SOCKET_LIMIT` make ZeroMQ drop the connection, at most `RECEIVE_QUEUE` messages
wait per connection (`kvflow.control.sockets`), a message of more parts than a frame has is
dropped (its parts are thrown away uncopied), and the receive loop yields to the event loop
every `YIELD_EVERY` parts or `YIELD_AFTER` seconds (`kvflow.control.receiving`).

Why plain sockets under a reader callback, not pyzmq's asyncio sockets: those go through a
future per part read (and per `RCVMORE` check); measured in an engine process, that cost 0.7 ms
of CPU per control frame, half of what a transfer cost P's engine.  The ROUTER and DEALERs are
plain `zmq.Socket`s; the loop watches each one's file descriptor and a callback
(`kvflow.control.receiving`) reads whatever is queued, without blocking (ZeroMQ's descriptor
is edge-triggered: it is drained each time, and read again after every send).  An unfinished
multipart message is held inside libzmq, out of any reader's and HWM's reach, until it ends:
only authenticating the connection first keeps a stranger from sending one.

Every frame is checked before any message object exists: size, HMAC (`kvflow.control.auth`), the strict
codec (`kvflow.control.wire`), receiver, the receiver's incarnation (this run's, or 0 on an
opening Hello or a Reject), identity, and the replay guard.  A frame that fails any
check is dropped and counted by reason, and logged once per peer and reason, not once per
frame.  Without a secret the channel refuses to bind or connect anywhere but loopback, and
says in a warning that frames are not authenticated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils import z85

from kvflow.control.admission import RESTARTED, Dropped, admit
from kvflow.control.auth import ReplayGuard, Secret, secret_from_env
from kvflow.control.channel import Crashed, MessageHandler, new_incarnation
from kvflow.control.connections import ConnectionWatch, raise_descriptor_limit
from kvflow.control.counts import ControlCounts, Rejection
from kvflow.control.hardening import MONITORED, ZAP_ENDPOINT, CurveKeys, DropLog, curve_keys, serve_zap
from kvflow.control.monitor import LinkListener, LinkMonitors
from kvflow.control.receiving import SocketReaders
from kvflow.control.sockets import is_loopback, sender_of, set_up_dealer, set_up_router
from kvflow.control.wire import Envelope, encode
from kvflow.errors import (
    ConfigError,
    EngineClosed,
    PeerUnknown,
    PeerUnreachable,
    UsageError,
)
from kvflow.protocol.messages import ControlMessage, Hello, Reject, address_problem, require_engine_id

__all__ = ("ENV_SECRET", "RESTARTED", "ZmqControl")

log = logging.getLogger(__name__)

ENV_SECRET: Any = object()  # "read the secret from the environment"
MAX_LOGGED = 4096
HANDSHAKE_TIMEOUT = 2.0  # seconds a connection may take to authenticate
FORGET_LINGER_MS = 200  # a forgotten peer's last frames (a Goodbye, a Reject) get this long to leave


class ZmqControl:
    """A `ControlChannel` over ZeroMQ for engine `engine_id`, bound at `bind`."""

    def __init__(
        self,
        engine_id: str,
        bind: str = "tcp://127.0.0.1:0",
        *,
        secret: Secret | None | Any = ENV_SECRET,
        routes: Mapping[str, str] | None = None,
        send_queue: int = 10_000,
        curve: bool = True,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        thread_setup: Callable[[], None] | None = None,
    ) -> None:
        """With a secret and `curve`, connections are CURVE-authenticated with keys derived from
        the secret (every engine of a deployment must agree on `curve`); frames are signed either way.
        `thread_setup` runs first on the thread the channel starts (a GPU host binds it to its device).

        :raises ConfigError: `engine_id` is not a valid engine id, an unauthenticated channel
            would listen off loopback, or `handshake_timeout` is not positive."""
        self.engine_id = require_engine_id(engine_id)
        self.secret: Secret | None = secret_from_env() if secret is ENV_SECRET else secret
        if self.secret is None and not is_loopback(bind):
            raise ConfigError(f"refusing an unauthenticated control plane on {bind}: set KVFLOW_SECRET")
        if not handshake_timeout > 0:
            raise ConfigError(f"handshake_timeout must be positive, not {handshake_timeout!r}")
        self._keys: CurveKeys | None = curve_keys(self.secret) if self.secret is not None and curve else None
        self._handshake_ms = max(int(handshake_timeout * 1000), 1)
        self._bind = bind
        self._thread_setup = thread_setup
        self._address = ""
        self._incarnation = new_incarnation()
        self._routes: dict[str, str] = {}
        self._send_queue = send_queue
        self._seq = 0
        self._guard = ReplayGuard()
        self._told: dict[str, float] = {}  # peers told that this engine restarted, or answered: when
        self._handling: tuple[zmq.Socket[bytes], bytes] | None = None  # the frame `answer` replies to
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._readers: SocketReaders | None = None  # the sockets the loop watches: from `start`
        self._helpers: list[zmq.asyncio.Socket] = []  # the ZAP handler's socket
        self._watch_connections: ConnectionWatch | None = None  # the ROUTER's monitor, on a thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_crash: Crashed | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._handler: MessageHandler | None = None
        self._closed = False
        self._counts = ControlCounts()
        self._logged: set[tuple[bytes, str]] = set()
        self._drops = DropLog(self.engine_id)
        self.links = LinkMonitors()  # reports the DEALERs' connections once a listener is set
        self._configured = frozenset(routes or {})  # forget() keeps these routes
        for peer, address in (routes or {}).items():
            self.add_route(peer, address)

    @property
    def address(self) -> str:
        return self._address

    @property
    def incarnation(self) -> int:
        return self._incarnation

    @property
    def counters(self) -> Counter[str]:
        """What the channel counted, under flat names (`kvflow.control.counts`), a copy; the
        connection counts are the monitor thread's totals, read now (`kvflow.control.connections`)."""
        watch = self._watch_connections
        return self._counts.snapshot(watch.counts() if watch is not None else {})

    def add_route(self, peer: str, address: str) -> None:
        """:raises ConfigError: `peer` is not a valid engine id, `address` is a tcp:// one that is
        not ``tcp://IP:PORT`` (a host name would be resolved on ZeroMQ's I/O thread), or it
        would carry unauthenticated frames off loopback."""
        require_engine_id(peer, "peer")
        problem = address_problem(address) if address.startswith("tcp://") else None
        if problem is not None:
            raise ConfigError(f"control address of {peer!r} {problem}, not {address!r:.80}")
        if self.secret is None and not is_loopback(address):
            raise ConfigError(f"refusing to send unauthenticated frames to {address}: set KVFLOW_SECRET")
        if self._routes.get(peer) != address:
            old = self._dealers.pop(peer, None)
            if old is not None:
                self.links.unwatch(old)
                if self._readers is not None:
                    self._readers.unwatch(old)
                old.close(linger=0)
            self._routes[peer] = address

    def forget(self, peer: str) -> None:
        """Close the DEALER to `peer` (queued frames get `FORGET_LINGER_MS` to leave) and drop
        the route its Hello taught; a route given at construction stays.  Never raises."""
        dealer = self._dealers.pop(peer, None)
        if dealer is not None:
            self.links.unwatch(dealer)
            if self._readers is not None:
                self._readers.unwatch(dealer)
            dealer.close(linger=FORGET_LINGER_MS)
            self._counts.connections_forgotten += 1
        if peer not in self._configured:
            self._routes.pop(peer, None)

    @property
    def connections(self) -> int:
        """How many DEALERs (one per peer sent to, until forgotten) are open."""
        return len(self._dealers)

    def set_link_listener(self, listener: LinkListener | None) -> None:
        self.links.listener = listener

    def start(self, loop: asyncio.AbstractEventLoop, handler: MessageHandler, on_crash: Crashed | None = None) -> None:
        """Bind the ROUTER and start receiving on `loop`; an exception in reading a socket or
        in the ZAP server goes to `on_crash` (and the log).

        :raises ConfigError: the bind address is unusable.
        :raises UsageError: the channel was started before.
        """
        if self._ctx is not None:
            raise UsageError(f"control channel of {self.engine_id!r} already started")
        raise_descriptor_limit()
        self._ctx = zmq.asyncio.Context()
        self._loop = loop
        self._on_crash = on_crash
        self._readers = SocketReaders(
            loop,
            self.engine_id,
            self._on_frames,
            lambda who, why: self._reject(who, Rejection.SHAPE, why),
            self._crashed,
        )
        zap = self._ctx.socket(zmq.REP)  # the ZAP handler must listen before the first handshake
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind(ZAP_ENDPOINT)
        self._helpers.append(zap)
        router: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.ROUTER)  # plain: see the module's header
        set_up_router(router, self._keys, self._handshake_ms, self._send_queue)
        self._watch_connections = watch = ConnectionWatch.start(router, MONITORED, self.engine_id, self._thread_setup)
        keys = None if self._keys is None else frozenset([z85.decode(self._keys.client_public)])
        self._spawn(serve_zap(zap, keys, self._counts, watch.room))  # (handshakes start once bound, below)
        try:
            router.bind(self._bind)
        except zmq.ZMQError as exc:
            self._watch_connections.close()
            router.close(linger=0)
            raise ConfigError(f"cannot bind the control channel to {self._bind}: {exc}") from exc
        self._router = router
        self._address = router.getsockopt_string(zmq.LAST_ENDPOINT)
        if urlsplit(self._address).scheme == "tcp":  # idle connections may go when descriptors are short
            self._watch_connections.listening(urlsplit(self._address).port or 0, self._routes.__contains__)
        self._handler = handler
        self._readers.watch(router, None)
        if self.secret is None:
            log.warning(
                "%s: control plane on %s runs WITHOUT authentication (no KVFLOW_SECRET); allowed on loopback only",
                self.engine_id,
                self._address,
            )
        elif self._keys is None:
            log.warning(
                "%s: control plane on %s signs frames but does not authenticate connections (curve=False): "
                "whoever reaches it can hold descriptors and memory",
                self.engine_id,
                self._address,
            )

    def send(self, peer: str, message: ControlMessage) -> None:
        """Queue `message` for `peer`; never blocks.

        :raises PeerUnknown: no control address is known for `peer`.
        :raises PeerUnreachable: its address is unusable, no socket can be opened (out of
            descriptors), the queue to it is full (it is not reading), or ZeroMQ refused the frame.
        :raises EngineClosed: the channel is closed.
        :raises UsageError: the channel was never started.
        :raises UnsendableMessage: the message cannot be encoded (see `wire.encode`).
        """
        if self._closed:
            raise EngineClosed(f"control channel of {self.engine_id!r} is closed")
        if self._ctx is None:
            raise UsageError(f"control channel of {self.engine_id!r} used before it was started")
        address = self._routes.get(peer)
        if address is None:
            raise PeerUnknown(f"no control address known for {peer!r}")
        dealer = self._dealers.get(peer) or self._dealer(peer, address)
        self._seq += 1
        # an opening Hello may reach a run of the peer we never heard from; all else is bound to the run we know
        opening = isinstance(message, Hello) and not message.reply
        bound = 0 if opening else self._guard.incarnation(peer) or 0
        frame = encode(Envelope(self.engine_id, self._incarnation, peer, self._seq, message, bound))
        mac = self.secret.sign(frame) if self.secret is not None else b""
        try:
            dealer.send_multipart([frame, mac], flags=zmq.NOBLOCK)
        except zmq.Again:
            self._counts.send_queue_full += 1
            raise PeerUnreachable(f"control queue to {peer!r} is full: the peer is not reading") from None
        except zmq.ZMQError as exc:
            raise PeerUnreachable(f"cannot send to {peer!r}: {exc}") from None
        finally:
            if self._readers is not None:
                self._readers.after_send(dealer)
        self._counts.frames_sent += 1

    def _dealer(self, peer: str, address: str) -> zmq.Socket[bytes]:
        """A new DEALER connecting to `peer` at `address`, and its reader task.

        :raises PeerUnreachable: ZeroMQ cannot open a socket (out of descriptors) or cannot parse
            the address (or lacks its transport).
        """
        assert self._ctx is not None  # send() checked
        try:
            dealer: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.DEALER)
        except zmq.ZMQError as exc:
            self._drops.note("send_no_socket", str(exc))
            raise PeerUnreachable(f"cannot open a socket to {peer!r}: {exc}") from exc
        set_up_dealer(dealer, self.engine_id, self._keys, self._handshake_ms, self._send_queue)
        self.links.watch(dealer, peer, self._loop)  # before connecting: no event is missed
        try:
            dealer.connect(address)
        except zmq.ZMQError as exc:  # an address ZeroMQ cannot parse (or a transport it lacks)
            self.links.unwatch(dealer)
            dealer.close(linger=0)
            raise PeerUnreachable(f"cannot connect to {peer!r} at {address}: {exc}") from exc
        self._dealers[peer] = dealer
        if self._readers is not None:
            self._readers.watch(dealer, peer.encode())  # answers may come back this way
        return dealer

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        self.links.close()
        if self._readers is not None:
            self._readers.close()
        for dealer in self._dealers.values():
            dealer.close(linger=0)
        self._dealers.clear()
        if self._router is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._router.disable_monitor()
            self._router.close(linger=0)
        if self._watch_connections is not None:
            self._watch_connections.close()
        for helper in self._helpers:
            helper.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    # ---------------------------------------------------------------- receiving

    def _spawn(self, coro: Any) -> None:
        assert self._loop is not None  # started before any socket exists
        task = self._loop.create_task(coro, name=f"kvflow-control-{self.engine_id}")
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A task of the channel ended: one that raised is a crash, reported, not left to the
        garbage collector's "exception never retrieved"."""
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self._crashed(error)

    def _crashed(self, error: BaseException) -> None:
        log.error("%s: control channel failure: %r", self.engine_id, error, exc_info=error)
        if self._on_crash is not None:
            self._on_crash(error)

    def _on_frames(self, frames: list[bytes], sock: zmq.Socket[bytes], source: int = -1) -> None:
        self._counts.frames_received += 1
        envelope = admit(frames, self.engine_id, self._incarnation, self.secret, self._guard, time.time_ns())
        identity = frames[0] if frames else b""
        if isinstance(envelope, Dropped):
            self._reject(identity, envelope.reason, envelope.detail)
            if envelope.tell == RESTARTED:
                self._tell_restarted(identity, envelope.peer)
            elif envelope.tell:
                self._refuse(identity, envelope.peer, envelope.tell)
            return
        message = envelope.message
        if isinstance(message, Hello) and message.control_address:
            try:
                self.add_route(envelope.sender, message.control_address)
            except ConfigError as exc:
                self._reject(identity, Rejection.ROUTE, str(exc))
                return
        if source >= 0 and self._watch_connections is not None:  # once routed: the connection is kept
            self._watch_connections.spoke(source, envelope.sender)
        self._counts.messages_delivered += 1
        if self._handler is not None:
            self._handling = (sock, identity)  # where `answer` replies, while the handler runs
            try:
                self._handler(envelope.sender, envelope.incarnation, message)
            finally:
                self._handling = None

    def _reject(self, identity: bytes, reason: Rejection, detail: str) -> None:
        rejected = self._counts.reject(reason)
        if (identity, reason) not in self._logged and len(self._logged) < MAX_LOGGED:
            self._logged.add((identity, reason))
            log.warning(
                "%s: dropping control frames from %r (%s): %s; further ones are only counted",
                self.engine_id,
                identity[:64],
                reason,
                detail,
            )
        elif len(self._logged) >= MAX_LOGGED:  # too many senders to name each: a summary now and then
            self._drops.note("frames", f"{rejected} rejected so far, last {reason}: {detail}")

    def answer(self, peer: str, incarnation: int, message: ControlMessage) -> None:
        """Send `message` to run `incarnation` of `peer` on the connection of the message being
        handled (only from inside the handler, for that message's sender; elsewhere a no-op),
        at most once a second per peer: we may have no route to it (it was forgotten).  Never
        raises."""
        if self._handling is not None and self._once_a_second(peer):
            sock, identity = self._handling
            self._reply(sock, identity, peer, message, incarnation)

    def _tell_restarted(self, identity: bytes, peer: str) -> None:
        """`peer` still speaks to an earlier run of this engine: tell it (a Reject from this
        run), at most once a second per peer, so that it ends that association at once rather
        than at its lease, and associates with this run."""
        if self._once_a_second(peer):
            self._refuse(identity, peer, RESTARTED)

    def _once_a_second(self, peer: str) -> bool:
        now = time.monotonic()
        if now - self._told.get(peer, -1.0) < 1.0:
            return False
        if len(self._told) >= MAX_LOGGED:
            self._told.clear()
        self._told[peer] = now
        return True

    def _refuse(self, identity: bytes, peer: str, reason: str) -> None:
        """Tell a peer of another protocol version why it gets no answer, on the connection its
        frame came in on (we may know no route to it: its Hello was unreadable)."""
        if self._router is not None:
            self._reply(self._router, identity, peer, Reject(reason))

    def _reply(
        self, sock: zmq.Socket[bytes], identity: bytes, peer: str, message: ControlMessage, bound: int = 0
    ) -> None:
        """`message` to `peer` on `sock`, the socket a frame of its came in on (`identity`: the
        frame's routing id; on a ROUTER, the connection to answer on), bound to its run `bound`
        (0: none).  Never raises."""
        if peer.encode() != sender_of(identity):
            return
        self._seq += 1
        frame = encode(Envelope(self.engine_id, self._incarnation, peer, self._seq, message, bound))
        mac = self.secret.sign(frame) if self.secret is not None else b""
        parts = [identity, frame, mac] if sock is self._router else [frame, mac]
        with contextlib.suppress(zmq.ZMQError):
            sock.send_multipart(parts, flags=zmq.NOBLOCK)
        if self._readers is not None:
            self._readers.after_send(sock)
