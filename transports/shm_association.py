"""A shared-memory endpoint's association with one peer: its files and mappings, and the fenced copy.

Why a module of its own: what an endpoint holds of a peer (its owner file, fence lock and
generation counter, opened once through the peer's directory, its own generation counter for the
peer, and the peer's segments mapped here) is opened together (`open_association`), released
together (`PeerAssociation.release`), and is all an op needs to copy into or out of the peer's
memory safely (`PeerAssociation.fenced_copy`): the peer process must live (its owner lock is
held), its fence lock is taken shared around the copy, and the generation it had for this
endpoint when the association began must still be current.  The endpoint's queue, threads and
notification socket (`kvflow.transports.shm`) only decide when that copy runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvflow.errors import TransportError
from kvflow.layout import Region
from kvflow.transports.base import region_address
from kvflow.transports.shm_files import (
    PeerSegment,
    flock_within,
    map_received,
    open_directory,
    open_regular,
    peer_directory,
    read_generation,
)
from kvflow.transports.shm_peer import PeerMetadata, SegmentEntry, receive_segments

__all__ = ("PeerAssociation", "open_association")


@dataclass(eq=False)
class PeerAssociation:
    name: str
    notify: str
    pid: int
    owner_fd: int  # the peer's owner file: locked while the peer process lives
    lock_fd: int  # the peer's fence lock, open for the association's life
    gen_fd: int  # the peer's generation counter for *us*, likewise
    generation: int
    segments: list[tuple[int, int, PeerSegment]]  # (peer's base address, size, our mapping)
    regions: list[Region]
    fence_fd: int = -1  # *our* generation counter for the peer, to fence it on removal
    removed: bool = False
    copying: int = 0  # copies into or out of its mappings in progress

    def translate(self, index: int, offset: int, length: int) -> int:
        """The address in this process of `length` bytes at `offset` of the peer's region `index`.

        :raises TransportError: the range is not in a region of the peer, or not in its shared
            memory."""
        remote = region_address(self.regions, index, offset, length, f"peer {self.name!r}")
        for base, size, segment in self.segments:
            if base <= remote and remote + length <= base + size:
                return segment.base + (remote - base)
        raise TransportError(f"peer {self.name!r} range {remote:#x}+{length} is outside its shared memory")

    def fenced_copy(self, copies: list[tuple[int, int, int]], fence_timeout: float) -> None:
        """Copy each (destination, source, length) in this process's addresses, with the peer's
        fence lock held shared, unless the peer process ended or has fenced this endpoint.

        :raises TransportError: the peer is gone, held its fence lock past `fence_timeout`, or
            has fenced this endpoint; nothing was copied.
        :raises OSError: a lock or the generation could not be read.
        """
        try:
            fcntl.flock(self.owner_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # its owner holds it: the peer process lives
        else:
            fcntl.flock(self.owner_fd, fcntl.LOCK_UN)
            raise TransportError(f"peer {self.name!r} is gone (its process ended)")
        if not flock_within(self.lock_fd, fcntl.LOCK_SH, fence_timeout):
            raise TransportError(f"peer {self.name!r} held its fence lock past the fence timeout")
        try:
            if read_generation(self.gen_fd) != self.generation:
                raise TransportError(f"peer {self.name!r} has fenced this endpoint")
            for dst, src, length in copies:
                ctypes.memmove(dst, src, length)
        finally:
            fcntl.flock(self.lock_fd, fcntl.LOCK_UN)

    def release(self) -> None:
        """Unmap the peer's segments and close its files (nothing may copy into them any more)."""
        _release(self.segments, [self.owner_fd, self.lock_fd, self.gen_fd, self.fence_fd])


def open_association(
    name: str,
    meta: PeerMetadata,
    regions: Sequence[Region],
    *,
    initiator: str,
    fence_path: Path,
    attach_timeout: float,
) -> PeerAssociation:
    """Open peer `name`'s owner file, fence lock and generation counter for `initiator` (this
    endpoint) through its directory, and `fence_path` (this endpoint's generation counter for the
    peer); then map the segments `meta` advertises, as the peer hands them over within
    `attach_timeout`.  On failure everything opened or mapped is released.

    :raises TransportError: the peer's files are not regular files of this user or cannot be
        opened, it did not hand over sealed segments in time, or one of `regions` is outside its
        shared memory.
    """
    directory = peer_directory(meta.id, name)
    mapped: list[tuple[int, int, PeerSegment]] = []
    fds: list[int] = []

    def take(entry: SegmentEntry, fd: int) -> None:
        mapped.append((entry.base, entry.size, map_received(fd, entry.name, entry.size)))

    try:
        try:
            folder = open_directory(directory)  # its files are opened through it: no link swapped in
            try:
                for file, flags in (("owner", os.O_RDONLY), ("lock", os.O_RDONLY),
                                    (f"gen-{initiator}", os.O_RDWR | os.O_CREAT)):  # fmt: skip
                    fds.append(open_regular(directory / file, flags, directory=folder))
            finally:
                os.close(folder)
            fds.append(open_regular(fence_path, os.O_RDWR | os.O_CREAT))
            generation = read_generation(fds[2])
            receive_segments(meta, attach_timeout, take)
        except (OSError, TransportError) as exc:  # gone, not ours to open, or not what it should be
            raise TransportError(f"cannot attach to peer {name!r}: {exc}") from exc
        for region in regions:
            if not any(b <= region.base and region.base + region.length <= b + n for b, n, _ in mapped):
                raise TransportError(f"peer {name!r} advertises a region outside its shared memory")
    except BaseException:
        _release(mapped, fds)
        raise
    owner, lock, gen, fence = fds
    return PeerAssociation(
        name, meta.notify, meta.pid, owner, lock, gen, generation, mapped, list(regions), fence_fd=fence
    )


def _release(segments: list[tuple[int, int, PeerSegment]], fds: list[int]) -> None:
    """Unmap a peer's segments and close its files (nothing may copy into them any more)."""
    for _, _, segment in segments:
        segment.close()
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
