"""Shared-memory transport: one-sided WRITEs and READs between processes on one host.

Why: engines in different processes need a data plane that moves real bytes without NIXL, for
tests and for single-host deployments.  KV buffers live in shared memory: sealed memfds that
both processes map, handed to a peer over the notification socket (`kvflow.transports.shm_peer`
says why, and what a peer's metadata may advertise; `kvflow.transports.shm_files` which files
under /dev/shm record who owns an endpoint, and how a dead owner's are reclaimed).  The
initiator copies straight into (or out of) the peer's mapping on a worker thread, as an RDMA NIC
would; a WRITE's notification then goes to the peer's Unix datagram socket, after the bytes.

Fencing, as the transport contract requires: each endpoint has a lock file and, per peer, a
generation counter.  An op takes the *target's* lock shared and checks that the generation it
saw when the association began is still current; `remove_peer` takes the lock exclusively and
bumps the generation.  Once it returns, an op of the removed peer either finished before or is
refused: nothing of it lands.  The lock is released by the kernel if a process dies.  The lock
and generation files of a peer are opened once, in `add_peer`, so an op opens no file
(`kvflow.transports.shm_association` holds them with the peer's mappings, and makes the op's
side of the fence).

A peer's mappings stay alive while a copy into or out of them runs: `remove_peer` marks the
peer removed, waits for the copy in progress to it, and only then unmaps.  An op to a peer whose
process ended (its owner lock is free) fails instead of writing into memory nobody reads.

Who may talk to whom: segments are handed only to processes of this user that ask, and the
files under /dev/shm are 0600 files of this user, opened only if they are regular files (never
blocking on a FIFO a process of the user left there).  The notification socket is an abstract
Unix socket, which any local process can reach, so each datagram is checked against the
credentials the kernel attaches to it (``SO_PASSCRED``): it must come from the pid the peer
announced in its metadata (exchanged in the authenticated handshake) and from this process's
uid.  Anything else is dropped and counted in `rejected_notifications`.  Both processes must see
the same pid namespace; root, which may forge credentials, is not defended against.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import socket
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import numpy.typing as npt

from kvflow.errors import ConfigError, TransportError
from kvflow.layout import DescriptorPlan, MemoryType, Region
from kvflow.protocol.actions import OpKind
from kvflow.protocol.messages import engine_id_problem, require_engine_id
from kvflow.transports.base import Completion, Notification, TransportCapabilities, drain, region_address
from kvflow.transports.shm_association import PeerAssociation, open_association
from kvflow.transports.shm_files import (
    SHM_DIR,
    EndpointFiles,
    Segment,
    bump_generation,
    create_segment,
    flock_within,
    open_regular,
)
from kvflow.transports.shm_peer import (
    DEFAULT_MAX_SEGMENTS,
    PREFIX_CHARACTERS,
    UCRED,
    MappingBudget,
    answer_request,
    check_metadata,
    host_memory,
    mapping_budget,
    notify_address,
    prefix_ok,
)

__all__ = ("DEFAULT_MAX_SEGMENTS", "PREFIX_CHARACTERS", "SHM_DIR", "ShmTransport", "prefix_ok")


@dataclass(eq=False)
class _Op:
    op_id: int
    kind: OpKind
    peer: PeerAssociation
    copies: list[tuple[int, int, int]]  # (destination, source, length) in this process's addresses
    notification: bytes
    cancelled: bool = False


class ShmTransport:
    """Endpoint `name` of the shared-memory transport.  Allocate KV buffers with `allocate`.

    `prefix` names this endpoint's files (default: a random one); a process restarted with the
    same prefix and name takes over the files its dead predecessor left.  `fence_timeout` bounds
    how long `remove_peer` waits for a peer's op into this endpoint to finish (and an op for the
    peer's fence lock, which a hostile peer could hold for ever), `attach_timeout` how long
    `add_peer` waits for the peer to hand over its segments.  A peer advertising more than
    `max_peer_segments` segments or `max_peer_bytes` bytes in all (default: the host's memory)
    is refused, and so is one whose segments would take the peers' mappings together past
    `max_mapped_segments` (default: a quarter of the kernel's ``vm.max_map_count``, at least
    `max_peer_segments`): a bound per peer alone let many names map without end.
    """

    def __init__(
        self,
        name: str,
        *,
        prefix: str | None = None,
        fence_timeout: float = 5.0,
        attach_timeout: float = 10.0,
        max_peer_segments: int = DEFAULT_MAX_SEGMENTS,
        max_peer_bytes: int | None = None,
        max_mapped_segments: int | None = None,
    ) -> None:
        """:raises ConfigError: `name` is not a valid engine id, `prefix` is not "kvflow" and
            plain characters (`prefix_ok`: both become part of file names), or a bound is not a
            positive number.
        :raises TransportError: a live endpoint has this prefix and name, or /dev/shm refuses.
        """
        self.name = require_engine_id(name)
        self._id = prefix or f"kvflow-{uuid.uuid4().hex[:12]}"
        if not prefix_ok(self._id):
            raise ConfigError(f"shared-memory prefix {self._id!r} must be 'kvflow' and up to 64 of {PREFIX_CHARACTERS}")
        self._fence_timeout = fence_timeout
        self._attach_timeout = attach_timeout
        self._max_segments = max_peer_segments
        self._max_bytes = host_memory() if max_peer_bytes is None else max_peer_bytes
        mapped = mapping_budget(max_peer_segments) if max_mapped_segments is None else max_mapped_segments
        self.mappings = MappingBudget(mapped)  # the peers' segments mapped, or being mapped, now
        for what, value in (("attach_timeout", attach_timeout), ("max_peer_segments", max_peer_segments),
                            ("max_peer_bytes", self._max_bytes),
                            ("max_mapped_segments", mapped)):  # fmt: skip
            if not value > 0:
                raise ConfigError(f"shared-memory {what} must be positive, not {value!r}")
        self._files = EndpointFiles(f"{self._id}-{name}")
        self.reclaimed = self._files.reclaimed  # dead endpoints' directories removed on start
        self.rejected_notifications = 0  # datagrams dropped: not from a peer's announced process
        self._segments: list[Segment] = []
        self._regions: list[Region] = []
        self._peers: dict[str, PeerAssociation] = {}
        self._notify_name = notify_address(self._id, name)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._answers = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._answers.setblocking(False)  # answering a peer's request for segments never waits
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self._sock.bind(self._notify_name)
        except OSError as exc:
            self._sock.close()
            self._answers.close()
            self._files.close()
            raise TransportError(f"cannot bind the notification socket of {name!r}: {exc}") from exc
        self._sock.settimeout(0.2)
        self._completions: deque[Completion] = deque()
        self._notifications: deque[Notification] = deque()
        self._listener: Callable[[], None] | None = None
        self._jobs: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._queued: set[_Op] = set()
        self._state = threading.Lock()
        self._copy_done = threading.Condition(self._state)  # a peer's copy count dropped
        self._closed = False
        self._worker = threading.Thread(target=self._work, name=f"kvflow-shm-{name}", daemon=True)
        self._reader = threading.Thread(target=self._read, name=f"kvflow-shm-notify-{name}", daemon=True)
        self._worker.start()
        self._reader.start()

    # ------------------------------------------------------------------ memory

    def allocate(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A zeroed byte array in a new shared segment, to build KV buffers (and regions) on.

        :raises TransportError: `nbytes` is not a positive integer, or the segment cannot be
            created.
        """
        if type(nbytes) is not int or nbytes <= 0:
            raise TransportError(f"a shared segment needs a positive number of bytes, not {nbytes!r}")
        try:
            segment = create_segment(f"{self._id}-{self.name}-seg-{len(self._segments)}", nbytes)
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

    def deregister_regions(self) -> None:
        """The segments stay this endpoint's (a peer asking for them again is served): only the
        regions ops may name go."""
        self._regions = []

    def local_metadata(self) -> bytes:
        segments = [[f"seg-{i}", s.base, s.size] for i, s in enumerate(list(self._segments))]
        meta = {"name": self.name, "notify": self._notify_name, "id": self._id, "pid": os.getpid()}
        payload: bytes = msgpack.packb({**meta, "segments": segments}, use_bin_type=True)
        return payload

    # ------------------------------------------------------------------ peers

    def add_peer(self, name: str, metadata: bytes, regions: Sequence[Region]) -> None:
        """:raises TransportError: the peer's name or metadata is not acceptable (more segments
        or bytes than the bounds, a notification address not its own: `shm_peer.check_metadata`),
        its segments would take the peers' past `max_mapped_segments`, its fence files are not
        regular files of this user or cannot be opened, or it did not hand over sealed segments
        within `attach_timeout`."""
        problem = engine_id_problem(name)
        if problem is not None:  # the name becomes part of the peer's lock and generation paths
            raise TransportError(f"cannot attach to peer {name!r}: its name {problem}")
        meta = check_metadata(name, metadata, self._max_segments, self._max_bytes)
        with self._state:
            replaced = self._peers.get(name)
        self.mappings.take(name, len(meta.segments), len(replaced.segments) if replaced is not None else 0)
        try:
            peer = open_association(
                name,
                meta,
                regions,
                initiator=self.name,
                fence_path=self._files.generation_path(name),
                attach_timeout=self._attach_timeout,
            )
        except BaseException:
            self.mappings.give(len(meta.segments))
            raise
        with self._state:
            if self._closed:
                peer.release()
                self.mappings.give(len(peer.segments))
                raise TransportError(f"cannot attach to peer {name!r}: the transport is closed")
            old = self._peers.pop(name, None)
            self._peers[name] = peer
            if old is not None:
                self._retire(old)  # ops of the old association used its mappings' addresses
        if old is not None:
            old.release()
            self.mappings.give(len(old.segments))

    def remove_peer(self, name: str) -> None:
        """Fence `name` both ways, then unmap its memory; waits for this endpoint's copy to it in
        progress (one op's copy) and for the peer's op into this endpoint's memory in progress (up
        to `fence_timeout`).

        :raises TransportError: the peer's op into this memory did not finish within
            `fence_timeout`, or the fence could not be written.
        """
        with self._state:
            if self._closed:
                return  # every peer is gone with the files
            peer = self._peers.pop(name, None)
            if peer is not None:
                self._retire(peer)
        try:
            self._fence(name, peer)  # none of the peer's ops lands here any more
        finally:
            if peer is not None:
                peer.release()
                self.mappings.give(len(peer.segments))

    # ------------------------------------------------------------------ ops

    def submit(self, op_id: int, kind: OpKind, peer: str, plan: DescriptorPlan, notification: bytes) -> None:
        with self._state:
            target = self._peers.get(peer)
            if self._closed or target is None:
                raise TransportError(f"op {op_id}: peer {peer!r} is not connected")
            copies = []
            for d in plan:
                local = region_address(self._regions, d.local_region, d.local_offset, d.length, "local")
                remote = target.translate(d.remote_region, d.remote_offset, d.length)
                copies.append((remote, local, d.length) if kind is OpKind.WRITE else (local, remote, d.length))
            op = _Op(op_id, kind, target, copies, notification)
            self._queued.add(op)
        self._jobs.put(op)

    def poll(self) -> tuple[list[Completion], list[Notification]]:
        return drain(self._completions), drain(self._notifications)

    def send_notification(self, peer: str, payload: bytes) -> None:
        target = self._peers.get(peer)
        if target is None:
            raise TransportError(f"cannot notify {peer!r}: not connected")
        self._notify(target, payload)

    def expect_traffic(self, active: bool) -> None:
        return None  # completions and notifications wake the listener when they happen

    def set_listener(self, callback: Callable[[], None] | None) -> None:
        self._listener = callback

    def close(self) -> None:
        with self._state:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
            for peer in peers:
                self._retire(peer)
        self._jobs.put(None)
        self._worker.join(timeout=5)
        self._reader.join(timeout=5)
        self._sock.close()
        self._answers.close()
        for peer in peers:
            peer.release()
            self.mappings.give(len(peer.segments))
        for segment in self._segments:  # its views stay mapped; nobody can ask for it any more
            fd, segment.fd = segment.fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)
        self._files.close()

    # ------------------------------------------------------------------ threads

    def _work(self) -> None:
        while (op := self._jobs.get()) is not None:
            with self._state:
                self._queued.discard(op)
                error = None if not (op.cancelled or op.peer.removed) else f"peer {op.peer.name!r} removed"
                if error is None:
                    op.peer.copying += 1  # its mappings stay until the copy is done
            if error is None:
                try:
                    op.peer.fenced_copy(op.copies, self._fence_timeout)
                except (OSError, TransportError) as exc:
                    error = str(exc)
                finally:
                    with self._state:
                        op.peer.copying -= 1
                        self._copy_done.notify_all()
            self._completions.append(Completion(op.op_id, error))
            self._signal()
            if error is None and op.kind is OpKind.WRITE and op.notification:
                # if the peer went away after the bytes landed, its loss is seen elsewhere
                with contextlib.suppress(TransportError):
                    self._notify(op.peer, op.notification)

    def _read(self) -> None:
        space = socket.CMSG_SPACE(UCRED.size)
        uid = os.getuid()
        while not self._closed:
            try:
                data, ancillary, _, address = self._sock.recvmsg(65536, space)
            except TimeoutError:
                continue
            except OSError:
                return
            pid = next(
                (
                    UCRED.unpack(payload[: UCRED.size])
                    for level, kind, payload in ancillary
                    if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= UCRED.size
                ),
                (0, -1, -1),
            )
            try:
                message = msgpack.unpackb(data, raw=False, max_ext_len=0)
            except Exception:  # whatever msgpack raises: not one of ours
                message = None
            if isinstance(message, dict) and pid[1] == uid:  # a process of this user asks for segments
                answer_request(self._answers, address, message, self._segments)
                continue
            sender, payload = message if isinstance(message, list) and len(message) == 2 else (None, None)
            with self._state:  # atomic with remove_peer: nothing of a removed peer is queued after it
                peer = self._peers.get(sender) if isinstance(sender, str) else None
                genuine = False
                if peer is not None and isinstance(payload, bytes) and pid[:2] == (peer.pid, uid):
                    self._notifications.append(Notification(peer.name, payload))
                    genuine = True
                else:
                    self.rejected_notifications += 1
            if genuine:
                self._signal()

    # ------------------------------------------------------------------ helpers

    def _retire(self, peer: PeerAssociation) -> None:
        """With `_state` held: no op to `peer` starts any more, and the copy in progress ends."""
        peer.removed = True
        for op in self._queued:
            if op.peer is peer:
                op.cancelled = True
        while peer.copying:
            self._copy_done.wait()

    def _fence(self, name: str, peer: PeerAssociation | None) -> None:
        # a peer's copy into this memory may be running: it ends, or the peer dies
        if not flock_within(self._files.lock_fd, fcntl.LOCK_EX, self._fence_timeout):
            raise TransportError(f"peer {name!r} kept an op into this memory past the fence timeout")
        try:
            if peer is not None:
                bump_generation(peer.fence_fd)
            else:
                fd = open_regular(self._files.generation_path(name), os.O_RDWR | os.O_CREAT)
                try:
                    bump_generation(fd)
                finally:
                    os.close(fd)
        except (OSError, TransportError) as exc:
            raise TransportError(f"cannot fence {name!r}: {exc}") from exc
        finally:
            fcntl.flock(self._files.lock_fd, fcntl.LOCK_UN)

    def _notify(self, peer: PeerAssociation, payload: bytes) -> None:
        try:
            self._sock.sendto(msgpack.packb([self.name, payload], use_bin_type=True), peer.notify)
        except OSError as exc:
            raise TransportError(f"cannot notify {peer.name!r}: {exc.strerror}") from exc

    def _signal(self) -> None:
        listener = self._listener
        if listener is not None:
            listener()
