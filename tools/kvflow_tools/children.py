"""Child processes for the tools' asyncio code, started with no Python run between fork and exec.

Why not `asyncio.create_subprocess_exec`: on uvloop, which `kvflow.runtime.loop` picks, it forks
and then runs Python's after-fork handlers in the child (`PyOS_AfterFork_Child`) before exec.
In a process with other threads (engines, writers, the peer thread, pytest-xdist's) those
handlers work on state another thread may have held at the fork: a child died of "double free
or corruption" before its exec when tests ran side by side.  `subprocess.Popen` without
`preexec_fn` runs only C there, on any loop; this wraps it with asyncio streams on its pipes and
an exit awaited through a pidfd.  `import_path` makes a child import the `kvflow` and
`kvflow_tools` its parent imported.  `Collected` is the same for synchronous code: a child whose
output lines a thread collects, waited on for a line and stopped with a deadline.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import kvflow
import kvflow_tools

__all__ = ("PIPE", "Child", "Collected", "import_path", "spawn")

PIPE = subprocess.PIPE


def import_path() -> str:
    """A ``PYTHONPATH`` under which a child imports the same `kvflow` and `kvflow_tools` as this
    process: a checkout's own, not another copy installed in the environment.  Never raises."""
    folders = (Path(package.__file__ or "").resolve().parents[1] for package in (kvflow, kvflow_tools))
    return os.pathsep.join(dict.fromkeys(str(folder) for folder in folders))


class Child:
    """A process started by `spawn`: its pid, its piped streams and its exit."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        stdin: asyncio.WriteTransport | None,
        stdout: tuple[asyncio.ReadTransport, asyncio.StreamReader] | None,
        stderr: tuple[asyncio.ReadTransport, asyncio.StreamReader] | None,
    ) -> None:
        self._popen = popen
        self._stdin = stdin
        self._outputs = [pipe[0] for pipe in (stdout, stderr) if pipe is not None]
        self.stdout = None if stdout is None else stdout[1]
        self.stderr = None if stderr is None else stderr[1]

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: the signal), or None while it runs."""
        return self._popen.poll()

    def write(self, data: bytes) -> None:
        """Queue `data` for the child's stdin (buffered by the loop, never blocks).

        :raises ConnectionError: stdin is not piped, closed, or the child is gone.
        """
        if self._stdin is None or self._stdin.is_closing():
            raise ConnectionError(f"process {self.pid}: its stdin is closed")
        self._stdin.write(data)

    def close_stdin(self) -> None:
        """End the child's input (what was queued is still written first).  Never raises."""
        if self._stdin is not None:
            self._stdin.close()

    def kill(self) -> None:
        """SIGKILL, unless it has already exited."""
        if self._popen.poll() is None:
            self._popen.kill()

    async def wait(self) -> int:
        """Its exit status, once it exits (no deadline here: the callers kill it first or wait
        under their own).  Its pipes are closed then: read what it wrote before."""
        if self._popen.poll() is None:
            await self._exit()
        code = self._popen.wait()  # reaped by now
        for transport in [*self._outputs, *([] if self._stdin is None else [self._stdin])]:
            transport.close()
        return code

    async def _exit(self) -> None:
        """Until the child exits; it stays a zombie, its pid ours, until reaped."""
        try:
            fd = os.pidfd_open(self._popen.pid)
        except OSError:  # a kernel without pidfds
            await asyncio.to_thread(self._popen.wait)
            return
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(fd, readable)
        try:
            if self._popen.poll() is None:
                await exited
        finally:
            loop.remove_reader(fd)
            os.close(fd)


def _start(
    argv: Sequence[str],
    env: Mapping[str, str] | None,
    cwd: str | os.PathLike[str] | None,
    stdin: bool,
    stdout: bool,
    stderr: int | None,
) -> subprocess.Popen[bytes]:
    """Returns once the child has exec'd (vfork where the platform has it): the loop waits no
    longer than a fork and an exec."""
    return subprocess.Popen(
        list(argv),
        stdin=PIPE if stdin else None,
        stdout=PIPE if stdout else None,
        stderr=stderr,
        env=None if env is None else dict(env),
        cwd=cwd,
    )


async def _reader(pipe: object) -> tuple[asyncio.ReadTransport, asyncio.StreamReader]:
    reader = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), pipe
    )
    return transport, reader


async def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdin: bool = False,
    stdout: bool = False,
    stderr: int | None = None,
) -> Child:
    """Start `argv` with `stdin` / `stdout` piped when asked; `stderr` is a file descriptor,
    `PIPE`, or None (this process's).

    :raises OSError: the program cannot be started.
    """
    popen = _start(argv, env, cwd, stdin, stdout, stderr)
    try:
        writer: asyncio.WriteTransport | None = None
        if popen.stdin is not None:
            writer, _ = await asyncio.get_running_loop().connect_write_pipe(asyncio.Protocol, popen.stdin)
        out = None if popen.stdout is None else await _reader(popen.stdout)
        err = None if popen.stderr is None else await _reader(popen.stderr)
    except BaseException:
        popen.kill()
        popen.wait()
        raise
    return Child(popen, writer, out, err)


class Collected:
    """A child process of synchronous code; a thread collects its output (stdout and stderr, one
    stream of lines): `output` so far, `wait_for` a line, `stop`."""

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
        """:raises OSError: the program cannot be started."""
        self.popen = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.pid = self.popen.pid
        self.output: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.output.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str] | None:
        """The next line matching `pattern`; None when the process's output ended, or `timeout`
        seconds passed, without one.  Never raises."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                self._lines.put(None)  # a later wait sees the end too
                return None
            if match := re.search(pattern, line):
                return match
        return None

    def stop(self, timeout: float) -> str:
        """SIGTERM (SIGKILL when it has not ended `timeout` seconds later); everything it wrote.
        Never raises."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)
        self._reader.join(timeout)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        return "".join(self.output)
