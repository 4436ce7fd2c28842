"""Processes a deployment starts, each in a process group of its own, and stopped as a group.

Why groups: a vLLM OpenAI server is several processes (the API server, its engine core, on
CPUs the workers it spawns, multiprocessing's resource tracker).  Signalling the API server
alone can leave the others running, holding gigabytes and ports.  Each server is started as the
leader of a new session, so its whole tree shares one process group id; stopping sends SIGTERM
to the group, waits, then SIGKILLs what is left, and reports the group empty only when no
process of it remains.  Every wait has a deadline.  A warden process (`kvflow_tools.serve.warden`)
stops the groups still running when the process that started them dies without stopping them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from kvflow_tools.children import import_path
from kvflow_tools.errors import ServerFailed

__all__ = ("WARDEN", "Group", "ServerFailed", "free_port", "group_alive", "http_ok", "stop_groups", "wait_all")

LOG_TAIL_BYTES = 6000  # how much of a failed server's log its error quotes
POLL_S = 0.1  # how often a group being stopped is looked at


_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, never the same twice in a process, and below the OS's
    ephemeral range where there is room: a port the OS hands out for ``bind(0)`` can be handed
    out again, to any process, before the server it was chosen for binds it (minutes later for
    a vLLM server starting on a loaded machine); ports below that range are never handed out."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(200 if low > 12000 else 0):
        port = random.randrange(10000, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class _Warden:
    """This process's one warden, started with the first group, and the pipe it watches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None

    def tell(self, line: str, start: bool = True) -> None:
        """Write `line` to the warden, starting it first if need be and `start` allows.

        :raises ServerFailed: the warden cannot be started."""
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                if not start:
                    return
                try:
                    self._process = subprocess.Popen(
                        [sys.executable, "-m", "kvflow_tools.serve.warden"],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.DEVNULL,
                        env=dict(os.environ, PYTHONPATH=import_path()),
                        start_new_session=True,  # out of reach of the terminal's Ctrl-C
                    )
                except OSError as exc:
                    raise ServerFailed(f"cannot start the warden of this process's servers: {exc}") from exc
            assert self._process.stdin is not None
            with contextlib.suppress(OSError):  # a warden that died: the next start begins another
                self._process.stdin.write(line.encode() + b"\n")
                self._process.stdin.flush()

    @property
    def pid(self) -> int:
        """The warden's pid, 0 before the first group."""
        with self._lock:
            return self._process.pid if self._process is not None else 0


WARDEN = _Warden()


def stop_groups(pgids: Collection[int], grace: float, kill_wait: float, reap: Callable[[], object]) -> set[int]:
    """SIGCONT (a stopped group cannot act on SIGTERM) and SIGTERM to every process group of
    `pgids`, SIGKILL after `grace` seconds to those with a process left; the groups still alive
    `kill_wait` seconds after that.  `reap` runs before each look, to collect leaders that are
    the caller's children (a zombie leader would count as alive).  Never raises."""

    def send(groups: Collection[int], sig: signal.Signals) -> None:
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)

    def survivors(groups: Collection[int], deadline: float) -> set[int]:
        left = set(groups)
        while True:
            reap()
            left = {pgid for pgid in left if group_alive(pgid)}
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(POLL_S)

    send(pgids, signal.SIGCONT)
    send(pgids, signal.SIGTERM)
    left = survivors(pgids, time.monotonic() + grace)
    if left:
        send(left, signal.SIGKILL)
        left = survivors(left, time.monotonic() + kill_wait)
    return left


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether GET `url` answers 200 within `timeout` seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return bool(answer.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` remains (zombies of a reaped leader excluded)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Group:
    """One command run as the leader of a new process group, its output in `log`."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str]
    log: Path
    cwd: Path | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _out: IO[bytes] | None = field(default=None, init=False, repr=False)

    def start(self) -> None:
        """Start the command, watched by this process's warden.

        :raises ServerFailed: the command, or the warden, cannot be started."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(self.log, "ab")  # noqa: SIM115 (closed in stop)
        try:
            self.process = subprocess.Popen(
                list(self.argv),
                env=dict(self.env),
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=self._out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own session and process group: stopped as one
            )
        except OSError as exc:
            self._out.close()
            raise ServerFailed(f"{self.name}: cannot start {self.argv[0]}: {exc}") from exc
        try:
            WARDEN.tell(f"+{self.process.pid}")
        except ServerFailed:
            self.stop(grace=0.0)
            raise

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    def exited(self) -> int | None:
        """The leader's exit status, or None while it runs."""
        return None if self.process is None else self.process.poll()

    def tail(self, limit: int = LOG_TAIL_BYTES) -> str:
        """The end of the group's log."""
        try:
            data = self.log.read_bytes()
        except OSError:
            return ""
        return data[-limit:].decode("utf-8", "replace")

    def wait_until(self, ready: Callable[[], bool], deadline: float, what: str, poll: float = 0.5) -> None:
        """Poll `ready` until it holds.

        :raises ServerFailed: the leader exited, or `deadline` (a `time.monotonic` value) passed.
        """
        wait_all([(self, ready)], deadline, what, poll)

    def check_running(self, what: str) -> None:
        """:raises ServerFailed: the leader exited (its log's end quoted)."""
        status = self.exited()
        if status is not None:
            raise ServerFailed(f"{self.name} exited with status {status} before {what}:\n{self.tail()}")

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` to every process of the group (nothing if it is gone)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)

    def stop(self, grace: float = 15.0, kill_wait: float = 10.0) -> bool:
        """SIGTERM to the group, SIGKILL to what is left after `grace` seconds; True when no
        process of the group remains (waits at most `grace + kill_wait` seconds)."""
        if self.process is None:
            return True
        pgid = self.process.pid
        empty = not stop_groups({pgid}, grace, kill_wait, self.process.poll)  # poll reaps the leader
        if self._out is not None:
            self._out.close()
            self._out = None
        if empty:
            WARDEN.tell(f"-{pgid}", start=False)
        return empty


def wait_all(waits: Sequence[tuple[Group, Callable[[], bool]]], deadline: float, what: str, poll: float = 0.5) -> None:
    """Poll every group's `ready` until each holds, checking all of them on every round, so
    that one that exits is reported at once whichever is waited for.

    :raises ServerFailed: a leader exited, or `deadline` (a `time.monotonic` value) passed.
    """
    pending = list(waits)
    while True:
        for group, _ in pending:
            group.check_running(what)
        pending = [(group, ready) for group, ready in pending if not ready()]
        if not pending:
            return
        if time.monotonic() >= deadline:
            late = ", ".join(group.name for group, _ in pending)
            raise ServerFailed(f"{late}: no {what} by its deadline:\n{pending[0][0].tail()}")
        time.sleep(poll)
