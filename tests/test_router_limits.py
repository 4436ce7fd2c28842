"""What a client can make the router hold is bounded (tools/kvflow_tools/routing/http_limits.py).

The router runs as its own process (``python -m kvflow_tools.routing.router``) on 127.0.0.1,
with small limits, in front of two backends served in the test's own event loop.  Clients are
raw sockets where the point is what they leave unsent.  Every wait is on an outcome (a closed
connection, an answer, a count at ``GET /limits``) with a generous deadline, never on time
passing: a limit of 0.5 s only has to act at some point within `WAIT`.  Each test here fails on
the router before these limits (slow heads, idle and surplus connections were kept; a slow body
or one over the budget was waited for).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from kvflow_tools.routing import http_limits, router
from kvflow_tools.routing.backends import Backend
from tests.router_processes import ROUTER_MODULE, WAIT, Process, stop_clean

OTHER_CLIENT = "127.0.0.2"  # a client address of its own, on loopback
ANSWER = {"id": "cmpl-1", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}


@dataclass
class Backends:
    """P and D in this process: each answers a completion at once, or once released when its
    body asks to be held (``"hold": "P"`` or ``"D"``); D streams its answer when asked to, its
    first event at once."""

    p_url: str = ""
    d_url: str = ""
    arrived: list[str] = field(default_factory=list)  # "P" or "D", per request, as they came
    release: dict[str, asyncio.Event] = field(default_factory=lambda: {"P": asyncio.Event(), "D": asyncio.Event()})

    def handler(self, name: str) -> Callable[[web.Request], Any]:
        async def completion(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.arrived.append(name)
            if not body.get("stream") or name == "P":
                if body.get("hold") == name:
                    await self.release[name].wait()
                return web.json_response(ANSWER)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b"data: first\n\n")
            if body.get("hold") == name:
                await self.release[name].wait()
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response

        return completion


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@pytest_asyncio.fixture
async def backends() -> AsyncIterator[Backends]:
    found = Backends()
    runners = []
    for name in ("P", "D"):
        app = web.Application()
        app.router.add_post("/v1/completions", found.handler(name))
        app.router.add_get("/health", _health)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        setattr(found, f"{name.lower()}_url", f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        yield found
    finally:
        for event in found.release.values():
            event.set()
        for runner in runners:
            await runner.cleanup()


@dataclass
class Router:
    process: Process
    url: str
    http: aiohttp.ClientSession

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(*self.address)

    async def limits(self) -> dict[str, Any]:
        async with self.http.get(self.url + "/limits") as response:
            assert response.status == 200
            answer: dict[str, Any] = await response.json()
            return answer

    async def complete(self, **extra: Any) -> tuple[int, bytes]:
        body = {"prompt": "x", "max_tokens": 1} | extra
        async with self.http.post(self.url + "/v1/completions", json=body) as response:
            return response.status, await response.read()


@pytest_asyncio.fixture
async def start(backends: Backends) -> AsyncIterator[Callable[..., Any]]:
    """Start the router in front of `backends` with these options; stopped (and its output checked) after."""
    started: list[Router] = []

    async def starting(*options: str) -> Router:
        args = ["-m", ROUTER_MODULE, "--port", "0", "--health-interval", "1000", *options]
        args += ["--prefill", backends.p_url, "--decode", backends.d_url]
        process = Process(*args)
        url = (await asyncio.to_thread(process.wait_for, r"router listening on (http://\S+)")).group(1)
        http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT))
        started.append(Router(process, url, http))
        return started[-1]

    try:
        yield starting
    finally:
        for one in started:
            await one.http.close()
            await asyncio.to_thread(stop_clean, one.process)


async def until(check: Callable[[], Any], what: str) -> None:
    """Wait for `check()` (sync or async) to be true, for at most `WAIT` s."""
    try:
        async with asyncio.timeout(WAIT):
            while True:
                result = check()
                if asyncio.iscoroutine(result):
                    result = await result
                if result:
                    return
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within {WAIT} s: {what}") from None


async def ended(reader: asyncio.StreamReader, what: str) -> bytes:
    """What the router still sent on a connection before closing it; fails if it stays open."""
    try:
        return await asyncio.wait_for(reader.read(), WAIT)
    except (ConnectionResetError, BrokenPipeError):
        return b""
    except TimeoutError:
        raise AssertionError(f"{what}: still open after {WAIT} s") from None


async def answer(reader: asyncio.StreamReader, what: str) -> tuple[int, dict[str, Any]]:
    """One answer with a Content-Length (the router's JSON ones): its status and body."""
    try:
        async with asyncio.timeout(WAIT):
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            match = re.search(r"(?im)^content-length:\s*(\d+)", head)
            assert match, head
            body = await reader.readexactly(int(match.group(1)))
    except TimeoutError:
        raise AssertionError(f"{what}: no answer within {WAIT} s") from None
    return int(head.split()[1]), json.loads(body)


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: router\r\n\r\n".encode()


def post_head(length: int | None) -> bytes:
    framing = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    return f"POST /v1/completions HTTP/1.1\r\nHost: router\r\n{framing}\r\n\r\n".encode()


def padded(size: int, **extra: Any) -> bytes:
    """A completion body of exactly `size` bytes."""
    body = json.dumps({"prompt": "", "max_tokens": 1} | extra).encode()
    return body.replace(b'"prompt": ""', b'"prompt": "' + b"x" * (size - len(body)) + b'"')


# ---------------------------------------------------------------- the header deadline


@pytest.mark.asyncio
async def test_a_connection_slow_with_its_head_is_closed_while_another_is_answered(start: Any) -> None:
    live = await start("--header-timeout", "0.5")
    reader, writer = await live.connect()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nX-Slow: ")

    async def trickle() -> None:  # a byte of one header line every 0.1 s: busy, but never done
        while not reader.at_eof() and not writer.is_closing():  # (aiohttp's own bound: 8190 bytes a line)
            writer.write(b"x")
            await asyncio.sleep(0.1)

    slow = asyncio.create_task(trickle())
    try:
        assert (await live.complete())[0] == 200  # on a connection of its own, while the slow one trickles
        assert await ended(reader, "a connection trickling its head") == b""
    finally:
        slow.cancel()
        writer.close()
    assert (await live.complete())[0] == 200
    assert (await live.limits())["refused"]["header_timeout"] == 1


@pytest.mark.asyncio
async def test_an_idle_connection_is_closed(start: Any) -> None:
    live = await start("--header-timeout", "0.5", "--idle-timeout", "0.5")
    kept, kept_writer = await live.connect()
    kept_writer.write(get("/health"))
    assert (await answer(kept, "GET /health"))[0] == 200  # and kept alive: HTTP/1.1
    silent, silent_writer = await live.connect()  # sends nothing at all
    try:
        assert await ended(kept, "an idle keep-alive connection") == b""
        assert await ended(silent, "a connection that never sent a byte") == b""
    finally:
        kept_writer.close()
        silent_writer.close()
    limits = await live.limits()
    assert limits["refused"]["idle"] >= 2 and limits["refused"]["header_timeout"] == 0


@pytest.mark.asyncio
async def test_a_kept_alive_connection_outlives_the_header_deadline_and_serves_its_next_request(start: Any) -> None:
    """A client sends its next request on a pooled connection without knowing the server is
    closing it; a server that gives up on idle connections first makes such a request fail."""
    live = await start("--header-timeout", "0.3")  # the idle deadline: its default, 75 s
    kept, kept_writer = await live.connect()
    kept_writer.write(get("/health"))
    assert (await answer(kept, "GET /health"))[0] == 200
    silent, silent_writer = await live.connect()  # opened after that answer: its header deadline comes later
    try:
        assert await ended(silent, "a connection that never sent a byte") == b""
        assert not kept.at_eof()
        kept_writer.write(get("/health"))
        assert (await answer(kept, "the next request on the kept-alive connection"))[0] == 200
    finally:
        kept_writer.close()
        silent_writer.close()


@pytest.mark.asyncio
async def test_the_next_head_on_a_kept_alive_connection_has_the_header_deadline(start: Any) -> None:
    live = await start("--header-timeout", "0.3")
    kept, kept_writer = await live.connect()
    kept_writer.write(get("/health"))
    assert (await answer(kept, "GET /health"))[0] == 200
    kept_writer.write(b"GET /health HTTP/1.1\r\nHost: rou")  # and no more of it
    try:
        assert await ended(kept, "a kept-alive connection slow with its next head") == b""
    finally:
        kept_writer.close()
    assert (await live.limits())["refused"]["header_timeout"] == 1


# ---------------------------------------------------------------- bodies


@pytest.mark.asyncio
async def test_a_slow_body_gets_408(start: Any) -> None:
    live = await start("--body-timeout", "0.5")
    reader, writer = await live.connect()
    writer.write(post_head(1000) + b'{"prompt": "')

    async def trickle() -> None:  # a byte every 0.1 s: 1000 would take 100 s
        while not writer.is_closing():
            writer.write(b"x")
            await asyncio.sleep(0.1)

    slow = asyncio.create_task(trickle())
    try:
        status, body = await answer(reader, "a body trickling in")
    finally:
        slow.cancel()
        writer.close()
    assert status == 408
    assert "--body-timeout" in body["error"]["message"] and "0.5 s" in body["error"]["message"]
    assert (await live.complete())[0] == 200
    assert (await live.limits())["refused"]["body_timeout"] == 1


@pytest.mark.asyncio
async def test_bodies_over_the_budget_get_503_and_the_budget_comes_back(start: Any, backends: Backends) -> None:
    live = await start("--body-budget", "65536", "--max-body", "65536")
    held = asyncio.create_task(live.http.post(live.url + "/v1/completions", data=padded(40_000, hold="P")))
    try:
        await until(lambda: "P" in backends.arrived, "the first request at P")  # its 40,000 bytes in flight

        # its Content-Length alone: 40,000 more would exceed 65,536, refused before any body is sent
        reader, writer = await live.connect()
        writer.write(post_head(40_000))
        status, body = await answer(reader, "a body over the budget, by its Content-Length")
        writer.close()
        assert status == 503 and "--body-budget" in body["error"]["message"]

        # chunked: refused at the chunk that would exceed it
        reader, writer = await live.connect()
        writer.write(post_head(None) + f"{30_000:x}\r\n".encode() + padded(30_000) + b"\r\n")
        status, body = await answer(reader, "a chunked body over the budget")
        writer.close()
        assert status == 503 and "--body-budget" in body["error"]["message"]

        backends.release["P"].set()
        async with await held as response:
            assert response.status == 200
    finally:
        held.cancel()
    # the budget is back: the same body passes now
    async with live.http.post(live.url + "/v1/completions", data=padded(40_000)) as response:
        assert response.status == 200
    limits = await live.limits()
    assert limits["refused"]["body_budget"] == 2 and limits["body_bytes_in_flight"] == 0


@pytest.mark.asyncio
async def test_the_budget_is_held_until_both_legs_are_sent_not_while_d_streams(start: Any, backends: Backends) -> None:
    live = await start()
    held = asyncio.create_task(live.http.post(live.url + "/v1/completions", data=padded(10_000, hold="P")))
    try:
        await until(lambda: "P" in backends.arrived, "the request at P")
        assert (await live.limits())["body_bytes_in_flight"] == 10_000  # P has not answered yet
        backends.release["P"].set()
        async with await held as response:
            assert response.status == 200
    finally:
        held.cancel()
    body = padded(10_000, hold="D", stream=True)
    async with live.http.post(live.url + "/v1/completions", data=body) as response:
        assert await response.content.readuntil(b"\n\n") == b"data: first\n\n"  # D's answer streams
        assert (await live.limits())["body_bytes_in_flight"] == 0
        backends.release["D"].set()
        assert await response.read() == b"data: [DONE]\n\n"


@pytest.mark.asyncio
async def test_a_body_over_max_body_gets_413_before_it_is_read(start: Any) -> None:
    live = await start("--max-body", "1000")
    reader, writer = await live.connect()
    writer.write(post_head(1001))  # and no body
    status, body = await answer(reader, "a body over --max-body")
    writer.close()
    assert status == 413 and "--max-body" in body["error"]["message"]
    reader, writer = await live.connect()
    writer.write(post_head(None) + f"{1001:x}\r\n".encode() + padded(1001) + b"\r\n")  # chunked: as it is read
    status, body = await answer(reader, "a chunked body over --max-body")
    writer.close()
    assert status == 413 and "--max-body" in body["error"]["message"]
    assert (await live.limits())["refused"]["body_too_large"] == 2


# ---------------------------------------------------------------- connections


@pytest.mark.asyncio
async def test_connections_over_the_limit_are_refused_while_those_busy_are_served(
    start: Any, backends: Backends
) -> None:
    live = await start("--max-connections", "3", "--max-connections-per-client", "3")
    url = live.url + "/v1/completions"
    held = [asyncio.create_task(live.http.post(url, data=padded(100, hold="P"))) for _ in range(3)]
    try:
        await until(lambda: backends.arrived.count("P") == 3, "three requests at P, each on its own connection")
        for _ in range(4):  # none of the three is idle: nothing gives way
            over, over_writer = await live.connect()  # the kernel accepts it; the router closes it
            assert await ended(over, "a connection over --max-connections") == b""
            over_writer.close()
        backends.release["P"].set()
        for task in held:  # the three are still served
            async with await task as response:
                assert response.status == 200
    finally:
        for task in held:
            task.cancel()
    limits = await live.limits()  # on one of the three, kept alive in the session's pool
    assert limits["refused"]["connections"] == 4 and limits["refused"]["evicted"] == 0
    assert limits["connections"] <= 3 and limits["limits"]["max_connections"] == 3
    output = "".join(live.process.output)
    assert output.count("refused a connection") == 1, output  # the rest within 10 s: one line, later


@pytest.mark.asyncio
async def test_at_the_limit_the_connection_idle_longest_gives_way_to_a_new_one(start: Any) -> None:
    """Clients that each send a request and then hold their connection idle no longer lock the
    others out for the idle deadline: each new connection takes the place of the one idle longest."""
    live = await start("--max-connections", "4", "--max-connections-per-client", "4")
    await live.http.close()  # its pool would take a connection of the four
    opened: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(4):  # the hostile ones: answered once, then idle
            reader, writer = await live.connect()
            writer.write(get("/health"))
            assert (await answer(reader, "a request before idling"))[0] == 200
            opened.append((reader, writer))
        for index in range(6):  # genuine ones, on new connections: each served, and then idle in turn
            reader, writer = await live.connect()
            writer.write(get("/health"))
            assert (await answer(reader, f"genuine request {index}"))[0] == 200
            assert await ended(opened[index][0], f"connection {index}, idle longest") == b""
            opened.append((reader, writer))
        for reader, _ in opened[6:]:
            assert not reader.at_eof()
        reader, writer = opened[-1]
        writer.write(get("/limits"))
        status, limits = await answer(reader, "GET /limits")
        assert status == 200 and limits["connections"] == 4 and limits["idle_connections"] == 3
        assert limits["refused"]["evicted"] == 6 and limits["refused"]["connections"] == 0
    finally:
        for _, writer in opened:
            writer.close()


@pytest.mark.asyncio
async def test_one_client_address_holds_its_share_and_no_more(start: Any, backends: Backends) -> None:
    live = await start("--max-connections", "6", "--max-connections-per-client", "2")
    await live.http.close()
    other = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(OTHER_CLIENT, 0)))
    url = live.url + "/v1/completions"
    held = [asyncio.create_task(other.post(url, data=padded(100, hold="P"))) for _ in range(2)]
    opened: list[asyncio.StreamWriter] = []
    try:
        await until(lambda: backends.arrived.count("P") == 2, f"two requests from {OTHER_CLIENT} at P")
        reader, writer = await asyncio.open_connection(*live.address, local_addr=(OTHER_CLIENT, 0))
        opened.append(writer)
        assert await ended(reader, f"a third connection from {OTHER_CLIENT}, both of its share busy") == b""
        reader, writer = await live.connect()  # another address has room
        opened.append(writer)
        writer.write(get("/health"))
        assert (await answer(reader, "a request from 127.0.0.1"))[0] == 200
        backends.release["P"].set()
        for task in held:
            async with await task as response:  # read in full: the connection goes back to the pool, not closed
                assert response.status == 200 and await response.read()
        # both of its share idle now in the session's pool: a new one takes the place of one
        reader, writer = await asyncio.open_connection(*live.address, local_addr=(OTHER_CLIENT, 0))
        opened.append(writer)
        writer.write(get("/limits"))
        status, limits = await answer(reader, f"a new connection from {OTHER_CLIENT}")
        assert status == 200 and limits["limits"]["max_connections_per_client"] == 2
        assert limits["refused"]["client_share"] == 1 and limits["refused"]["evicted"] == 1
        assert limits["refused"]["connections"] == 0
    finally:
        for task in held:
            task.cancel()
        for writer in opened:
            writer.close()
        await other.close()
    assert "refused a connection from 127.0.0.2: it holds 2, none idle" in "".join(live.process.output)


