"""The router reuses an idle backend connection for less time than the backend keeps it.

vLLM's server closes a connection idle for 5 s; aiohttp's client would reuse one for 15 s.  A
request sent on a connection the server is closing at that moment fails with "Server
disconnected" (seen once in CI as a 502 on the decode leg after a 5 s pause).  The backends here
are raw HTTP servers that never close a connection and record, for every request, how long its
connection had been idle; a request after a pause longer than ``--backend-keepalive`` must come
on a new connection.  The pause is a lower bound, so the result does not depend on timing.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import pytest_asyncio

from tests.router_processes import ROUTER_MODULE, Process, stop_clean

KEEPALIVE = 0.3  # the router's --backend-keepalive in this test
PAUSE = 1.0  # between two requests: longer than KEEPALIVE
ANSWER = json.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}).encode()


@dataclass
class Backend:
    """A keep-alive HTTP server that answers every POST with one completion."""

    server: asyncio.Server | None = None
    idle: list[float | None] = field(default_factory=list)  # per request: its connection's idle time, None if new

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered: float | None = None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode("latin-1").split("\r\n")[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
                now = time.monotonic()
                self.idle.append(None if answered is None else now - answered)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(ANSWER)}\r\n\r\n".encode()
                    + ANSWER
                )
                await writer.drain()
                answered = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"


@pytest_asyncio.fixture
async def backends() -> AsyncIterator[tuple[Backend, Backend]]:
    prefill, decode = Backend(), Backend()
    for backend in (prefill, decode):
        backend.server = await asyncio.start_server(backend.serve, "127.0.0.1", 0)
    try:
        yield prefill, decode
    finally:
        for backend in (prefill, decode):
            assert backend.server is not None
            backend.server.close()


def complete(router: str) -> int:
    request = urllib.request.Request(
        router + "/v1/completions",
        data=json.dumps({"prompt": "x", "max_tokens": 1}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=20) as response:
        status: int = response.status
        response.read()
        return status


@pytest.mark.asyncio
async def test_a_request_after_a_pause_longer_than_the_keepalive_comes_on_a_new_connection(
    backends: tuple[Backend, Backend],
) -> None:
    prefill, decode = backends
    args = ["-m", ROUTER_MODULE, "--port", "0", "--health-interval", "1000"]
    args += ["--backend-keepalive", str(KEEPALIVE)]
    args += ["--prefill", prefill.url, "--decode", decode.url]
    router = Process(*args)
    try:
        url = (await asyncio.to_thread(router.wait_for, r"router listening on (http://\S+)")).group(1)
        assert await asyncio.to_thread(complete, url) == 200
        await asyncio.sleep(PAUSE)
        assert await asyncio.to_thread(complete, url) == 200
    finally:
        stop_clean(router)
    for backend in (prefill, decode):
        # the start-up health check and two requests, none on a connection idle for the pause
        assert len(backend.idle) == 3, backend.idle
        assert all(idle is None or idle < PAUSE for idle in backend.idle), backend.idle
