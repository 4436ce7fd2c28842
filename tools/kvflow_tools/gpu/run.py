"""The GPU check's parent side: its output folder (`Run`) and its child processes (`Proc`).

Why: a run on a GPU machine may be cut off by its time limit at any moment, so what finished
must be on disk already: `Run` rewrites results.json whenever a phase starts or ends and keeps
run.log line by line.  A child that hangs must not hang the run: every wait of `Proc` on a
child's JSON lines has a deadline, a child that exits or answers with an error raises, and a
child is closed politely or killed, its stderr's head and tail kept in children.log.  SIGTERM
(the machine's time limit) and SIGINT become `KeyboardInterrupt`, which no phase catches, once
the children are marked to be killed rather than closed.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import IO, Any

from kvflow_tools.children import import_path
from kvflow_tools.errors import GpuChildFailed, GpuPhaseTimeout
from kvflow_tools.gpu.ucx import is_ucx_table

__all__ = ("MODULE", "Proc", "Run", "child_argv", "child_env", "interrupt_on_signals", "short")

MODULE = "kvflow_tools.gpu"  # what the children run, with `python -m`


class Run:
    """The output folder: results.json (rewritten as each phase starts and ends), run.log, the
    files the phases add; a scratch folder for the children's stderr; the whole run's deadline."""

    def __init__(self, out: Path, device: str, budget: float) -> None:
        """:raises OSError: the output folder or the scratch folder cannot be made or written."""
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.device = device
        self.started = time.monotonic()
        self.deadline = self.started + budget
        self.stopping = False  # a signal came: children are killed, not closed politely
        self.logf = open(out / "run.log", "a", buffering=1)  # noqa: SIM115 (closed by close())
        self.tmp = Path(tempfile.mkdtemp(prefix="kvflow-gpucheck-"))
        self.partial: dict[str, Any] = {}  # what the running phase has so far
        self.doc: dict[str, Any] = {
            "check": f"kvflow GPU check (python -m {MODULE})",
            "device": device,
            "argv": sys.argv,
            "cwd": os.getcwd(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "budget_s": budget,
            "summary": {},
            "phases": [],
        }
        self.write()

    def log(self, msg: str) -> None:
        """One line, with the seconds since the start, to stdout and run.log.

        :raises OSError: run.log cannot be written.
        """
        line = f"[{time.monotonic() - self.started:7.2f}s] {msg}"
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        self.logf.write(line + "\n")

    def write(self) -> None:
        """results.json, replaced whole (a reader never sees half a file).

        :raises OSError: it cannot be written.
        """
        self.doc["elapsed_s"] = round(time.monotonic() - self.started, 2)
        tmp = self.out / ".results.json.tmp"
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        tmp.replace(self.out / "results.json")

    def record(self, phase: dict[str, Any]) -> None:
        """A phase's entry (its key in ``phase["phase"]``) replaces its earlier one; the summary
        takes its status; results.json is rewritten.

        :raises OSError: results.json cannot be written.
        """
        self.doc["phases"] = [p for p in self.doc["phases"] if p["phase"] != phase["phase"]] + [phase]
        self.doc["summary"][phase["phase"]] = phase["status"]
        self.write()

    def append(self, name: str, text: str) -> None:
        """`text` at the end of the output folder's file `name`.

        :raises OSError: it cannot be written.
        """
        with open(self.out / name, "a") as f:
            f.write(text)

    def close(self) -> None:
        """Close run.log and remove the scratch folder.  Never raises."""
        self.logf.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def interrupt_on_signals(run: Run) -> None:
    """From now on SIGTERM and SIGINT mark `run` as stopping and raise `KeyboardInterrupt` in
    the main thread, wherever it is.  Never raises."""

    def handler(signum: int, frame: FrameType | None) -> None:
        run.stopping = True
        name = signal.Signals(signum).name
        raise KeyboardInterrupt(f"{name} (the run's time limit?)" if signum == signal.SIGTERM else name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def child_argv(role: str, device: str, *extra: str) -> list[str]:
    """The command line of a child of this check: this Python, ``-m kvflow_tools.gpu``.  Never raises."""
    return [sys.executable, "-m", MODULE, "--role", role, "--device", device, *extra]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child: a fresh `KVFLOW_SECRET` (one per pair),
    unbuffered output, and a ``PYTHONPATH`` with the folders this process's `kvflow` and
    `kvflow_tools` come from (a checkout's root and its tools/) in front of the one it had, so
    that wheels installed off the default path still load.  Never raises."""
    env = dict(os.environ)
    env["KVFLOW_SECRET"] = secrets.token_hex(32)
    env["PYTHONUNBUFFERED"] = "1"
    front = import_path().split(os.pathsep)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in front]
    env["PYTHONPATH"] = os.pathsep.join([*front, *rest])
    env.update(extra or {})
    return env


