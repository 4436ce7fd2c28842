"""Attaching to a shared-memory peer: what its metadata may say, and getting hold of its segments.

Why a module of its own: a peer's metadata arrives in an authenticated Hello, but the peer may
be buggy or compromised (it holds the shared secret), so everything it advertises is checked
before anything is opened or mapped (`check_metadata`): at most `DEFAULT_MAX_SEGMENTS` segments
(an endpoint makes one per `allocate`; the test and bench peers one per layer, and no model has
a thousand) and at most the host's memory in all, distinct segment names, address ranges that
fit the address space and do not overlap, and for notifications exactly the abstract address
the peer's endpoint binds, so that nothing sends to another local socket (``/dev/log``) on a
peer's say-so.

Why segments are sealed memfds handed over the notification socket: a file that another
process maps can be shrunk by its owner (or by any process of the user, for a file under
/dev/shm), and the next copy into the vanished pages kills the process that mapped it with
SIGBUS, which Python cannot catch.  A memfd sealed with ``F_SEAL_SHRINK`` never shrinks,
whoever holds it; the mapping side checks the seal (``F_GET_SEALS``) before it maps and refuses
the peer without it.  The descriptors travel with ``SCM_RIGHTS`` (`receive_segments` asks the
peer's notification socket, `answer_request` is the peer's side), in requests of at most
`CHUNK`, each answer accepted only with the credentials the kernel attaches (``SO_PASSCRED``) of
the pid the metadata names and of this user, within a deadline.  Opening
``/proc/<pid>/fd/<n>`` instead would also reach a memfd of a dumpable process of this user, but
it depends on the ptrace policy (Yama, a container's ``hidepid``) and names whatever process has
that pid now; the credentials of an answer are the process that sent it.  A memfd vanishes with
the last process holding or mapping it, so a killed engine leaves no KV memory to reclaim.
"""

from __future__ import annotations

import array
import contextlib
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

import msgpack

from kvflow.errors import TransportError
from kvflow.transports.shm_files import Segment, segment_name_ok

__all__ = (
    "CHUNK",
    "DEFAULT_MAX_SEGMENTS",
    "PREFIX_CHARACTERS",
    "PeerMetadata",
    "SegmentEntry",
    "answer_request",
    "check_metadata",
    "MappingBudget",
    "host_memory",
    "mapping_budget",
    "notify_address",
    "prefix_ok",
    "receive_segments",
)

DEFAULT_MAX_SEGMENTS = 1024
CHUNK = 64  # descriptors per answer: well under the kernel's 253 per message
UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_FDS = array.array("i")
_ANSWER_SPACE = socket.CMSG_SPACE(UCRED.size) + socket.CMSG_SPACE(CHUNK * _FDS.itemsize)

PREFIX_CHARACTERS = "letters, digits and . _ -"
_PREFIX = re.compile(r"kvflow[A-Za-z0-9._-]{0,64}", re.ASCII)


def prefix_ok(prefix: object) -> TypeGuard[str]:
    """Whether `prefix` can start this endpoint's (or a peer's) file names: "kvflow" and plain
    characters, so that no path built from it leaves /dev/shm or holds a NUL."""
    return isinstance(prefix, str) and _PREFIX.fullmatch(prefix) is not None


