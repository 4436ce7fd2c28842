"""The files of a shared-memory endpoint under /dev/shm: who owns them, and reclaiming the dead's.

Why a module of its own: files under /dev/shm outlive a process killed with SIGKILL, so every
endpoint must leave a record of its owner that survives it and that another process can test.
Each endpoint keeps everything in one directory, ``/dev/shm/<prefix>-<name>.kvflow/``:

* ``owner``: held locked (``flock`` exclusive) by the owning process for its whole life; the
  kernel drops the lock when the process dies, so "the lock can be taken" means "the owner is
  dead" (a child forked without exec inherits the lock and keeps the directory alive with it);
* ``lock``: the fence lock peers take shared around each op, and the owner exclusively to fence;
* ``gen-<initiator>``: the owner's fence generation for each initiator, 8 bytes.

The KV segments are not files there but sealed memfds (`create_segment`, `map_received`): a
file under /dev/shm can be shrunk by its owner or any process of the user, and the next copy
into a mapping of the vanished pages kills the process that mapped it with SIGBUS.  A memfd
sealed with ``F_SEAL_SHRINK`` cannot shrink, and it vanishes with the last process that holds
or maps it, so a killed endpoint leaves no KV memory behind for reclaim to find.

A peer's segment is mapped with the C library's ``mmap`` (`PeerSegment`), not Python's: an
``mmap.mmap`` keeps a duplicate of the descriptor it mapped for its whole life, so each segment a
peer advertised cost a descriptor as well as a mapping (4 names x 1,000 segments: 4,085
descriptors held).  The kernel's mapping holds the memfd by itself; its descriptor is closed once
mapped, and the endpoint needs only the address.

Creating a directory and reclaiming dead ones happen under one lock file per user,
``/dev/shm/kvflow-<uid>.reclaim`` (never removed: it is what makes the two exclusive), so a
directory is never seen half made: one with no ``owner`` file was left by a creator that died.
Every start reclaims the directories of this user whose owner is dead; `close` removes its own.

Any process of the user can put anything in /dev/shm, so every file here is opened with
`open_regular`: never following a link, never blocking (opening a FIFO for reading waits for a
writer forever), and refused unless it is a regular file of this user.  A directory whose
``owner`` is something else was not made by an endpoint: reclaim removes it, saying so.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import shutil
import stat
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvflow.errors import TransportError

__all__ = (
    "MAP_FIXED",
    "SHM_DIR",
    "SUFFIX",
    "EndpointFiles",
    "PeerSegment",
    "Segment",
    "bump_generation",
    "can_map",
    "create_segment",
    "flock_within",
    "map_received",
    "open_directory",
    "open_regular",
    "peer_directory",
    "read_generation",
    "segment_name_ok",
)

SHM_DIR = Path("/dev/shm")
SUFFIX = ".kvflow"
_SEGMENT = re.compile(r"seg-(0|[1-9][0-9]{0,5})")  # one name per index
_GENERATION = struct.Struct("<Q")
_NEVER_BLOCK = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

log = logging.getLogger("kvflow.shm")


@dataclass(eq=False)
class Segment:
    name: str
    size: int
    mapping: mmap.mmap
    view: npt.NDArray[np.uint8]
    fd: int = -1  # an endpoint's own segment: the sealed memfd, to hand to its peers

    @property
    def base(self) -> int:
        return int(self.view.ctypes.data)

    def close(self) -> None:
        del self.view
        self.mapping.close()
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
if _libc is not None:
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    _libc.munmap.restype = ctypes.c_int
    _libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value
MAP_FIXED = 0x10  # Linux's; Python's mmap module does not name it


def can_map() -> bool:
    """Whether `map_shared` works here (Linux's C library)."""
    return _libc is not None


def map_shared(fd: int, size: int, *, offset: int = 0, at: int | None = None, flags: int = 0) -> int:
    """Map `size` bytes of file `fd` from `offset`, shared, readable and writable, with the C
    library's ``mmap``, which keeps no descriptor (Python's ``mmap.mmap`` keeps a duplicate);
    at address `at` exactly (``MAP_FIXED``, replacing what was there) if given; `flags` are
    added (``MAP_POPULATE``).  The address; `unmap` undoes it.

    :raises OSError: the kernel refused it, or placed it elsewhere than `at`; or no C library
        mapping here (`can_map`)."""
    if _libc is None:
        raise OSError(errno.ENOSYS, "mapping files needs Linux's C library")
    flags |= mmap.MAP_SHARED | (MAP_FIXED if at is not None else 0)
    base = _libc.mmap(at, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, offset)
    if base is None or base == _MAP_FAILED or (at is not None and base != at):
        code = ctypes.get_errno()
        where = f" over {at:#x}" if at is not None else ""
        raise OSError(code, f"mmap{where}: {os.strerror(code)}")
    return int(base)


def unmap(base: int, size: int) -> None:
    """Undo `map_shared`.  Never raises."""
    if _libc is not None:
        _libc.munmap(base, size)


@dataclass(eq=False)
class PeerSegment:
    """A peer's segment mapped here: its address and size, and no descriptor (see the module)."""

    name: str
    size: int
    base: int

    def close(self) -> None:
        """Unmap it (again: nothing); nothing may copy into it any more.  Never raises."""
        if self.base:
            unmap(self.base, self.size)
            self.base = 0


def segment_name_ok(name: object) -> bool:
    """Whether a peer's segment name is one an endpoint gives its segments ("seg-<index>")."""
    return isinstance(name, str) and _SEGMENT.fullmatch(name) is not None


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISLNK, "a symbolic link"))  # fmt: skip
    return next((what for test, what in kinds if test(mode)), "a device" if not stat.S_ISREG(mode) else "a file")