def short(msg: dict[str, Any]) -> str:
    """A child's reply for run.log: long strings cut, no traceback, at most 400 characters.  Never raises."""
    m = {k: (v[:16] + "..." if isinstance(v, str) and len(v) > 64 else v) for k, v in msg.items() if k != "trace"}
    return json.dumps(m)[:400]


class Proc:
    """A child process and its JSON lines: commands to its stdin, replies from its stdout, read
    by a thread; its stderr to a file in the run's scratch folder.  Every wait is bounded."""

    def __init__(self, run: Run, name: str, argv: list[str], env: dict[str, str], tag: str) -> None:
        """Start `argv` (`child_argv`'s, for a child of this check) as `name` of phase `tag`.

        :raises OSError: the process cannot be started.
        """
        self.run, self.name, self.tag = run, name, tag
        self.err_path = run.tmp / f"{tag}-{name}.stderr"
        self.err = open(self.err_path, "wb")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True, env=env
        )
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.held: list[dict[str, Any]] = []
        self.next_id = 0
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stdout: IO[str]) -> None:
        with stdout:
            for line in stdout:
                try:
                    self.lines.put(json.loads(line))
                except json.JSONDecodeError:
                    self.lines.put({"event": "noise", "text": line.rstrip()})
        self.lines.put(None)

    def send(self, cmd: str, **fields: Any) -> int:
        """Write command `cmd` with a fresh id, which it returns.

        :raises OSError: the child's stdin is closed (it exited).
        """
        self.next_id += 1
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, "id": self.next_id, **fields}) + "\n")
        self.proc.stdin.flush()
        return self.next_id

    def wait(self, event: str, ident: Any, deadline: float) -> dict[str, Any]:
        """The next `event` with id `ident` (replies to other ids are held for their waits).

        :raises GpuChildFailed: an "error" reply with that id, a start error, or the child exited.
        :raises GpuPhaseTimeout: no such reply by `deadline` (on `time.monotonic`).
        """
        while True:
            for msg in self.held:
                if msg.get("id") == ident and msg["event"] in (event, "error"):
                    self.held.remove(msg)
                    if msg["event"] == "error":
                        raise GpuChildFailed(f"{msg['error']}\n{msg.get('trace', '')}")
                    return msg
            left = deadline - time.monotonic()
            if left <= 0:
                raise GpuPhaseTimeout(f"{self.name}: no {event!r} in time")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                raise GpuPhaseTimeout(f"{self.name}: no {event!r} in time") from None
            if line is None:
                self.proc.wait(timeout=5)
                raise GpuChildFailed(
                    f"{self.name} exited (rc {self.proc.returncode}) waiting for {event!r}: {self.stderr_tail(15)}"
                )
            self.run.log(f"  {self.name} -> {short(line)}")
            if line["event"] == "error" and line.get("id") == "start":
                raise GpuChildFailed(f"{self.name} failed to start: {line['error']}\n{line.get('trace', '')}")
            self.held.append(line)

    def request(self, cmd: str, reply: str, deadline: float, **fields: Any) -> dict[str, Any]:
        """Send `cmd` and wait for its `reply`.

        :raises OSError: the child's stdin is closed.
        :raises GpuChildFailed: it answered with an error, or exited.
        :raises GpuPhaseTimeout: no reply by `deadline`.
        """
        return self.wait(reply, self.send(cmd, **fields), deadline)

    def stderr_tail(self, n: int) -> str:
        """The last `n` lines the child wrote to its stderr so far.  Never raises."""
        with contextlib.suppress(ValueError):  # closed already: all of it is on disk
            self.err.flush()
        return "\n".join(self.err_path.read_text(errors="replace").splitlines()[-n:])

    def close(self) -> None:
        """Ask the child to close (unless the run is stopping), kill it if it has not exited
        15 s later, and keep the head and the tail of its stderr, less UCX's tables, in
        children.log.

        :raises OSError: children.log cannot be written.
        """
        try:
            if self.proc.poll() is None and not self.run.stopping:
                with contextlib.suppress(OSError, ValueError, subprocess.TimeoutExpired):
                    self.send("close")
                    self.proc.wait(timeout=15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
            self.err.close()
        text = [ln for ln in self.err_path.read_text(errors="replace").splitlines() if not is_ucx_table(ln)]
        if text:
            keep = (
                text if len(text) <= 120 else [*text[:40], f"... ({len(text) - 120} lines left out) ...", *text[-80:]]
            )
            head = f"=== {self.tag} {self.name} (rc {self.proc.returncode}) stderr ===\n"
            self.run.append("children.log", head + "\n".join(keep) + "\n")
