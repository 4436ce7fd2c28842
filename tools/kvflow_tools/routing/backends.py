"""The router's backends: which vLLM servers serve each role, how loaded and how healthy each is.

Why apart from the router: choosing a backend is a decision with rules of its own (least
loaded first, an unhealthy one skipped until it answers its health check again, one that is
merely slow to answer kept for a few checks in a row, none left is an error naming the role)
that is testable without HTTP, and a backend's description grows with
deployments (a data-parallel rank, say) without touching how requests are relayed.  Only
`check_health` does I/O: one ``GET /health`` per backend, each bounded by a deadline; `Recheck`
runs it on behalf of a request that found no healthy backend.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import aiohttp

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.params import PeerRef
from kvflow_tools.errors import NoBackend

__all__ = ("RECHECK_GAP_S", "Backend", "BackendPool", "Lease", "Recheck", "check_health")

log = logging.getLogger("kvflow.router")

RECHECK_GAP_S = 1.0  # at most one health check a second on behalf of requests, per role


@dataclass(frozen=True)
class Backend:
    """One vLLM server as the router and the kvflow peers know it."""

    url: str  # the vLLM server's HTTP base URL
    engine: str  # its `engine_id` in --kv-transfer-config
    kvflow: str  # its kvflow control address (rank 0 of DP rank 0), tcp://IP:port
    tp_size: int = 0  # its tensor parallelism (0: not said; each side then assumes the other's equals its own)
    dp_rank: int | None = None  # the data-parallel rank to address (None: the server's choice, no DP)

    def peer(self) -> PeerRef:
        """The kvflow peer: with a DP rank, vLLM's engine id ``<engine>_dp<k>`` and kvflow's ports
        past the `tp_size` ports of each DP rank before it."""
        if self.dp_rank is None:
            return PeerRef(self.engine, self.kvflow, self.tp_size)
        host, port = self.kvflow.rsplit(":", 1)
        address = f"{host}:{int(port) + self.dp_rank * max(1, self.tp_size)}"
        return PeerRef(f"{self.engine}_dp{self.dp_rank}", address, self.tp_size)

    def headers(self, common: dict[str, str]) -> dict[str, str]:
        """A leg's headers: vLLM routes a request with ``X-data-parallel-rank`` to that DP rank."""
        return common if self.dp_rank is None else {**common, "X-data-parallel-rank": str(self.dp_rank)}


@dataclass
class _Slot:
    backend: Backend
    in_flight: int = 0
    healthy: bool = True  # until a health check says otherwise
    why: str = ""  # what the last failed health check saw
    misses: int = 0  # health checks in a row left unanswered


@dataclass
class Lease:
    """A backend chosen for one leg; `release` (idempotent) ends its count as in flight."""

    backend: Backend
    _slot: _Slot = field(repr=False)
    _done: bool = False

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._slot.in_flight -= 1


