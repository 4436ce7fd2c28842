"""The shared memory and the wake-up behind a host's link to its engine process.

Why apart from `ring`: that module is the protocol, pure; this one makes the system calls it
needs, once, at set-up (a memory file holding both rings, mapped by each side) and per wake-up
(an eventfd per side: the engine process's event loop waits on one, a host that has nothing to
do until its engine says something on the other).  The host creates them and hands their
descriptors to the child it starts; the child attaches to them.

Two rings: ``orders`` carries the host's calls to the engine process, ``answers`` what the
engine process says back (results, released blocks, figures).  The engine process sleeps on its
ring between bursts of work; the host reads its ring on every step and sleeps on it only when a
step has nothing to do but wait for the engine (a decode engine whose requests all wait for
their KV), so the engine process wakes it at most once per such sleep.
"""

from __future__ import annotations

import contextlib
import mmap
import os

from kvflow.errors import ConfigError
from kvflow.runtime.ring import RingReader, RingWriter, ring_bytes

__all__ = ("RING_CAPACITY", "EngineRings", "HostRings")

RING_CAPACITY = 8 << 20  # record bytes per direction; pages are touched only as the ring goes round


class _Shared:
    def __init__(self, memory_fd: int, wake_fd: int, host_wake_fd: int, capacity: int) -> None:
        """:raises ConfigError: the memory file is not the size of two rings of `capacity`."""
        self.memory_fd, self.wake_fd, self.host_wake_fd, self.capacity = memory_fd, wake_fd, host_wake_fd, capacity
        size = ring_bytes(capacity)
        try:
            self._map = mmap.mmap(memory_fd, 2 * size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot map the engine link's rings ({2 * size} bytes): {exc}") from exc
        view = memoryview(self._map)
        self._views = (view[:size], view[size:], view)

    @property
    def fds(self) -> tuple[int, int, int]:
        return self.memory_fd, self.wake_fd, self.host_wake_fd

    def close(self) -> None:
        """Let go of the mapping and the descriptors (each side closes its own).  Never raises."""
        for view in self._views:
            view.release()
        with contextlib.suppress(BufferError, OSError):
            self._map.close()
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)


class HostRings(_Shared):
    """The host's end: it writes orders and reads answers."""

    def __init__(self, capacity: int = RING_CAPACITY) -> None:
        """:raises ConfigError: the memory cannot be made (no memfd on this platform, out of memory)."""
        try:
            memory_fd = os.memfd_create("kvflow-engine-link", os.MFD_CLOEXEC)
            os.ftruncate(memory_fd, 2 * ring_bytes(capacity))
            wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            host_wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except (OSError, AttributeError) as exc:
            raise ConfigError(f"cannot make the engine link's shared rings: {exc}") from exc
        super().__init__(memory_fd, wake_fd, host_wake_fd, capacity)
        self.orders = RingWriter(self._views[0], create=True)
        self.answers = RingReader(self._views[1], create=True)

    def wake(self) -> None:
        """Wake the engine process (one eventfd write).  Never raises."""
        with contextlib.suppress(OSError):  # a counter at its maximum is awake enough; a closed fd: gone
            os.eventfd_write(self.wake_fd, 1)

    def take_wake(self) -> None:
        """Clear this side's wake-up eventfd.  Never raises."""
        with contextlib.suppress(OSError):  # BlockingIOError: nothing was owed
            os.eventfd_read(self.host_wake_fd)


class EngineRings(_Shared):
    """The engine process's end: it reads orders and writes answers."""

    def __init__(self, memory_fd: int, wake_fd: int, host_wake_fd: int, capacity: int) -> None:
        """:raises ConfigError: see `_Shared`; the memory holds no rings of `capacity`."""
        super().__init__(memory_fd, wake_fd, host_wake_fd, capacity)
        self.orders = RingReader(self._views[0])
        self.answers = RingWriter(self._views[1])

    def take_wake(self) -> None:
        """Clear the wake-up eventfd.  Never raises."""
        with contextlib.suppress(OSError):  # BlockingIOError: nothing was owed
            os.eventfd_read(self.wake_fd)

    def wake_host(self) -> None:
        """Wake a host asleep on its ring of answers (one eventfd write).  Never raises."""
        with contextlib.suppress(OSError):  # a counter at its maximum is awake enough; a closed fd: gone
            os.eventfd_write(self.host_wake_fd, 1)