def mapping_budget(per_peer: int, max_map_count: Path = Path("/proc/sys/vm/max_map_count")) -> int:
    """How many peers' segments one endpoint maps in all by default: a quarter of the kernel's
    ``vm.max_map_count`` (the process's own libraries, heaps and buffers need the rest; past it
    every mapping fails, the interpreter's own included), at least `per_peer`.  The kernel's
    default, 65,530, when it cannot be read.  Never raises."""
    try:
        limit = int(max_map_count.read_text())
    except (OSError, ValueError):
        limit = 65530
    return max(per_peer, limit // 4)


class MappingBudget:
    """The peers' segments one endpoint maps, in all, against `limit`; from any thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0  # mapped, or being mapped
        self._lock = threading.Lock()

    def take(self, name: str, count: int, replacing: int = 0) -> None:
        """`count` more for peer `name`, whose association's `replacing` segments are given back
        once the new one is in (so not counted against it).
        :raises TransportError: over the limit; nothing is taken."""
        with self._lock:
            others = self.held - replacing
            if others + count > self.limit:
                raise TransportError(
                    f"cannot attach to peer {name!r}: its {count} segments would take the peers' mappings to "
                    f"{others + count}, over max_mapped_segments {self.limit}"
                )
            self.held += count

    def give(self, count: int) -> None:
        with self._lock:
            self.held -= count


def host_memory() -> int:
    """The host's physical memory in bytes: more than any peer can share with us."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def notify_address(endpoint_id: str, name: str) -> str:
    """The abstract address the notification socket of endpoint `name` of `endpoint_id` binds."""
    return f"\0{endpoint_id}-{name}-notify"


@dataclass(frozen=True)
class SegmentEntry:
    index: int
    name: str
    base: int  # in the peer's address space
    size: int


@dataclass(frozen=True)
class PeerMetadata:
    id: str
    notify: str
    pid: int
    segments: list[SegmentEntry]


def check_metadata(name: str, metadata: bytes, max_segments: int, max_bytes: int) -> PeerMetadata:
    """What `local_metadata` of endpoint `name` produced, checked: its id, notification socket,
    process and segments, at most `max_segments` of them and `max_bytes` in all.

    :raises TransportError: anything else (not msgpack, another shape, another endpoint's, more
        segments or bytes than the bounds, segments that overlap or leave the address space, a
        notification address that is not the peer's own), naming what was wrong.
    """

    def refuse(why: str) -> TransportError:
        return TransportError(f"cannot attach to peer {name!r}: {why}")

    try:
        meta = msgpack.unpackb(metadata, raw=False, max_ext_len=0)
    except (ValueError, msgpack.UnpackException) as exc:  # what msgpack raises for bytes it cannot read
        raise refuse(f"metadata is not msgpack ({type(exc).__name__})") from exc
    if not isinstance(meta, dict) or meta.get("name") != name:
        raise refuse("metadata names another endpoint")
    peer_id, notify, pid, segs = meta.get("id"), meta.get("notify"), meta.get("pid"), meta.get("segments")
    if not prefix_ok(peer_id):  # it becomes part of a path: a NUL or "/" would break out of it
        raise refuse("metadata names another endpoint")
    if not isinstance(notify, str) or not isinstance(segs, list):
        raise refuse("metadata lacks the notification socket or the segments")
    if type(pid) is not int or pid <= 0:
        raise refuse("metadata lacks the process id")
    if len(segs) > max_segments:
        raise refuse(f"metadata advertises {len(segs)} segments, more than the {max_segments} a peer may have")
    if notify != notify_address(peer_id, name):
        raise refuse(f"its notification socket {notify!r} is not the address its endpoint binds")
    out = [_segment(seg, refuse) for seg in segs]
    if len({s.index for s in out}) < len(out):
        raise refuse("metadata names a duplicate segment")
    total = sum(s.size for s in out)
    if total > max_bytes:
        raise refuse(f"metadata advertises {total} bytes of segments, more than the {max_bytes} a peer may map")
    ranges = sorted(out, key=lambda s: s.base)
    for before, after in zip(ranges, ranges[1:], strict=False):
        if before.base + before.size > after.base:
            raise refuse(f"segments {before.name} and {after.name} are overlapping")
    return PeerMetadata(peer_id, notify, pid, out)


def _segment(seg: object, refuse: Callable[[str], TransportError]) -> SegmentEntry:
    if not (isinstance(seg, list) and len(seg) == 3 and type(seg[1]) is int and type(seg[2]) is int):
        raise refuse(f"segment {seg!r} is not [name, base, size > 0]")
    seg_name, base, size = seg
    if base < 0 or size <= 0:
        raise refuse(f"segment {seg!r} is not [name, base, size > 0]")
    if not segment_name_ok(seg_name):
        raise refuse(f"segment {seg_name!r} is not the peer's")
    if base + size > 1 << 64:
        raise refuse(f"segment {seg_name} runs past the address space")
    return SegmentEntry(int(seg_name.removeprefix("seg-")), seg_name, base, size)


def receive_segments(peer: PeerMetadata, timeout: float, take: Callable[[SegmentEntry, int], None]) -> None:
    """Ask `peer`'s endpoint for the descriptors of its segments, `CHUNK` at a time, and hand
    each to `take` with its entry (the descriptor is closed when `take` returns); within `timeout`.

    :raises TransportError: the peer did not answer in time, answered with something else, has
        no such segment, or this process could not receive the descriptors; or what `take`
        raised.
    :raises OSError: the request could not be sent.
    """
    deadline = time.monotonic() + timeout
    uid = os.getuid()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.bind("")  # an abstract address of its own, for the answers
        for start in range(0, len(peer.segments), CHUNK):
            chunk = peer.segments[start : start + CHUNK]
            _settimeout(sock, deadline)
            sock.sendto(msgpack.packb({"segments": [s.index for s in chunk]}), peer.notify)
            fds = _answer(sock, deadline, (peer.pid, uid), [s.index for s in chunk])
            try:
                for entry, fd in zip(chunk, fds, strict=True):
                    take(entry, fd)
            finally:
                _close(fds)


def _settimeout(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportError("the peer did not hand over its segments in time")
    sock.settimeout(left)


def _answer(sock: socket.socket, deadline: float, sender: tuple[int, int], indices: list[int]) -> list[int]:
    """The descriptors of the answer to a request for `indices`, from `sender` (pid, uid)."""
    while True:
        _settimeout(sock, deadline)
        try:
            data, ancillary, flags, _ = sock.recvmsg(4096, _ANSWER_SPACE)
        except TimeoutError:
            raise TransportError("the peer did not hand over its segments in time") from None
        credentials, fds = (0, -1), list[int]()
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", payload[: len(payload) - len(payload) % _FDS.itemsize]))
            elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= UCRED.size:
                credentials = UCRED.unpack(payload[: UCRED.size])[:2]
        if credentials != sender:
            _close(fds)  # not the peer's: anyone of this host may send to this address
            continue
        try:
            answer = msgpack.unpackb(data, raw=False, max_ext_len=0)
        except Exception:  # whatever msgpack raises: the answer is not one
            answer = None
        if flags & socket.MSG_CTRUNC:
            _close(fds)
            raise TransportError("could not receive the peer's segments (out of file descriptors?)")
        if isinstance(answer, dict) and answer.get("segments") == indices and len(fds) == len(indices):
            return fds
        _close(fds)
        if isinstance(answer, dict) and type(answer.get("missing")) is int:
            raise TransportError(f"the peer has no segment seg-{answer['missing']}")
        raise TransportError("the peer answered the request for its segments with something else")


def answer_request(sock: socket.socket, address: object, request: dict[object, object], own: Sequence[Segment]) -> None:
    """Answer a request for segments, from a process of this user at `address`, with the
    descriptors of the segments of `own` it names, on the non-blocking `sock`.  A request for
    more than `CHUNK`, or one that cannot be answered at once, gets no answer (the asker's
    deadline ends it)."""
    indices = request.get("segments")
    if not isinstance(indices, list) or not 0 < len(indices) <= CHUNK or not isinstance(address, bytes | str):
        return
    fds: list[int] = []
    reply: dict[str, object] = {"segments": indices}
    for index in indices:
        if type(index) is not int or not 0 <= index < len(own) or own[index].fd < 0:
            fds, reply = [], {"missing": index if type(index) is int else -1}
            break
        fds.append(own[index].fd)
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    with contextlib.suppress(OSError):  # the asker is gone, or its queue is full: it times out
        sock.sendmsg([msgpack.packb(reply)], rights, 0, address)


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