# ---------------------------------------------------------------- configuration


def test_each_limit_has_an_option_and_refuses_a_non_positive_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert router.config_from(router.parse_args([])).limits == http_limits.Limits()
    given = ["--header-timeout", "1.5", "--body-timeout", "2", "--body-budget", "4096", "--max-body", "1024"]
    given += ["--max-connections", "7", "--idle-timeout", "3", "--max-connections-per-client", "2"]
    limits = http_limits.Limits(1.5, 2.0, 4096, 1024, 7, 3.0, 2)
    assert router.config_from(router.parse_args(given)).limits == limits
    options = ("--header-timeout", "--body-timeout", "--body-budget", "--max-body", "--max-connections")
    for option in (*options, "--idle-timeout", "--max-connections-per-client"):
        for value in ("0", "-1", "x"):
            with pytest.raises(SystemExit):
                router.parse_args([option, value])
            assert f"argument {option}: {value!r} is not a positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        router.parse_args(["--body-budget", "1000", "--max-body", "2000"])
    assert "never fits" in capsys.readouterr().err


def test_the_default_connection_limit_leaves_descriptors_for_the_backends() -> None:
    # each connection in flight: its own descriptor and one to each of P and D; 64 kept back
    assert http_limits.default_max_connections(1024) == (1024 - 64) // 3 == 320
    assert http_limits.default_max_connections(65) == 1
    assert http_limits.default_max_connections() >= 1
    assert http_limits.Limits(max_connections=320).per_client() == 80  # a quarter by default
    assert http_limits.Limits(max_connections=3).per_client() == 1
    assert http_limits.Limits(max_connections=3, max_connections_per_client=9).per_client() == 3


@pytest.mark.asyncio
async def test_the_site_serves_on_its_own_listener_and_closes_it() -> None:
    """`LimitedSite` keeps its listening server itself (no attribute of aiohttp's BaseSite
    written), and the runner's cleanup stops it."""
    backend = Backend("http://127.0.0.1:9", "p", "tcp://127.0.0.1:5700")
    config = router.RouterConfig((backend,), (backend,), health_interval=1000)
    runner, site = await http_limits.start(router.make_app(config), "127.0.0.1", 0)
    try:
        host, port = site.address
        assert port != 0 and site.name == f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http, http.get(f"http://{host}:{port}/limits") as response:
            assert response.status == 200
            assert (await response.json())["limits"]["header_timeout"] == 10.0
    finally:
        await runner.cleanup()
    with pytest.raises(OSError):
        await asyncio.open_connection(host, port)
