"""A wake-up one process rings for another: one datagram on a Unix socket in a private directory.

Why: a process may sleep on something kvflow does not own and still need to wake the moment
kvflow has news for it.  vLLM's engine core is the case: while every request it holds waits for
KV, it sleeps in its scheduler's hook (`integrations/vllm/idle_sleep.py`), and the engine that
lands or gives back blocks runs in another process (a rank's engine process) or on a thread of
another process (the worker's).  The ringer knows only a path, agreed from the sleeper's pid
and a name (`bell_path`); a datagram carries no content, so nothing is parsed, and one sent
while nobody listens is dropped (the sleeper bounds every sleep: a bell is an early wake-up,
never the only one).

Where: ``<tmp>/kvflow-bells-<uid>/``, made mode 0700 and refused when another user owns it or
others may write into it, so only this user's processes can ring.  A listener's socket file is
removed when it closes; one left by a dead listener is replaced by the next that binds there.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import tempfile
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

from kvflow.errors import ConfigError

__all__ = ("Bell", "BellListener", "bell_path")

MAX_DRAIN = 64  # datagrams read per wake-up before the listener calls back (the rest: next time)


def bell_directory() -> Path:
    """This user's directory of bells, made if missing.

    :raises ConfigError: it cannot be made, is not a directory, belongs to another user, or
        others may write into it.
    """
    directory = Path(tempfile.gettempdir()) / f"kvflow-bells-{os.getuid()}"
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        info = directory.lstat()
    except OSError as exc:
        raise ConfigError(f"cannot make kvflow's bell directory {directory}: {exc}") from exc
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigError(
            f"kvflow's bell directory {directory} must be a directory of user {os.getuid()} with mode 0700 "
            f"(it is mode {stat.filemode(info.st_mode)}, user {info.st_uid}): remove it"
        )
    return directory


def bell_path(owner_pid: int, name: str) -> str:
    """Where the process `owner_pid` listens for the bell called `name`.

    :raises ConfigError: see `bell_directory`.
    """
    return str(bell_directory() / f"{owner_pid}-{zlib.crc32(name.encode()):08x}")


class Bell:
    """The ringing end: `ring()` sends one empty datagram to `path`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.rung = 0  # datagrams sent
        self.missed = 0  # rings nobody received (no listener, or its queue full)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)

    def ring(self) -> None:
        """Wake the listener, if one listens and has room.  Never raises."""
        try:
            self._sock.sendto(b"", self.path)
            self.rung += 1
        except OSError:  # nobody there, or a full queue: that listener is awake or wakes anyway
            self.missed += 1

    def close(self) -> None:
        """Never raises."""
        self._sock.close()


class BellListener:
    """The listening end: binds `path` and calls `on_ring` (from its own thread) once per burst
    of datagrams, until `close`."""

    def __init__(self, path: str, on_ring: Callable[[], None]) -> None:
        """:raises ConfigError: `path` cannot be bound."""
        self.path = path
        self._on_ring = on_ring
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a dead listener's: a live one in this pid cannot be (one per name)
            self._sock.bind(path)
        except OSError as exc:
            self._sock.close()
            raise ConfigError(f"cannot listen for kvflow's bell at {path}: {exc}") from exc
        self._closed = False
        self._thread = threading.Thread(target=self._listen, name="kvflow-bell", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while True:
            try:
                self._sock.recv(1)
                for _ in range(MAX_DRAIN):  # a burst is one wake-up
                    self._sock.recv(1, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
            except OSError:  # closed
                return
            if self._closed:
                return
            self._on_ring()

    def close(self) -> None:
        """Stop listening and remove the socket file.  Never raises."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # ends the thread's recv
        self._sock.close()
        self._thread.join(timeout=1.0)
