"""The stand `kvflow bench router` measures on: fake P and D, the router's process, raw HTTP.

Why apart from the scenarios: what a scenario measures should read as the scenario alone; how
the router is started and read (/proc: descriptors, VmRSS and VmHWM, utime + stime), how the
fake backends are held and released, and the raw HTTP of clients that leave things unsent are
the same for all of them.  P and D are aiohttp servers in the benchmark's own process (its
event loop), so that a scenario holds and releases them with an `asyncio.Event` and counts what
reached them without any protocol of their own; the router is ``python -m
kvflow_tools.routing.router`` with health checks at its start only, running the kvflow this
module was imported from.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvflow_tools.children import Collected, import_path
from kvflow_tools.errors import BenchError
from kvflow_tools.routing import router

__all__ = (
    "MIB",
    "WAIT",
    "Backends",
    "Post",
    "RouterProcess",
    "Stand",
    "get_request",
    "padded",
    "read_answer",
    "stand",
    "until",
    "until_closed",
)

MIB = 1 << 20
WAIT = 120.0  # seconds any one wait on the router may take before the run fails
EVENT = b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
FIRST_EVENT = b"data: first\n\n"


# ---------------------------------------------------------------- the fake backends


@dataclass
class Backends:
    """P and D in this process.  P answers one token with ``kv_transfer_params`` (as vLLM's does),
    once `hold_p` is set when there is one, or without end when `endless`; D streams, holding
    after its first event until `hold_d` is set when there is one.  Bodies are read and dropped;
    with `watch`, a leg whose ``kv_transfer_params`` hold that text is counted in `carried` (what
    of a client's params reached a backend), and every `bare_every`-th answer of P carries no
    params (a P that says nothing of its KV)."""

    endless_cap: int = 0
    endless: bool = False
    hold_p: asyncio.Event | None = None
    hold_d: asyncio.Event | None = None
    arrived: Counter[str] = field(default_factory=Counter)  # "P", "D": bodies read in full
    p_sent: int = 0  # bytes of P's endless answer written
    urls: dict[str, str] = field(default_factory=dict)
    watch: str = ""
    bare_every: int = 0
    carried: Counter[str] = field(default_factory=Counter)  # "P", "D": legs carrying `watch`

    async def _read(self, request: web.Request, leg: str) -> None:
        if not self.watch:
            await _drain(request)
        elif self.watch in json.dumps(json.loads(await request.read()).get("kv_transfer_params")):
            self.carried[leg] += 1
        self.arrived[leg] += 1

    async def prefill(self, request: web.Request) -> web.StreamResponse:
        await self._read(request, "P")
        if self.hold_p is not None:
            await self.hold_p.wait()
        if not self.endless:
            answer = {"id": "cmpl-bench", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
            if self.bare_every and self.arrived["P"] % self.bare_every == 0:
                return web.json_response(answer)
            return web.json_response(answer | {"kv_transfer_params": {"do_remote_prefill": True, "from": "P"}})
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        chunk = b" " * (64 << 10)  # JSON white space: an answer that never ends
        with suppress(ConnectionError):  # until the router lets go of it
            await response.prepare(request)
            while self.p_sent < self.endless_cap:
                await response.write(chunk)
                self.p_sent += len(chunk)
        return response

    async def decode(self, request: web.Request) -> web.StreamResponse:
        await self._read(request, "D")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        with suppress(ConnectionError):  # the router cancels D's leg when P's fails
            await response.prepare(request)
            await response.write(FIRST_EVENT)
            if self.hold_d is not None:
                await self.hold_d.wait()
            for _ in range(3):
                await response.write(EVENT)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        return response


async def _drain(request: web.Request) -> None:
    async for _ in request.content.iter_any():
        pass


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@asynccontextmanager
async def serving(backends: Backends) -> AsyncIterator[Backends]:
    runners = []
    try:
        for name, handler in (("P", backends.prefill), ("D", backends.decode)):
            app = web.Application()
            app.router.add_post("/v1/completions", handler)
            app.router.add_get("/health", _health)
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            backends.urls[name] = f"http://127.0.0.1:{runner.addresses[0][1]}"
        yield backends
    finally:
        for event in (backends.hold_p, backends.hold_d):
            if event is not None:
                event.set()
        for runner in runners:
            await runner.cleanup()


# ---------------------------------------------------------------- the router's process


class RouterProcess(Collected):
    """``python -m kvflow_tools.routing.router`` in front of `urls` ("P", "D"), its output
    collected; the kvflow this tool imports is the one it runs."""

    def __init__(self, urls: dict[str, str], options: tuple[str, ...]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([import_path(), *filter(None, [env.get("PYTHONPATH")])])
        args = [sys.executable, "-m", router.__name__, "--port", "0", "--health-interval", "1000", *options]
        super().__init__([*args, "--prefill", urls["P"], "--decode", urls["D"]], env=env)

    def url(self) -> str:
        """Where it listens, once it says so.  :raises BenchError: it ended or said nothing in time."""
        if match := self.wait_for(r"router listening on (http://\S+)", WAIT):
            return match.group(1)
        raise BenchError("the router did not start: " + "".join(self.output)[-2000:])

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def memory(self) -> dict[str, int]:
        """VmRSS and VmHWM (the peak RSS since it started), in bytes."""
        found = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024
        return found

    def cpu_seconds(self) -> float:
        """utime + stime so far."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def finish(self) -> int:
        """Stop it (SIGTERM, SIGKILL 30 s later); the tracebacks it printed (0 on a clean run)."""
        return self.stop(30.0).count("Traceback")


@dataclass
class Stand:
    backends: Backends
    router: RouterProcess
    url: str
    http: aiohttp.ClientSession  # a connection for each request, so that none sits idle in a pool

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    async def limits(self) -> dict[str, Any]:
        async with self.http.get(self.url + "/limits") as response:
            if response.status != 200:
                raise BenchError(f"GET /limits answered {response.status}")
            answer: dict[str, Any] = await response.json()
            return answer

    async def complete(self, **extra: Any) -> tuple[int, bytes]:
        body = {"prompt": "hello", "max_tokens": 4, "stream": True} | extra
        async with self.http.post(self.url + "/v1/completions", json=body) as response:
            return response.status, await response.read()


@asynccontextmanager
async def stand(backends: Backends, router_options: tuple[str, ...] = ()) -> AsyncIterator[Stand]:
    async with serving(backends):
        process = RouterProcess(backends.urls, router_options)
        try:
            url = await asyncio.to_thread(process.url)
            connector = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=WAIT)) as http:
                yield Stand(backends, process, url, http)
        finally:
            tracebacks = await asyncio.to_thread(process.finish)
        if tracebacks:
            raise BenchError("the router printed tracebacks: " + "".join(process.output)[-4000:])


