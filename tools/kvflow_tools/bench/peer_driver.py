"""An engine process (`python -m kvflow_tools.testing.peer_process`) driven from asyncio.

Commands, replies, outcomes, released blocks, SIGKILL and restart under the same name, /proc
samples.

Why apart from the soak: the soak decides what to do and counts what went wrong; this class only
speaks the child's JSON-lines protocol, many commands in flight, without blocking the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvflow_tools.children import Child, spawn
from kvflow_tools.errors import BenchError

__all__ = ("ROOT", "Side", "last_line")

ROOT = Path(__file__).resolve().parents[3]  # the checkout: the children run in it


@dataclass
class Side:
    """One engine process (P or D), restarted under the same name and shared-memory prefix."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: str
    incarnations: int = 0
    address: str = ""
    pid: int = 0
    samples: list[dict[str, int]] = field(default_factory=list)
    _proc: Child | None = None
    _replies: deque[asyncio.Future[dict[str, Any]]] = field(default_factory=deque)
    _results: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    _released: dict[str, set[int]] = field(default_factory=dict)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _ready: asyncio.Future[dict[str, Any]] | None = None
    _reader: asyncio.Task[None] | None = None  # reads the process's events; kept, and watched
    killed_on_purpose: bool = False
    unexpected_exits: int = 0
    exits: list[str] = field(default_factory=list)  # why each unexpected exit happened
    stray: list[str] = field(default_factory=list)  # lines on stdout that are not events

    async def start(self) -> None:
        """:raises BenchError: the process did not come up (its reason, from stderr, included), or
        the last one still runs."""
        await self._last_reader_ended()
        loop = asyncio.get_running_loop()
        self._ready, self._replies, self._results, self._released = loop.create_future(), deque(), {}, {}
        self.killed_on_purpose, self.samples = False, []
        stderr = self.stderr_file()
        try:
            self._proc = await spawn(self.argv, stdin=True, stdout=True, stderr=stderr, env=self.env, cwd=ROOT)
        finally:
            os.close(stderr)
        self._reader = asyncio.ensure_future(self._read(self._proc))
        self._reader.add_done_callback(self._read_ended)
        try:
            ready = await asyncio.wait_for(asyncio.shield(self._ready), 60)
        except (TimeoutError, BenchError) as exc:
            why = await self._stderr_tail()
            raise BenchError(f"{self.name} did not start: {exc}; {why}") from None
        self.address, self.pid = ready["address"], ready["pid"]
        self.incarnations += 1

    async def _last_reader_ended(self) -> None:
        """Wait until the last incarnation's events are all read and its end counted.  Its reader
        ends when its pipe closes, which can be after `kill` returned; ending amid the new
        incarnation's set-up, it took that one for its own: an unexpected exit, a failed start.

        :raises BenchError: the last process still runs, or its reader does not end.
        """
        if self._reader is None or self._reader.done():
            return
        if self._proc is not None and self._proc.returncode is None:
            raise BenchError(f"{self.name} (pid {self._proc.pid}) is still running")
        await asyncio.wait({self._reader}, timeout=30)  # its pipe is closed by now: it ends at once
        if not self._reader.done():
            raise BenchError(f"{self.name}: the last process's events are still being read after 30 s")

    def stderr_file(self) -> int:
        """The file this incarnation's stderr goes to (a pipe nobody reads would fill and block it)."""
        return os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    async def _stderr_tail(self) -> str:
        await asyncio.sleep(0.5)  # let the process finish writing why it stopped
        return last_line(self.log_path)

    async def _read(self, proc: Child) -> None:
        assert proc.stdout is not None
        async for line in proc.stdout:
            try:
                event = json.loads(line)
                kind = event["event"]
            except (ValueError, TypeError, KeyError):  # a library's log line on stdout (UCX does)
                if len(self.stray) < 5:
                    self.stray.append(line.decode(errors="replace").strip()[:200])
                continue
            if kind == "ready" and self._ready is not None and not self._ready.done():
                self._ready.set_result(event)
            elif kind == "result":
                result = self.result_future(event["tid"])
                if not result.done():
                    result.set_result(event)
            elif kind == "released":
                self._released.setdefault(event["tid"], set()).update(event["blocks"])
                self._changed.set()
                self._changed = asyncio.Event()
            elif self._replies:
                reply = self._replies.popleft()
                if not reply.done():
                    reply.set_result(event)
        if proc is self._proc:  # this incarnation ended
            by_itself = not self.killed_on_purpose
            self.unexpected_exits += by_itself
            gone = BenchError(f"{self.name} (pid {proc.pid}) exited")
            for pending in [*self._replies, *self._results.values(), self._ready]:
                if pending is not None and not pending.done():
                    pending.set_exception(gone)
            self._replies.clear()
            self._changed.set()
            if by_itself:  # its stdout closed: it has exited, or is about to
                status, why = await proc.wait(), last_line(self.log_path)
                self.exits.append(f"{self.name} (pid {proc.pid}) exited by itself ({status}): {why}")

    def _read_ended(self, reader: asyncio.Task[None]) -> None:
        """A reader that raised fails what waits on its events at once, saying why, rather
        than leaving each to its own timeout."""
        if reader.cancelled() or (error := reader.exception()) is None:
            return
        broken = BenchError(f"{self.name}: reading its events failed: {error!r}")
        for pending in [*self._replies, *self._results.values(), self._ready]:
            if pending is not None and not pending.done():
                pending.set_exception(broken)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None and not self.killed_on_purpose

    def forget(self, tid: str) -> None:
        self._results.pop(tid, None)

    def result_future(self, tid: str) -> asyncio.Future[dict[str, Any]]:
        if tid not in self._results:
            self._results[tid] = asyncio.get_running_loop().create_future()
        return self._results[tid]

    async def ask(self, **cmd: Any) -> dict[str, Any]:
        """Send one command and return its reply (an "error" event when kvflow refused it).

        :raises BenchError: the process is gone.
        """
        if not self.alive or self._proc is None:
            raise BenchError(f"{self.name} is not running")
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._replies.append(reply)
        try:
            self._proc.write((json.dumps(cmd) + "\n").encode())
        except ConnectionError as exc:
            raise BenchError(f"{self.name}: {exc}") from None
        return await reply

    async def released(self, tid: str, blocks: list[int], timeout: float, incarnation: int) -> bool:
        """Wait until `blocks` of `tid` came back (or `incarnation`, the process that held them,
        ended); False on timeout."""
        end = time.monotonic() + timeout
        while not set(blocks) <= self._released.get(tid, set()):
            if not self.alive or self.incarnations != incarnation:
                return True  # the process and its blocks are gone
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), max(end - time.monotonic(), 0.001))
            if time.monotonic() >= end:
                return set(blocks) <= self._released.get(tid, set())
        self._released.pop(tid, None)
        return True

    def signal(self, signum: int) -> None:
        if self._proc is not None and self._proc.returncode is None:
            os.kill(self._proc.pid, signum)

    async def kill(self) -> None:
        self.killed_on_purpose = True
        self.signal(signal.SIGKILL)
        if self._proc is not None:
            await self._proc.wait()

    async def close(self) -> None:
        if self.alive:
            with contextlib.suppress(BenchError, TimeoutError):
                await asyncio.wait_for(self.ask(cmd="close"), 20)
        self.killed_on_purpose = True
        if self._proc is not None:  # (also when it exited by itself: its pipes close then)
            self._proc.kill()
            await self._proc.wait()

    def sample(self) -> None:
        """Record RSS (KiB), open fds and threads of the current incarnation from /proc."""
        with contextlib.suppress(OSError, ValueError, KeyError):  # a process that just died has no VmRSS
            status = Path(f"/proc/{self.pid}/status").read_text().splitlines()
            fields = dict(line.split(":", 1) for line in status if ":" in line)
            rss = int(fields["VmRSS"].split()[0])
            threads = int(fields["Threads"])
            fds = len(os.listdir(f"/proc/{self.pid}/fd"))
            self.samples.append({"rss_kib": rss, "fds": fds, "threads": threads})

    def drift(self) -> dict[str, Any]:
        first, last = (self.samples[0], self.samples[-1]) if self.samples else ({}, {})
        return {"incarnations": self.incarnations, "first": first, "last": last, "samples": list(self.samples)}


def last_line(path: str) -> str:
    try:
        lines = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError as exc:
        return f"stderr unreadable: {exc}"
    return lines[-1] if lines else "nothing on stderr"
