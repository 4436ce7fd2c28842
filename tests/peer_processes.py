"""Engine processes driven from a test: `python -m kvflow_tools.testing.peer_process` over JSON lines.

Why a helper module: the cross-process, dead-peer, attack and network-namespace tests all start
P and D as real processes; the driver and the transports they run are here once.  The
`prefix` fixture (unique shared-memory names, cleaned up) is in conftest.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SECRET = "cross-process test secret, 32 bytes!"
Event = dict[str, Any]


class PeerProcess:
    def __init__(
        self,
        name: str,
        prefix: str,
        *extra: str,
        secret: str = SECRET,
        launcher: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`launcher` runs the process (e.g. inside a network namespace); `env` adds variables."""
        environment = dict(os.environ, KVFLOW_SECRET=secret, **(env or {}))
        self.name = name
        self.proc = subprocess.Popen(
            [
                *launcher,
                sys.executable,
                "-m",
                "kvflow_tools.testing.peer_process",
                "--name",
                name,
                "--prefix",
                prefix,
                *extra,
            ],
            cwd=ROOT,
            env=environment,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.events: queue.Queue[Event] = queue.Queue()
        self.seen: list[Event] = []
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.wait(lambda e: e["event"] == "ready", 30)
        self.address: str = ready["address"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def wait(self, match: Callable[[Event], bool], timeout: float = 10.0) -> Event:
        for event in self.seen:
            if match(event):
                self.seen.remove(event)
                return event
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                event = self.events.get(timeout=max(end - time.monotonic(), 0.01))
            except queue.Empty:
                break
            if match(event):
                return event
            self.seen.append(event)
        raise AssertionError(f"{self.name}: no matching event within {timeout}s; saw {self.seen}")

    def ask(self, event: str, wait_s: float = 10.0, **cmd: Any) -> Event:
        self.send(**cmd)
        return self.wait(lambda e: e["event"] in (event, "error"), wait_s)

    def result(self, tid: str, timeout: float = 10.0) -> Event:
        return self.wait(lambda e: e["event"] == "result" and e["tid"] == tid, timeout)

    def stats_when(self, match: Callable[[Event], bool], what: str, timeout: float = 10.0) -> Event:
        """Ask for stats until they `match`; `timeout` only guards against a hang."""
        end = time.monotonic() + timeout
        while not match(stats := self.ask("stats", cmd="stats")):
            if time.monotonic() > end:
                raise AssertionError(f"{self.name}: not within {timeout}s: {what}; last stats {stats}")
            time.sleep(0.01)
        return stats

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._close_pipes()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(cmd="close")
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def start_pair(prefix: str, *extra: str) -> tuple[PeerProcess, PeerProcess]:
    p = PeerProcess("P", f"{prefix}-p", *extra)
    d = PeerProcess("D", f"{prefix}-d", *extra)
    assert d.ask("connected", cmd="connect", peer="P", address=p.address)["event"] == "connected"
    return p, d


def kill_prefill_after_registration(p: PeerProcess, d: PeerProcess, timeout: float) -> Event:
    """D registers transfer "r" with P, P is killed before producing its KV: D's result."""
    d.ask("started", cmd="expect", tid="r", epoch=1, peer="P", blocks=[1, 2], mode="push")
    p.stats_when(lambda s: s["live_transfers"] == 1, "P has D's registration")
    p.kill()
    return d.result("r", timeout=timeout)


TRANSPORTS = {
    "shm": ("--transport", "shm"),
    "nixl-direct": ("--transport", "nixl", "--nixl-mode", "direct"),
    "nixl-prepped": ("--transport", "nixl", "--nixl-mode", "prepped"),
}