def open_regular(path: Path, flags: int, *, directory: int | None = None) -> int:
    """Open `path` with `flags` (and mode 0600 if it is created), only if it is a regular file of
    this user: a symbolic link is not followed, and nothing (a FIFO) can make the open block.
    With `directory` (a descriptor from `open_directory`), `path` is its entry `path.name`.

    :raises TransportError: `path` is a symbolic link, or not a regular file of this user (the
        message names it and what it is).
    :raises OSError: it cannot be opened (it does not exist, say).
    """
    fd = _open(path, path if directory is None else path.name, flags, directory)
    return _open_checked(path, fd, stat.S_ISREG)


def open_directory(path: Path) -> int:
    """A descriptor of the directory `path`, only if it is one of this user and not a symbolic
    link, for `open_regular` to open its files through (a link swapped in later is not followed).

    :raises TransportError: `path` is a symbolic link, or not a directory of this user.
    :raises OSError: it cannot be opened (it does not exist, say).
    """
    try:
        fd = _open(path, path, os.O_RDONLY | os.O_DIRECTORY, None)
    except NotADirectoryError:
        raise TransportError(f"{path} is {_kind(path.lstat().st_mode)}, not a directory of this user") from None
    return _open_checked(path, fd, stat.S_ISDIR)


def _open(path: Path, name: Path | str, flags: int, directory: int | None) -> int:
    try:
        return os.open(name, flags | _NEVER_BLOCK, 0o600, dir_fd=directory)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TransportError(f"{path} is a symbolic link, not what an endpoint makes") from None
        raise


def _open_checked(path: Path, opened: int, kind: Callable[[int], bool]) -> int:
    """`opened`, the descriptor of `path`, if it is of `kind` and this user's; else closed."""
    try:
        info = os.fstat(opened)
        what = "a regular file" if kind is stat.S_ISREG else "a directory"
        if not kind(info.st_mode):
            raise TransportError(f"{path} is {_kind(info.st_mode)}, not {what} of this user")
        if info.st_uid != os.getuid():
            raise TransportError(f"{path} belongs to user {info.st_uid}, not {what} of this user")
    except BaseException:
        os.close(opened)
        raise
    return opened


