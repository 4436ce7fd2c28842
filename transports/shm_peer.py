"""Attaching to a shared-memory peer: what its metadata may say.

Why a module of its own: a peer's metadata arrives in an authenticated Hello, but the peer may
be buggy or compromised (it holds the shared secret), so everything it advertises is checked
before anything is opened or mapped (`check_metadata`): at most `DEFAULT_MAX_SEGMENTS` segments
(an endpoint makes one per `allocate`; the test and bench peers one per layer, and no model has
a thousand) and at most the host's memory in all, distinct segment names, address ranges that
fit the address space and do not overlap, and for notifications exactly the abstract address
the peer's endpoint binds, so that nothing sends to another local socket (``/dev/log``) on a
peer's say-so.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

import msgpack

from kvflow.errors import TransportError
from kvflow.transports.shm_files import segment_name_ok

__all__ = (
    "DEFAULT_MAX_SEGMENTS",
    "PREFIX_CHARACTERS",
    "PeerMetadata",
    "SegmentEntry",
    "check_metadata",
    "host_memory",
    "notify_address",
    "prefix_ok",
)

DEFAULT_MAX_SEGMENTS = 1024

PREFIX_CHARACTERS = "letters, digits and . _ -"
_PREFIX = re.compile(r"kvflow[A-Za-z0-9._-]{0,64}", re.ASCII)


def prefix_ok(prefix: object) -> TypeGuard[str]:
    """Whether `prefix` can start this endpoint's (or a peer's) file names: "kvflow" and plain
    characters, so that no path built from it leaves /dev/shm or holds a NUL."""
    return isinstance(prefix, str) and _PREFIX.fullmatch(prefix) is not None


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
