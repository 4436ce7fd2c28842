"""What HTTP clients can make the router hold: descriptors, time and request-body bytes, bounded.

Why: the router faces clients it does not know, and each open connection costs a descriptor,
each body in flight memory.  Before these bounds a client that opened connections and sent its
request headers slowly (or never), or sat on an idle keep-alive connection, was kept for ever
(200 of 200 such connections still open after 15 s; the process then stops accepting at its
descriptor limit), and six 60 MiB bodies at once grew the router by 1.5 GB.  Four bounds:

* **A header deadline** (`Limits.header_timeout`, 10 s): a connection whose request head is not
  complete within it, counted from the connection's start or, on a kept-alive connection, from
  the first byte of its next request, is closed ("header_timeout" when part of a head came,
  "idle" when nothing did).  A kept-alive connection waits for that first byte at most
  `Limits.idle_timeout` (75 s) after its previous answer, then is closed as "idle".  That one is
  longer than the clients' own keep-alive (aiohttp's client 15 s, httpx 5 s) on purpose: a client
  sends its next request on a pooled connection without knowing the server is closing it, so
  when the server is the first to give up on an idle connection, a request that leaves at that
  moment fails (with the header deadline of 0.5 s as the idle deadline, 9 of 40 requests on one
  pooled aiohttp connection each 0.49-0.51 s after the last).
  aiohttp's server has no deadline on reading a request head; its ``keepalive_timeout``
  (3630 s by default) closes a connection that waits for its next request, and one that never
  sent a first request only in recent releases (3.14.5 here; older ones lack it), and it counts
  nothing.  So the deadline is kvflow's own and works with any aiohttp: the protocol
  factory of the site (`LimitedSite`, given the public ``runner.server``) wraps each
  connection's protocol in `_Connection`, which arms a timer when the connection starts; a
  middleware, which runs once a request's head is parsed, disarms it, and arms it again when
  the handler is done (what is still written after that is a small JSON answer: D's answer is
  streamed from inside the handler).  An expired connection is closed, and aborted should it
  not let go of what it was sent within the deadline again.
* **A body deadline** (`body_timeout`, 30 s): the whole body within it, counted from the end of
  the head, or 408 naming ``--body-timeout``.
* **A budget of body bytes in flight** (`body_budget`, 256 MiB, over all requests): a request
  whose body would exceed it gets 503 naming ``--body-budget`` before any of its body is read,
  by its Content-Length; a chunked body is counted as it arrives and refused at the chunk that
  would exceed it.  The budget is held until both legs have been sent and answered (P in full,
  D's head): until then the router holds the parsed body and each leg's own serialised copy,
  about three times the body (measured: see docs/security.md), none of which D's streamed
  answer needs.  A body over ``max_body`` is refused with 413.
* **A connection limit** (`max_connections`), **with a share per client address**
  (`max_connections_per_client`, a quarter of it by default): at either, the connection idle
  longest (kept alive and waiting for its next request, or silent since it was accepted; of that
  address, at its share) is closed to make room, and only when none is idle is the new one closed
  at once, counted, and logged at most every 10 s (`kvflow_tools.routing.shares` says why); the
  router goes on serving those it has.  By default the limit is what the process's descriptors
  allow: each client connection in flight takes its own descriptor and one to each of P and D
  (`FDS_PER_CONNECTION`; a backend connection idle in the pool was one of those a moment ago),
  less `RESERVED_FDS` for the interpreter's own, the listening socket and the health checks.

Every refusal is counted per limit, and `describe` (``GET /limits``) shows the counts with the
limits, the connections open and the body bytes in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, cast

from aiohttp import web

from kvflow.errors import ConfigError
from kvflow_tools.errors import RequestRefused
from kvflow_tools.routing.shares import Refused, Shares

__all__ = (
    "LIMITS",
    "ClientLimits",
    "HeldBody",
    "Limits",
    "LimitedSite",
    "default_max_connections",
    "describe",
    "middleware",
    "start",
)

log = logging.getLogger("kvflow.router")

FDS_PER_CONNECTION = 3  # a client connection, and one to each of P and D while its request is in flight
RESERVED_FDS = 64  # the interpreter's own (stdio, the loop's), the listening socket, the health checks
LOG_EVERY = 10.0  # seconds: at most one log line per kind of refusal in this time
REFUSALS = (
    "header_timeout",
    "idle",
    "body_timeout",
    "body_budget",
    "body_too_large",
    "connections",
    "client_share",
    "evicted",  # an idle connection closed to make room for a new one
)
PER_CLIENT_DIVISOR = 4  # by default one client address holds at most a quarter of the connections


def default_max_connections(soft: int | None = None) -> int:
    """Client connections the descriptor limit allows: (`soft` RLIMIT_NOFILE, the process's by
    default, less `RESERVED_FDS`) / `FDS_PER_CONNECTION`, at least 1."""
    if soft is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20  # Linux's default nr_open
    return max(1, (soft - RESERVED_FDS) // FDS_PER_CONNECTION)


@dataclass(frozen=True)
class Limits:
    header_timeout: float = 10.0  # seconds for a request's head, from the connection's start or its first byte
    body_timeout: float = 30.0  # seconds for a request's whole body, from the end of its head
    body_budget: int = 256 << 20  # body bytes in flight over all requests
    max_body: int = 64 << 20  # the largest request body
    max_connections: int | None = None  # None: default_max_connections()
    idle_timeout: float = 75.0  # seconds a kept-alive connection waits for its next request's first byte
    max_connections_per_client: int | None = None  # None: max(1, max_connections // PER_CLIENT_DIVISOR)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be positive, not {value!r}")
        if self.body_budget < self.max_body:
            raise ConfigError(f"body_budget {self.body_budget} is below max_body {self.max_body}: that body never fits")

    def connections(self) -> int:
        return self.max_connections if self.max_connections is not None else default_max_connections()

    def per_client(self) -> int:
        """One client address's share (at most `connections()`)."""
        share = self.max_connections_per_client
        return min(share or max(1, self.connections() // PER_CLIENT_DIVISOR), self.connections())


class _Throttle:
    """Log lines per kind: the first at once, then at most one every `LOG_EVERY` s, with the
    count of those left out."""

    def __init__(self) -> None:
        self._quiet: dict[str, int] = {}  # kind -> refusals not logged in its current window

    def note(self, kind: str, message: str) -> None:
        if kind in self._quiet:
            self._quiet[kind] += 1
            return
        log.warning("%s", message)
        self._quiet[kind] = 0
        asyncio.get_running_loop().call_later(LOG_EVERY, self._flush, kind)

    def _flush(self, kind: str) -> None:
        left_out = self._quiet.pop(kind)
        if left_out:
            log.warning("refused %d more (%s) in the last %g s", left_out, kind, LOG_EVERY)
            self._quiet[kind] = 0
            asyncio.get_running_loop().call_later(LOG_EVERY, self._flush, kind)


class ClientLimits:
    """The bounds of one server, its counts, and what is held against them now."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.max_connections = limits.connections()
        if self.max_connections > default_max_connections():
            log.warning(
                "--max-connections %d is more than RLIMIT_NOFILE leaves room for (%d): the process may run out of "
                "descriptors first",
                self.max_connections,
                default_max_connections(),
            )
        self.refused = dict.fromkeys(REFUSALS, 0)
        self.body_bytes = 0  # held against the budget now
        self.shares = Shares(self.max_connections, limits.per_client())  # those admitted, by address
        self._by_transport: dict[asyncio.BaseTransport, _Connection] = {}
        self._held: dict[int, HeldBody] = {}  # by id(request) (a request is not hashable), until its handler ends
        self._throttle = _Throttle()

    def refuse(self, kind: str, message: str, quiet: bool = False) -> None:
        """Count one refusal of `kind`; log it (at most every `LOG_EVERY` s) unless `quiet`."""
        self.refused[kind] += 1
        if not quiet:
            self._throttle.note(kind, message)

    def describe(self) -> dict[str, Any]:
        shares = self.shares
        limits = asdict(self.limits) | {
            "max_connections": shares.max_connections,
            "max_connections_per_client": shares.per_client,
        }
        return {
            "limits": limits,
            "connections": len(shares),
            "idle_connections": shares.idle_count,
            "body_bytes_in_flight": self.body_bytes,
            "refused": dict(self.refused),
        }

    # ------------------------------------------------------------ connections

    def protocol_factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """`inner` (aiohttp's ``runner.server``) for each connection admitted (`connected`), under
        the header deadline."""
        return lambda: _Connection(self, inner)

    def connected(self, connection: _Connection, transport: asyncio.BaseTransport) -> bool:
        """Whether `connection` is admitted; one idle connection may be evicted for it."""
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        decision = self.shares.admit(connection, address)
        if isinstance(decision, Refused):
            self.refuse(decision.kind, decision.message)
            return False
        if decision.evicted is not None:
            evicted = cast(_Connection, decision.evicted)
            self.refuse("evicted", "", quiet=True)
            evicted.close()
        self._by_transport[transport] = connection
        return True

    def disconnected(self, connection: _Connection, transport: asyncio.BaseTransport | None) -> None:
        self.shares.gone(connection)
        if transport is not None:
            self._by_transport.pop(transport, None)

    def connection(self, request: web.BaseRequest) -> _Connection | None:
        """The connection `request` came on, if it came through a `LimitedSite`."""
        transport = request.transport
        return self._by_transport.get(transport) if transport is not None else None

    # ------------------------------------------------------------ bodies

    async def body(self, request: web.BaseRequest) -> HeldBody:
        """`request`'s body, held against the budget until `HeldBody.release`, or until its handler
        ends (`middleware`).  :raises RequestRefused: over `max_body` (413), over the budget (503),
        not all there within `body_timeout` (408)."""
        limits, held = self.limits, HeldBody(self)
        self._held[id(request)] = held
        try:
            async with asyncio.timeout(limits.body_timeout):
                length = request.content_length
                if length is not None:
                    self._check_size(length)
                    held.take(length)
                data = bytearray()
                while chunk := await request.content.readany():
                    data += chunk
                    if length is None:
                        self._check_size(len(data))
                        held.take(len(chunk))
        except TimeoutError:
            held.release()
            message = f"request body not complete within {limits.body_timeout:g} s (--body-timeout)"
            self.refuse("body_timeout", message)
            raise RequestRefused(408, "--body-timeout", message) from None
        except BaseException:
            held.release()
            raise
        held.hold(data)
        return held

    def finished(self, request: web.BaseRequest) -> None:
        """`request`'s handler has ended: the body it held, if any, is given back."""
        held = self._held.pop(id(request), None)
        if held is not None:
            held.release()

    def _check_size(self, size: int) -> None:
        if size > self.limits.max_body:
            message = f"request body larger than {self.limits.max_body} bytes (--max-body)"
            self.refuse("body_too_large", message)
            raise RequestRefused(413, "--max-body", message)

    def take(self, size: int) -> None:
        """:raises RequestRefused: `size` more bytes would exceed the budget (503)."""
        if self.body_bytes + size > self.limits.body_budget:
            message = (
                f"request bodies in flight would exceed the body budget of {self.limits.body_budget} bytes "
                f"(--body-budget; {self.body_bytes} held)"
            )
            self.refuse("body_budget", message)
            raise RequestRefused(503, "--body-budget", message)
        self.body_bytes += size

    def give_back(self, size: int) -> None:
        self.body_bytes -= size


class HeldBody:
    """One request's body and its share of the budget."""

    def __init__(self, limits: ClientLimits) -> None:
        self._limits = limits
        self.size = 0  # bytes taken from the budget
        self._data: bytearray | None = None

    def take(self, size: int) -> None:
        self._limits.take(size)
        self.size += size

    def hold(self, data: bytearray) -> None:
        self._data = data

    def json(self) -> Any:
        """The body parsed; its bytes are dropped.  :raises ValueError, RecursionError: not JSON."""
        data, self._data = self._data, None
        return json.loads(data if data is not None else b"")

    def release(self) -> None:
        """Give the budget back (again: nothing)."""
        self._limits.give_back(self.size)
        self.size = 0
        self._data = None


class _Connection(asyncio.Protocol):
    """aiohttp's protocol of one admitted connection (every call passed on), under the header
    deadline; a connection refused is closed before aiohttp sees it."""

    def __init__(self, limits: ClientLimits, inner: Callable[[], asyncio.Protocol]) -> None:
        self._limits = limits
        self._make_inner = inner
        self._inner: asyncio.Protocol | None = None  # made once admitted
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._busy = 0  # requests whose handler runs
        self._heard = False  # bytes came since the deadline was armed
        self._kept_alive = False  # answered and waiting for the next request: the idle deadline runs

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a TCP server's (asyncio's or uvloop's)
        if not self._limits.connected(self, transport):
            transport.close()
            return
        self._arm(self._limits.limits.header_timeout)
        self._inner = self._make_inner()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return  # refused: closing
        if not self._busy and not self._heard:
            if self._kept_alive:  # the next request began: its head has the header deadline from now
                self._arm(self._limits.limits.header_timeout)
            self._heard = True
            self._limits.shares.busy(self)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._limits.disconnected(self, self._transport)
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def request_started(self) -> None:
        self._busy += 1
        self._disarm()
        self._limits.shares.busy(self)

    def request_ended(self) -> None:
        self._busy -= 1
        if not self._busy and self._transport is not None and not self._transport.is_closing():
            self._arm(self._limits.limits.idle_timeout, kept_alive=True)
            self._limits.shares.idle(self)

    def close(self) -> None:
        """Close it (past a deadline, or idle and closed to make room), and abort it should it not
        let go within the header deadline (one that takes nothing)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        self._disarm()
        transport.close()
        self._timer = asyncio.get_running_loop().call_later(self._limits.limits.header_timeout, transport.abort)

    def _arm(self, timeout: float, kept_alive: bool = False) -> None:
        self._disarm()
        self._heard = False
        self._kept_alive = kept_alive
        self._timer = asyncio.get_running_loop().call_later(timeout, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        timeout = self._limits.limits.header_timeout
        if self._heard:
            message = f"closed a connection whose request head was not complete within {timeout:g} s (--header-timeout)"
            self._limits.refuse("header_timeout", message)
        else:
            self._limits.refuse("idle", "", quiet=True)  # silent since it opened or since its answer
        self.close()


@web.middleware
async def middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The header deadline stops while a request's handler runs, and starts again after it; a body
    the handler still holds is given back."""
    limits = request.app[LIMITS]
    connection = limits.connection(request)  # None: served by a site other than LimitedSite
    if connection is not None:
        connection.request_started()
    try:
        return await handler(request)
    finally:
        limits.finished(request)
        if connection is not None:
            connection.request_ended()


async def describe(request: web.Request) -> web.Response:
    """``GET /limits``: the limits, what is held against them, and the refusals of each."""
    return web.json_response(request.app[LIMITS].describe())


LIMITS = web.AppKey("limits", ClientLimits)


class LimitedSite(web.BaseSite):
    """A TCP site whose connections go through `limits`: aiohttp's TCPSite, with its protocol
    factory (the public ``runner.server``) wrapped by `ClientLimits.protocol_factory`.  It keeps
    its listening server itself, so it writes no attribute of aiohttp's base class."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limits: ClientLimits) -> None:
        super().__init__(runner)
        assert runner.server is not None  # BaseSite checked it
        self._protocols = runner.server
        self._host, self._port = host, port
        self._limits = limits
        self._listener: asyncio.Server | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens: (host, port), the port bound (port 0 asks for any free one)."""
        assert self._listener is not None, "not started"
        host, port = self._listener.sockets[0].getsockname()[:2]
        return host, port

    async def start(self) -> None:
        await super().start()
        factory = self._limits.protocol_factory(self._protocols)
        self._listener = await asyncio.get_running_loop().create_server(factory, self._host, self._port, backlog=128)
        self._port = self.address[1]

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        await super().stop()


async def start(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, LimitedSite]:
    """`app` (with `LIMITS` and `middleware`) served on host:port; clean up with ``runner.cleanup()``.
    A handler is cancelled when its client goes away."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = LimitedSite(runner, host, port, app[LIMITS])
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site
