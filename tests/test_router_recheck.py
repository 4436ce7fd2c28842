"""A request that finds no healthy backend of a role has that role checked at once, before any
503: a backend back from a restart serves it.  Requests meanwhile share the one check, and a role
is checked this way at most once a gap.  Over real HTTP on 127.0.0.1, in this process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from kvflow_tools.errors import NoBackend
from kvflow_tools.routing.backends import Backend, BackendPool, Recheck


class Server:
    """A backend whose ``GET /health`` answers `status` after `delay` seconds, counting calls."""

    def __init__(self) -> None:
        self.status, self.delay, self.calls = 200, 0.0, 0

    async def health(self, request: web.Request) -> web.Response:
        self.calls += 1
        await asyncio.sleep(self.delay)
        return web.Response(status=self.status)


@pytest_asyncio.fixture
async def backend() -> AsyncIterator[tuple[Server, BackendPool, aiohttp.ClientSession]]:
    server = Server()
    app = web.Application()
    app.router.add_get("/health", server.health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    pool = BackendPool("prefill", [Backend(f"http://127.0.0.1:{port}", "p", "tcp://127.0.0.1:1")], 3)
    for _ in range(3):  # three periodic checks went unanswered while it restarted
        pool.missed(next(iter(pool)), "no answer")
    async with aiohttp.ClientSession() as session:
        yield server, pool, session
    await runner.cleanup()


@pytest.mark.asyncio
async def test_a_backend_back_serves_the_next_request_after_one_check(
    backend: tuple[Server, BackendPool, aiohttp.ClientSession],
) -> None:
    server, pool, session = backend
    with pytest.raises(NoBackend):
        pool.acquire()  # what the router did before: 503 until the next periodic check
    lease = await Recheck(deadline=2.0).acquire(session, pool)
    assert lease.backend.engine == "p" and server.calls == 1
    lease.release()


@pytest.mark.asyncio
async def test_requests_meanwhile_share_one_check_and_a_dead_role_is_checked_once_a_gap(
    backend: tuple[Server, BackendPool, aiohttp.ClientSession],
) -> None:
    server, pool, session = backend
    server.status, server.delay = 503, 0.2
    recheck = Recheck(deadline=2.0, gap=60.0)
    outcomes = await asyncio.gather(*(recheck.acquire(session, pool) for _ in range(5)), return_exceptions=True)
    assert all(isinstance(o, NoBackend) and "HTTP 503" in str(o) for o in outcomes), outcomes
    assert server.calls == 1 and recheck.checks == 1
    server.status = 200  # back, but within the gap: the next periodic check will see it
    with pytest.raises(NoBackend):
        await recheck.acquire(session, pool)
    assert server.calls == 1