def create_segment(name: str, size: int) -> Segment:
    """A new segment of `size` bytes: a memfd `name` (as /proc shows it) sealed against shrinking
    and growing, mapped.

    :raises OSError: the kernel refuses the memfd, its size or the mapping.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        mapping = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return Segment(name, size, mapping, np.frombuffer(mapping, dtype=np.uint8), fd)


def map_received(fd: int, name: str, size: int) -> PeerSegment:
    """Map `size` bytes of the peer's segment `name`, the descriptor `fd` it handed over (left
    open: the mapping does not need it), once it is known not to shrink under the mapping.

    :raises TransportError: `fd` is not a regular file of this user, is not sealed against
        shrinking (``F_SEAL_SHRINK``), or is smaller than `size`.
    :raises OSError: it cannot be mapped.
    """
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        raise TransportError(f"segment {name} is {_kind(info.st_mode)}, not a regular file of this user")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # a file that cannot be sealed at all
    if not seals & fcntl.F_SEAL_SHRINK:
        raise TransportError(f"segment {name} is not sealed against shrinking")
    if info.st_size < size:
        raise TransportError(f"segment {name} is smaller than advertised ({info.st_size} < {size} bytes)")
    return PeerSegment(name, size, map_shared(fd, size))


def read_generation(fd: int) -> int:
    """The generation in an open ``gen-`` file (0 while it is empty); no file is opened.

    :raises OSError: the read failed.
    """
    data = os.pread(fd, _GENERATION.size, 0)
    return _GENERATION.unpack(data)[0] if len(data) == _GENERATION.size else 0


def bump_generation(fd: int) -> None:
    """Add one to the generation in an open, writable ``gen-`` file, in place (peers hold it open).

    :raises OSError: the read or the write failed.
    """
    os.pwrite(fd, _GENERATION.pack(read_generation(fd) + 1), 0)


def flock_within(fd: int, operation: int, timeout: float) -> bool:
    """Take the ``flock`` `operation` (shared or exclusive) on `fd`; False if another process
    held a conflicting lock for `timeout` seconds (it may never let go: a stopped or hostile
    process), True once taken.

    :raises OSError: the lock cannot be taken at all.
    """
    deadline, pause = time.monotonic() + timeout, 0.0001
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)  # its holder ends what it does, dies, or the deadline passes
            pause = min(pause * 2, 0.01)


def _user_lock(timeout: float = 10.0) -> int:
    """The user lock, held (its fd); another start or reclaim holds it for a scan of /dev/shm.

    :raises TransportError: something else than a regular file of this user is in its place.
    :raises OSError: it cannot be opened, or was not free within `timeout` (a stopped process
        of this user holds it).
    """
    path = SHM_DIR / f"kvflow-{os.getuid()}.reclaim"
    try:
        fd = open_regular(path, os.O_RDWR | os.O_CREAT)
    except TransportError as exc:
        raise TransportError(f"{exc}; kvflow needs it as the lock of this user's endpoints: remove it") from None
    if not flock_within(fd, fcntl.LOCK_EX, timeout):
        os.close(fd)
        raise TimeoutError(errno.ETIMEDOUT, "another process holds the kvflow user lock")
    return fd


def _reclaim_if_dead(directory: Path) -> bool:
    """Remove `directory` if its owner is dead (its ``owner`` lock is free, or it has none).
    Called with the user lock held."""
    try:
        fd = open_regular(directory / "owner", os.O_RDONLY)
    except FileNotFoundError:
        fd = -1  # its creator died before making it: nobody owns it
    except TransportError as exc:  # an endpoint makes a regular file: this is nobody's
        log.warning("removing %s: its owner file is not an endpoint's (%s)", directory, exc)
        fd = -1
    except OSError:
        return False
    try:
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    return False  # its owner lives
                raise
        shutil.rmtree(directory, ignore_errors=True)
        return True
    finally:
        if fd >= 0:
            os.close(fd)


def _reclaim_all() -> int:
    """Remove every endpoint directory of this user whose owner is dead (the user lock held);
    how many were removed."""
    uid, removed = os.getuid(), 0
    with os.scandir(SHM_DIR) as entries:
        for entry in entries:
            if not entry.name.endswith(SUFFIX):
                continue
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == uid:
                    removed += _reclaim_if_dead(Path(entry.path))
    return removed


class EndpointFiles:
    """The directory of one live endpoint, made (after reclaiming dead ones) and owned for life.

    :raises TransportError: an endpoint of that prefix and name is alive, or /dev/shm refuses.
    """

    def __init__(self, stem: str) -> None:
        self.directory = SHM_DIR / f"{stem}{SUFFIX}"
        self.reclaimed = 0
        try:
            lock = _user_lock()
        except OSError as exc:
            raise TransportError(f"cannot lock {SHM_DIR} to create {self.directory.name}: {exc}") from exc
        try:
            self.reclaimed = _reclaim_all()
            self._make()
        except OSError as exc:
            raise TransportError(f"cannot create {self.directory}: {exc}") from exc
        finally:
            os.close(lock)

    def _make(self) -> None:
        """Make the directory and its owner and lock files (the user lock held)."""
        try:
            self.directory.mkdir(mode=0o700)
        except FileExistsError:
            mode = self.directory.lstat().st_mode
            if not stat.S_ISDIR(mode):
                raise TransportError(
                    f"{self.directory} is {_kind(mode)}, not an endpoint's directory: remove it"
                ) from None
            raise TransportError(f"a live endpoint owns {self.directory}") from None
        fds: list[int] = []
        try:  # the directory is new, but a process of this user may have put something in it
            fds.append(open_regular(self.directory / "owner", os.O_RDWR | os.O_CREAT | os.O_EXCL))
            fcntl.flock(fds[0], fcntl.LOCK_EX)
            os.write(fds[0], f"{os.getpid()}\n".encode())
            fds.append(open_regular(self.directory / "lock", os.O_RDWR | os.O_CREAT | os.O_EXCL))
        except (OSError, TransportError) as exc:
            shutil.rmtree(self.directory, ignore_errors=True)
            for fd in fds:
                os.close(fd)
            raise TransportError(f"cannot create {self.directory}: {exc}") from exc
        self._owner, self.lock_fd = fds

    def generation_path(self, initiator: str) -> Path:
        return self.directory / f"gen-{initiator}"

    def close(self) -> None:
        """Remove the directory, then give up ownership.  Peers keep what they mapped."""
        shutil.rmtree(self.directory, ignore_errors=True)
        for fd in (self.lock_fd, self._owner):
            with contextlib.suppress(OSError):
                os.close(fd)


def peer_directory(peer_id: str, name: str) -> Path:
    return SHM_DIR / f"{peer_id}-{name}{SUFFIX}"
