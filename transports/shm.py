"""Shared-memory transport: one-sided WRITEs and READs between processes on one host.

Why: engines in different processes need a data plane that moves real bytes without NIXL, for
tests and for single-host deployments.  KV buffers live in POSIX shared memory (files under
/dev/shm that both processes map).  The initiator copies straight into (or out of) the peer's
mapping on a worker thread, as an RDMA NIC would; a WRITE's notification then goes to the
peer's Unix datagram socket, after the bytes.

Fencing, as the transport contract requires: each endpoint has a lock file and, per peer, a
generation counter.  An op takes the *target's* lock shared and checks that the generation it
saw when the association began is still current; `remove_peer` takes the lock exclusively and
bumps the generation.  Once it returns, an op of the removed peer either finished before or is
refused: nothing of it lands.  The lock is released by the kernel if a process dies.

Same host and same user only (files are 0600); notifications are trusted from known peers'
names, which any process of that user could forge: use the ZeroMQ control plane's
authentication for anything that crosses a trust boundary.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import queue
import socket
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np
import numpy.typing as npt

from kvflow.errors import TransportError
from kvflow.layout import DescriptorPlan, MemoryType, Region
from kvflow.protocol.actions import OpKind
from kvflow.protocol.messages import engine_id_problem, require_engine_id
from kvflow.transports.base import Completion, Notification, TransportCapabilities, drain, region_address

__all__ = ("ShmTransport",)

SHM_DIR = Path("/dev/shm")


@dataclass
class _Segment:
    path: Path
    size: int
    mapping: mmap.mmap
    view: npt.NDArray[np.uint8]

    @property
    def base(self) -> int:
        return int(self.view.ctypes.data)

    def close(self) -> None:
        del self.view
        self.mapping.close()


@dataclass
class _Peer:
    name: str
    notify: str
    lock: Path
    gen_file: Path  # the peer's generation counter for *us*
    generation: int
    segments: list[tuple[int, int, _Segment]]  # (peer's base address, size, our mapping)
    regions: list[Region]


@dataclass
class _Op:
    op_id: int
    kind: OpKind
    peer: _Peer
    copies: list[tuple[int, int, int]]  # (destination, source, length) in this process's addresses
    notification: bytes
    cancelled: bool = False


def _map(path: Path, size: int, *, create: bool) -> _Segment:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size < size:
            raise TransportError(f"shared segment {path.name} is smaller than advertised")
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return _Segment(path, size, mapping, np.frombuffer(mapping, dtype=np.uint8))


def _peer_metadata(name: str, metadata: bytes) -> tuple[str, str, list[tuple[str, int, int]]]:
    """Check what `local_metadata` of endpoint `name` produced: (id, notify socket, segments).

    :raises TransportError: anything else (not msgpack, another shape, another endpoint's).
    """

    def refuse(why: str) -> TransportError:
        return TransportError(f"cannot attach to peer {name!r}: {why}")

    try:
        meta = msgpack.unpackb(metadata, raw=False, max_ext_len=0)
    except (ValueError, msgpack.UnpackException) as exc:  # what msgpack raises for bytes it cannot read
        raise refuse(f"metadata is not msgpack ({type(exc).__name__})") from exc
    if not isinstance(meta, dict) or meta.get("name") != name:
        raise refuse("metadata names another endpoint")
    peer_id, notify, segs = meta.get("id"), meta.get("notify"), meta.get("segments")
    if not isinstance(peer_id, str) or "/" in peer_id or not peer_id.startswith("kvflow"):
        raise refuse("metadata names another endpoint")
    if not isinstance(notify, str) or not isinstance(segs, list):
        raise refuse("metadata lacks the notification socket or the segments")
    out = []
    for seg in segs:
        numbers = isinstance(seg, list) and len(seg) == 3 and type(seg[1]) is int and type(seg[2]) is int
        if not numbers or seg[1] < 0 or seg[2] <= 0:
            raise refuse(f"segment {seg!r} is not [name, base, size > 0]")
        seg_name, base, size = seg
        if not isinstance(seg_name, str) or "/" in seg_name or not seg_name.startswith(peer_id):
            raise refuse(f"segment {seg_name!r} is not the peer's")
        out.append((seg_name, base, size))
    return peer_id, notify, out


class ShmTransport:
    """Endpoint `name` of the shared-memory transport.  Allocate KV buffers with `allocate`."""

    def __init__(self, name: str, *, prefix: str | None = None) -> None:
        """:raises ConfigError: `name` is not a valid engine id (it becomes part of file names)."""
        self.name = require_engine_id(name)
        self._id = prefix or f"kvflow-{uuid.uuid4().hex[:12]}"
        self._segments: list[_Segment] = []
        self._regions: list[Region] = []
        self._peers: dict[str, _Peer] = {}
        self._lock_path = SHM_DIR / f"{self._id}-{name}.lock"
        self._lock_path.touch(mode=0o600, exist_ok=False)
        self._gen_dir = SHM_DIR / f"{self._id}-{name}.gen"
        self._gen_dir.mkdir(mode=0o700)
        self._notify_name = f"\0{self._id}-{name}-notify"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self._notify_name)
        self._sock.settimeout(0.2)
        self._completions: deque[Completion] = deque()
        self._notifications: deque[Notification] = deque()
        self._listener: Callable[[], None] | None = None
        self._jobs: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._queued: list[_Op] = []
        self._executing = threading.Lock()  # held while an op moves bytes
        self._state = threading.Lock()
        self._closed = False
        self._worker = threading.Thread(target=self._work, name=f"kvflow-shm-{name}", daemon=True)
        self._reader = threading.Thread(target=self._read, name=f"kvflow-shm-notify-{name}", daemon=True)
        self._worker.start()
        self._reader.start()

    # ------------------------------------------------------------------ memory

    def allocate(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A zeroed byte array in a new shared segment, to build KV buffers (and regions) on.

        :raises TransportError: the segment cannot be created.
        """
        try:
            segment = _map(SHM_DIR / f"{self._id}-{self.name}-{len(self._segments)}", nbytes, create=True)
        except OSError as exc:
            raise TransportError(f"cannot create a shared segment of {nbytes} bytes: {exc.strerror}") from exc
        self._segments.append(segment)
        return segment.view

    @property
    def capabilities(self) -> TransportCapabilities:
        return TransportCapabilities("shm", frozenset({MemoryType.DRAM}))

    def register_regions(self, regions: Sequence[Region]) -> None:
        for region in regions:
            if not any(
                s.base <= region.base and region.base + region.length <= s.base + s.size for s in self._segments
            ):
                raise TransportError(f"region at {region.base:#x} is not in this endpoint's shared memory")
        self._regions.extend(regions)

    def local_metadata(self) -> bytes:
        segments = [[s.path.name, s.base, s.size] for s in self._segments]
        meta = {"name": self.name, "notify": self._notify_name, "id": self._id, "segments": segments}
        payload: bytes = msgpack.packb(meta, use_bin_type=True)
        return payload

    # ------------------------------------------------------------------ peers

    def add_peer(self, name: str, metadata: bytes, regions: Sequence[Region]) -> None:
        """:raises TransportError: the peer's name or metadata is not acceptable, or its memory
        cannot be mapped."""
        problem = engine_id_problem(name)
        if problem is not None:  # the name becomes part of the peer's lock and generation paths
            raise TransportError(f"cannot attach to peer {name!r}: its name {problem}")
        peer_id, notify, segs = _peer_metadata(name, metadata)
        mapped: list[tuple[int, int, _Segment]] = []
        try:
            for seg_name, base, size in segs:
                try:
                    segment = _map(SHM_DIR / seg_name, size, create=False)
                except OSError as exc:  # the segment is gone, or not ours to open
                    raise TransportError(f"cannot attach to peer {name!r}: {exc}") from exc
                mapped.append((base, size, segment))
        except BaseException:
            for _, _, segment in mapped:
                segment.close()
            raise
        for region in regions:
            if not any(b <= region.base and region.base + region.length <= b + n for b, n, _ in mapped):
                raise TransportError(f"peer {name!r} advertises a region outside its shared memory")
        lock = SHM_DIR / f"{peer_id}-{name}.lock"
        gen_file = SHM_DIR / f"{peer_id}-{name}.gen" / self.name
        peer = _Peer(name, notify, lock, gen_file, 0, mapped, list(regions))
        peer.generation = self._read_generation(peer)
        with self._state:
            old = self._peers.pop(name, None)
            self._peers[name] = peer
            for op in self._queued:
                if op.peer is old:
                    op.cancelled = True  # addresses of the old association's mappings
        if old is not None:
            self._detach(old)

    def remove_peer(self, name: str) -> None:
        with self._state:
            peer = self._peers.pop(name, None)
            for op in self._queued:
                if op.peer.name == name:
                    op.cancelled = True
        with self._executing:  # an op of ours to that peer in progress finishes first
            pass
        self._bump_generation(name)  # and none of the peer's ops lands here any more
        if peer is not None:
            self._detach(peer)

    # ------------------------------------------------------------------ ops

    def submit(self, op_id: int, kind: OpKind, peer: str, plan: DescriptorPlan, notification: bytes) -> None:
        with self._state:
            target = self._peers.get(peer)
            if self._closed or target is None:
                raise TransportError(f"op {op_id}: peer {peer!r} is not connected")
            copies = []
            for d in plan:
                local = region_address(self._regions, d.local_region, d.local_offset, d.length, "local")
                remote = self._translate(target, d.remote_region, d.remote_offset, d.length)
                copies.append((remote, local, d.length) if kind is OpKind.WRITE else (local, remote, d.length))
            op = _Op(op_id, kind, target, copies, notification)
            self._queued.append(op)
        self._jobs.put(op)

    def poll(self) -> tuple[list[Completion], list[Notification]]:
        return drain(self._completions), drain(self._notifications)

    def send_notification(self, peer: str, payload: bytes) -> None:
        target = self._peers.get(peer)
        if target is None:
            raise TransportError(f"cannot notify {peer!r}: not connected")
        self._notify(target, payload)

    def set_listener(self, callback: Callable[[], None] | None) -> None:
        self._listener = callback

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join(timeout=5)
        self._reader.join(timeout=5)
        self._sock.close()
        for peer in list(self._peers.values()):
            self._detach(peer)
        self._peers.clear()
        for segment in self._segments:
            segment.path.unlink(missing_ok=True)
        for gen in self._gen_dir.glob("*"):
            gen.unlink(missing_ok=True)
        self._gen_dir.rmdir()
        self._lock_path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ threads

    def _work(self) -> None:
        while (op := self._jobs.get()) is not None:
            with self._state:
                if op in self._queued:
                    self._queued.remove(op)
            error = None if not op.cancelled else f"peer {op.peer.name!r} removed"
            if error is None:
                try:
                    with self._executing:
                        self._execute(op)
                except (OSError, TransportError) as exc:
                    error = str(exc)
            self._completions.append(Completion(op.op_id, error))
            self._signal()
            if error is None and op.kind is OpKind.WRITE and op.notification:
                # if the peer went away after the bytes landed, its loss is seen elsewhere
                with contextlib.suppress(TransportError):
                    self._notify(op.peer, op.notification)

    def _execute(self, op: _Op) -> None:
        with open(op.peer.lock, "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            try:
                if self._read_generation(op.peer) != op.peer.generation:
                    raise TransportError(f"peer {op.peer.name!r} has fenced this endpoint")
                for dst, src, length in op.copies:
                    ctypes.memmove(dst, src, length)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                sender, payload = msgpack.unpackb(data, raw=False, max_ext_len=0)
            except Exception:
                continue  # not one of ours: ignore
            if isinstance(sender, str) and isinstance(payload, bytes) and sender in self._peers:
                self._notifications.append(Notification(sender, payload))
                self._signal()

    # ------------------------------------------------------------------ helpers

    def _notify(self, peer: _Peer, payload: bytes) -> None:
        try:
            self._sock.sendto(msgpack.packb([self.name, payload], use_bin_type=True), peer.notify)
        except OSError as exc:
            raise TransportError(f"cannot notify {peer.name!r}: {exc.strerror}") from exc

    def _read_generation(self, peer: _Peer) -> int:
        try:
            return int(peer.gen_file.read_text() or "0")
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            raise TransportError(f"cannot read the fence of {peer.name!r}: {exc}") from exc

    def _bump_generation(self, initiator: str) -> None:
        path = self._gen_dir / initiator
        with open(self._lock_path, "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                current = int(path.read_text() or "0") if path.exists() else 0
                path.write_text(str(current + 1))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _translate(self, peer: _Peer, index: int, offset: int, length: int) -> int:
        remote = region_address(peer.regions, index, offset, length, f"peer {peer.name!r}")
        for base, size, segment in peer.segments:
            if base <= remote and remote + length <= base + size:
                return segment.base + (remote - base)
        raise TransportError(f"peer {peer.name!r} range {remote:#x}+{length} is outside its shared memory")

    def _detach(self, peer: _Peer) -> None:
        with self._executing:
            for _, _, segment in peer.segments:
                segment.close()

    def _signal(self) -> None:
        listener = self._listener
        if listener is not None:
            listener()