async def until(check: Callable[[], bool], what: str) -> None:
    """Wait for `check()`, at most `WAIT` s.  :raises BenchError: not in time."""
    deadline = time.monotonic() + WAIT
    while not check():
        if time.monotonic() > deadline:
            raise BenchError(f"not within {WAIT:g} s: {what}")
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------- raw HTTP


def get_request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: router\r\n\r\n".encode()


async def read_answer(reader: asyncio.StreamReader) -> int:
    """One answer with a Content-Length: its status."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    match = re.search(r"(?im)^content-length:\s*(\d+)", head)
    await reader.readexactly(int(match.group(1)) if match else 0)
    return int(head.split()[1])


async def until_closed(reader: asyncio.StreamReader) -> None:
    """Until the router closes the connection (anything it sends is dropped)."""
    with suppress(ConnectionError):
        while await reader.read(1 << 16):
            pass


def padded(size: int) -> bytes:
    """A streamed completion's body of exactly `size` bytes."""
    body = json.dumps({"prompt": "", "max_tokens": 1, "stream": True}).encode()
    return body.replace(b'"prompt": ""', b'"prompt": "' + b"x" * max(0, size - len(body)) + b'"')


@dataclass
class Post:
    """One raw POST of a large body: the body sent while the answer is read."""

    status: int | None = None  # None: not answered (yet), or the connection was reset first
    streaming: bool = False  # D's first event came through
    reset: bool = False

    async def run(self, address: tuple[str, int], body: bytes) -> None:
        reader, writer = await asyncio.open_connection(*address)
        head = f"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Length: {len(body)}\r\n"
        writer.write(head.encode() + b"Connection: close\r\n\r\n")
        sending = asyncio.create_task(self._send(writer, memoryview(body)))
        try:
            answer = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            self.status = int(answer.split()[1])
            if self.status == 200:
                await reader.readuntil(b"\n\n")
                self.streaming = True
            await until_closed(reader)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.reset = True
        finally:
            sending.cancel()
            await asyncio.wait({sending})
            writer.close()

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, body: memoryview) -> None:
        with suppress(ConnectionError):  # a refused body is not read to its end
            for start in range(0, len(body), MIB):
                writer.write(body[start : start + MIB])
                await writer.drain()