class BackendPool:
    """The backends of one role (prefill or decode), each with its requests in flight and its
    health.  Pure: `check_health` feeds it.

    A backend that answers its health check with an error, or refuses the connection, is
    skipped at once.  One that does not answer in time is skipped only after `misses_allowed`
    such checks in a row: a server busy prefilling, on a loaded host, can be late with
    ``/health`` and still serve, and taking every P out for one late answer turns a slow
    moment into failed requests (503)."""

    def __init__(self, role: str, backends: Sequence[Backend], misses_allowed: int = 3) -> None:
        """:raises ConfigError: no backend, one URL listed twice, or `misses_allowed` < 1."""
        if misses_allowed < 1:
            raise ConfigError(f"the {role} backends' health misses allowed must be at least 1, not {misses_allowed}")
        if not backends:
            raise ConfigError(f"the router needs at least one {role} backend")
        urls = [b.url for b in backends]
        if len(set(urls)) != len(urls):
            raise ConfigError(f"a {role} backend is listed twice: {urls}")
        self.role = role
        self.misses_allowed = misses_allowed
        self._slots = [_Slot(b) for b in backends]
        self._turn = 0  # ties go round-robin, so equal backends share the load

    def __iter__(self) -> Iterator[Backend]:
        return (slot.backend for slot in self._slots)

    def acquire(self) -> Lease:
        """The healthy backend with the fewest requests in flight, counted as one more.

        :raises NoBackend: every backend of the role is unhealthy.
        """
        healthy = [slot for slot in self._slots if slot.healthy]
        if not healthy:
            reasons = "; ".join(f"{s.backend.url}: {s.why}" for s in self._slots)
            raise NoBackend(self.role, f"no healthy {self.role} backend ({reasons})")
        fewest = min(slot.in_flight for slot in healthy)
        ties = [slot for slot in healthy if slot.in_flight == fewest]
        slot = ties[self._turn % len(ties)]
        self._turn += 1
        slot.in_flight += 1
        return Lease(slot.backend, slot)

    def mark(self, backend: Backend, healthy: bool, why: str = "") -> None:
        """What a health check that got an answer (or a refused connection) found; a change is
        logged."""
        for slot in self._slots:
            if slot.backend == backend:
                slot.misses = 0
                self._set(slot, healthy, why)

    def missed(self, backend: Backend, why: str) -> None:
        """A health check left unanswered: the backend is skipped once `misses_allowed` checks
        in a row were."""
        for slot in self._slots:
            if slot.backend == backend:
                slot.misses += 1
                if slot.misses >= self.misses_allowed:
                    self._set(slot, False, f"{why} ({slot.misses} checks in a row)")

    def _set(self, slot: _Slot, healthy: bool, why: str) -> None:
        if slot.healthy != healthy:
            state = "healthy again" if healthy else f"unhealthy, skipped: {why}"
            log.warning("%s backend %s is %s", self.role, slot.backend.url, state)
        slot.healthy, slot.why = healthy, why

    def describe(self) -> list[dict[str, object]]:
        return [
            {"url": s.backend.url, "engine": s.backend.engine, "healthy": s.healthy, "in_flight": s.in_flight}
            | ({"why": s.why} if not s.healthy else {})
            | ({"misses": s.misses} if s.misses else {})
            for s in self._slots
        ]


async def check_health(session: aiohttp.ClientSession, pool: BackendPool, deadline: float) -> None:
    """``GET /health`` on every backend of `pool` at once, each within `deadline` seconds:
    HTTP 200 is healthy, an error status or a connection that cannot be made is not, and no
    answer in time (or a connection lost before it) is a miss (`BackendPool.missed`)."""

    async def one(backend: Backend) -> None:
        try:
            async with asyncio.timeout(deadline), session.get(backend.url + "/health") as response:
                status = response.status
            pool.mark(backend, status == 200, f"GET /health answered HTTP {status}")
        except TimeoutError:
            pool.missed(backend, f"GET /health: no answer within {deadline:g} s")
        except aiohttp.ClientConnectorError as exc:  # refused, unreachable: nothing listens there
            pool.mark(backend, False, f"GET /health: {exc.__class__.__name__}: {exc}")
        except aiohttp.ClientError as exc:
            pool.missed(backend, f"GET /health: {exc.__class__.__name__}: {exc}")

    await asyncio.gather(*(one(backend) for backend in pool))


class Recheck:
    """When a request finds no healthy backend of a role, one health check of that role at once,
    then the choice again, before the 503: a backend back from a restart serves the next request,
    not the first one after the next periodic check (seconds later, every request failing
    meanwhile).  Requests arriving during a check wait for that same check, and a role is checked
    this way at most once every `gap` seconds, so that a stream of requests against a dead role
    costs the backends no more than that."""

    def __init__(self, deadline: float, gap: float = RECHECK_GAP_S) -> None:
        self.deadline, self.gap = deadline, gap
        self.checks = 0  # health checks made on behalf of requests
        self._running: dict[str, asyncio.Future[None]] = {}
        self._last: dict[str, float] = {}

    async def acquire(self, session: aiohttp.ClientSession, pool: BackendPool) -> Lease:
        """`pool.acquire()`, with one recheck of the role first when it finds nothing healthy.

        :raises NoBackend: still nothing healthy after the recheck (or within `gap` of the last).
        """
        try:
            return pool.acquire()
        except NoBackend:
            pass
        running = self._running.get(pool.role)
        if running is None and time.monotonic() - self._last.get(pool.role, -self.gap) >= self.gap:
            running = asyncio.ensure_future(check_health(session, pool, self.deadline))
            self._running[pool.role] = running
            self.checks += 1
            running.add_done_callback(lambda _: self._done(pool.role))
        if running is not None:
            await asyncio.shield(running)  # a client that leaves does not cancel the others' check
        return pool.acquire()

    def _done(self, role: str) -> None:
        self._running.pop(role, None)
        self._last[role] = time.monotonic()
