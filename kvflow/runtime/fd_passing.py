"""File descriptors from the host to its engine process over their Unix socket (``SCM_RIGHTS``).

Why: what an engine process maps is handed over as descriptors (memory files of host memory,
exported GPU chunks).  Those known at start are inherited; GPU memory that vLLM remaps after
start (sleep mode, a weight update) comes back as new descriptors while the engine process runs,
and only a Unix socket carries a descriptor into a running process.  The host sends one small
record with the descriptors attached (`send_fds`); the engine process reads its socket with
``recvmsg`` and keeps what came attached, in order, in an `FdInbox`, whence a call takes them
(`FdInbox.take`).  The descriptors travel before the call that needs them is put in the ring, so
once the call is read they are in the socket at the latest: `take` reads the socket itself
if the loop has not yet.
"""

from __future__ import annotations

import array
import contextlib
import os
import select
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvflow.errors import ConfigError, EngineTimeout, TransportError

__all__ = ("MAX_FDS", "FdInbox", "send_fds")

MAX_FDS = 252  # descriptors in one message (Linux's SCM_MAX_FD is 253)
_FD_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


def send_fds(sock: socket.socket, data: bytes, fds: Sequence[int], timeout: float) -> None:
    """Send `data` (non-empty: a stream carries descriptors on bytes) with `fds` attached, whole,
    within `timeout` seconds, whether `sock` blocks or not.  The caller keeps its descriptors.

    :raises ConfigError: no data, or more than `MAX_FDS` descriptors.
    :raises EngineTimeout: the socket had no room for them in time.
    :raises TransportError: the socket failed (the other end is gone, say).
    """
    if not data or len(fds) > MAX_FDS:
        raise ConfigError(f"descriptors travel on 1.. bytes, at most {MAX_FDS} at once: {len(data)} bytes, {len(fds)}")
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    deadline = time.monotonic() + timeout
    sent = 0
    while sent < len(data):
        left = deadline - time.monotonic()
        if left <= 0:
            raise EngineTimeout(f"{len(fds)} descriptors not sent within {timeout}s")
        _, writable, _ = select.select([], [sock], [], left)
        if not writable:
            continue
        try:
            # the descriptors go with the first bytes only
            sent += sock.sendmsg([data[sent:]], rights if sent == 0 else [])
        except (BlockingIOError, InterruptedError):
            continue
        except OSError as exc:
            raise TransportError(f"cannot send {len(fds)} descriptors: {exc}") from exc


class FdInbox:
    """The descriptors that came attached to what this process read from its socket, in order."""

    def __init__(self) -> None:
        self._fds: deque[int] = deque()
        self.truncated = 0  # messages whose descriptors did not all fit (each a sender's bug)

    def __len__(self) -> int:
        return len(self._fds)

    def read(self, sock: socket.socket, view: memoryview) -> int:
        """One ``recvmsg`` into `view`: the byte count (0: the peer closed); the descriptors
        that came with them join the inbox.

        :raises BlockingIOError: nothing to read (a non-blocking socket).
        :raises OSError: the socket failed.
        """
        count, ancillary, flags, _ = sock.recvmsg_into([view], _FD_SPACE)
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            self.truncated += 1
        return count

    def take(self, count: int, refill: Callable[[], None] | None = None, timeout: float = 1.0) -> list[int]:
        """The `count` oldest descriptors (the caller owns them), once they are here: `refill`
        (reading the socket) is called until they are, for at most `timeout` seconds.

        :raises ConfigError: they did not come (the sender sent fewer): none is taken.
        """
        deadline = time.monotonic() + timeout
        while len(self._fds) < count and refill is not None and time.monotonic() < deadline:
            refill()
            if len(self._fds) < count:
                time.sleep(0.001)
        if len(self._fds) < count:
            raise ConfigError(f"{count} descriptors expected from the host, {len(self._fds)} came")
        return [self._fds.popleft() for _ in range(count)]

    def close(self) -> None:
        """Close what nobody took.  Never raises."""
        while self._fds:
            with contextlib.suppress(OSError):
                os.close(self._fds.popleft())
