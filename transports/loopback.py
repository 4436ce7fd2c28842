"""Loopback transport: real byte copies between endpoints of one process.

With a link model and deterministic fault injection.

Why it exists: tests and simulations need a data plane that behaves like RDMA where it matters
(bytes land later than they are posted, a notification follows its bytes, a dead peer fails
every op, a stalled WRITE can land long after its transfer was abandoned) without NIXL.

Endpoints share a `LoopbackFabric`.  Each op copies with `memmove` between registered regions,
after checking every range against the *registered* memory of both endpoints, so a bad layout
raises `TransportError` instead of corrupting the process.  The fabric runs ops on its own
thread, timed by a `LinkModel`; in manual mode nothing moves until the caller `step`s it, which
makes engine tests deterministic.  `FaultPlan` faults are drawn from a seeded generator in op
order, so a seed reproduces a run.
"""

from __future__ import annotations

import ctypes
import heapq
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvflow.errors import ConfigError, TransportError
from kvflow.layout import DescriptorPlan, MemoryType, Region
from kvflow.protocol.actions import OpKind
from kvflow.transports.base import Completion, Notification, TransportCapabilities, drain, region_address

__all__ = ("FaultPlan", "LinkModel", "LoopbackFabric", "LoopbackTransport")


@dataclass(frozen=True, slots=True)
class LinkModel:
    """Per op: `latency` seconds plus size / `bandwidth` (bytes per second; 0: unlimited).
    Ops between the same two endpoints are serialised, as on one link."""

    latency: float = 0.0
    bandwidth: float = 0.0

    def transfer_time(self, nbytes: int) -> float:
        return nbytes / self.bandwidth if self.bandwidth > 0 else 0.0


@dataclass(slots=True)
class FaultPlan:
    """Faults, decided per op in submission order from `seed`.

    `fail_ops` / `stall_ops` are 1-based op numbers on the fabric.  A failed op lands the first
    half of its descriptors (a torn write) and reports an error.  A stalled op waits for
    `LoopbackFabric.unstall` (or `stall_for` seconds when > 0).  With `late_completions` a
    WRITE's notification reaches its target before the initiator hears it completed, and that
    completion waits for `LoopbackFabric.release_completions` (as on shared memory, where the
    target may answer before the initiator's loop sees its own completion).  A corrupted op
    (`corrupt_ops`) lands with the first byte of its last descriptor flipped and reports success,
    as a bad link would: nothing but an integrity check sees it.
    """

    seed: int = 0
    fail_ops: set[int] = field(default_factory=set)
    fail_rate: float = 0.0
    stall_ops: set[int] = field(default_factory=set)
    stall_rate: float = 0.0
    stall_for: float = 0.0
    drop_rate: float = 0.0
    duplicate_rate: float = 0.0
    reorder_rate: float = 0.0
    late_completions: bool = False
    corrupt_ops: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Op:
    number: int
    op_id: int
    initiator: LoopbackTransport
    peer: str
    kind: OpKind
    copies: list[tuple[int, int, int]]  # (destination address, source address, length)
    notification: bytes
    ready_at: float
    fail: bool
    stalled: bool
    cancelled: bool = False


class LoopbackFabric:
    """The in-process network joining `LoopbackTransport` endpoints."""

    def __init__(self, link: LinkModel | None = None, faults: FaultPlan | None = None, *, manual: bool = False):
        self.link = link or LinkModel()
        self.faults = faults or FaultPlan()
        self._rng = random.Random(self.faults.seed)
        self._endpoints: dict[str, LoopbackTransport] = {}
        self._dead: set[str] = set()
        self._lock = threading.RLock()  # held while bytes move and while peers are torn down
        self._wake = threading.Condition(self._lock)
        self._queue: list[tuple[float, int, _Op]] = []
        self._link_free: dict[tuple[str, str], float] = {}
        self._ops = 0
        self._held_note: tuple[LoopbackTransport, Notification] | None = None
        self._late: list[tuple[LoopbackTransport, Completion]] = []  # `FaultPlan.late_completions`
        self._closed = False
        self._manual = manual
        self._open: set[str] = set()  # endpoints attached and not closed: a thread runs while any is
        self._thread: threading.Thread | None = None
        self.on_idle: Callable[[], None] | None = None  # called, under its lock, when its last open endpoint closes

    # ------------------------------------------------------------------ endpoints and faults

    def endpoint(self, name: str) -> LoopbackTransport:
        return LoopbackTransport(name, fabric=self)

    def attach(self, endpoint: LoopbackTransport) -> None:
        """:raises ConfigError: an endpoint of that name is already on the fabric."""
        with self._lock:
            if endpoint.name in self._endpoints:
                raise ConfigError(f"loopback endpoint {endpoint.name!r} already exists on this fabric")
            self._endpoints[endpoint.name] = endpoint
            self._open.add(endpoint.name)
            if not self._manual and not self._closed and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvflow-loopback-fabric", daemon=True)
                self._thread.start()

    def detach(self, endpoint: LoopbackTransport) -> None:
        """`endpoint` closed; the fabric's thread ends with the last open endpoint (a later
        `attach` starts another)."""
        with self._lock:
            self._open.discard(endpoint.name)
            if not self._open and self.on_idle is not None:
                self.on_idle()  # under the lock: no endpoint can attach between the last close and it
            thread = self._thread if not self._open else None
            if thread is not None:
                self._thread = None  # it ends; `attach` starts another if one is needed
                self._wake.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def attached(self, name: str) -> LoopbackTransport | None:
        return self._endpoints.get(name)

    @property
    def lock(self) -> threading.RLock:
        """Held while bytes move: an endpoint holds it to change its peers atomically with ops."""
        return self._lock

    @property
    def op_count(self) -> int:
        """How many op numbers were handed out: the next op is number `op_count + 1`."""
        return self._ops

    def kill(self, name: str) -> None:
        """The endpoint dies: its in-flight ops fail, and every later op to or from it fails."""
        with self._lock:
            self._dead.add(name)
            for _, _, op in self._queue:
                if op.peer == name or op.initiator.name == name:
                    op.cancelled = True
            self._wake.notify_all()

    def is_dead(self, name: str) -> bool:
        return name in self._dead

    def unstall(self) -> None:
        """Let every stalled op proceed."""
        with self._lock:
            for _, _, op in self._queue:
                op.stalled = False
            self._wake.notify_all()

    # ------------------------------------------------------------------ ops

    def post(self, op: _Op) -> None:
        with self._lock:
            heapq.heappush(self._queue, (op.ready_at, op.number, op))
            self._wake.notify_all()

    def new_op_number(self) -> tuple[int, bool, bool]:
        """The next op's number, and whether the fault plan fails or stalls it."""
        with self._lock:
            self._ops += 1
            n, f = self._ops, self.faults
            fail = n in f.fail_ops or (f.fail_rate > 0 and self._rng.random() < f.fail_rate)
            stall = n in f.stall_ops or (f.stall_rate > 0 and self._rng.random() < f.stall_rate)
            return n, fail, stall

    def ready_time(self, initiator: str, peer: str, nbytes: int) -> float:
        """When an op of `nbytes` posted now lands, on the link model (call with `lock` held)."""
        now = time.monotonic()
        link = (initiator, peer)
        start = max(now, self._link_free.get(link, now))
        done = start + self.link.transfer_time(nbytes)
        self._link_free[link] = done
        return done + self.link.latency

    def cancel(self, match: Callable[[_Op], bool]) -> None:
        """Cancel every queued op `match` selects: it will fail instead of moving bytes."""
        with self._lock:
            for _, _, op in self._queue:
                if match(op):
                    op.cancelled = True
            self._wake.notify_all()

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def step(self, index: int = 0) -> bool:
        """Manual mode: run the `index`-th runnable (not stalled) op.  False if none is."""
        with self._lock:
            runnable = sorted(
                (item for item in self._queue if not item[2].stalled or item[2].cancelled), key=lambda i: i[:2]
            )
            if not runnable:
                return False
            item = runnable[index % len(runnable)]
            self._queue.remove(item)
            heapq.heapify(self._queue)
            self._execute(item[2])
            return True

    def run_until_idle(self) -> None:
        """Manual mode: run every runnable op (stalled ones stay)."""
        while self.step():
            pass

    def _run(self) -> None:
        with self._lock:
            while not self._closed and self._thread is threading.current_thread():
                now = time.monotonic()
                runnable = [item for item in self._queue if not item[2].stalled or item[2].cancelled]
                due = [item for item in runnable if item[0] <= now]
                stall_deadlines = [
                    item[0] + self.faults.stall_for
                    for item in self._queue
                    if item[2].stalled and self.faults.stall_for > 0
                ]
                if due:
                    item = min(due, key=lambda i: i[:2])
                    self._queue.remove(item)
                    heapq.heapify(self._queue)
                    self._execute(item[2])
                    continue
                for item in self._queue:
                    if item[2].stalled and self.faults.stall_for > 0 and item[0] + self.faults.stall_for <= now:
                        item[2].stalled = False
                wake_at = min([item[0] for item in runnable] + stall_deadlines, default=None)
                self._wake.wait(None if wake_at is None else max(wake_at - now, 0.0))

    def _execute(self, op: _Op) -> None:
        """Move the bytes (under the fabric lock) and report the outcome."""
        initiator = op.initiator
        target = self._endpoints.get(op.peer)
        if op.cancelled or target is None or op.peer in self._dead or initiator.name in self._dead:
            initiator.complete(Completion(op.op_id, f"peer {op.peer!r} unreachable"))
            return
        if not target.accepts_ops_from(initiator.name):  # the target tore the initiator down
            initiator.complete(Completion(op.op_id, f"peer {op.peer!r} does not accept ops from {initiator.name!r}"))
            return
        try:
            for dst, src, length in op.copies:
                target.check_range(dst if op.kind is OpKind.WRITE else src, length)
        except TransportError as exc:
            initiator.complete(Completion(op.op_id, str(exc)))
            return
        copies = op.copies[: len(op.copies) // 2] if op.fail else op.copies
        for dst, src, length in copies:
            ctypes.memmove(dst, src, length)
        if op.number in self.faults.corrupt_ops and copies:
            flipped = ctypes.c_ubyte.from_address(copies[-1][0])
            flipped.value ^= 0xFF
        if op.fail:
            initiator.complete(Completion(op.op_id, "injected op failure"))
            return
        if op.kind is OpKind.WRITE and self.faults.late_completions:
            self._late.append((initiator, Completion(op.op_id)))
            if op.notification:
                self.notify(target, Notification(initiator.name, op.notification))
            return
        initiator.complete(Completion(op.op_id))
        if op.kind is OpKind.WRITE and op.notification:
            self.notify(target, Notification(initiator.name, op.notification))

    def release_completions(self) -> int:
        """Report the completions `FaultPlan.late_completions` held back; how many there were."""
        with self._lock:
            late, self._late = self._late, []
        for initiator, completion in late:
            initiator.complete(completion)
        return len(late)

    def notify(self, target: LoopbackTransport, note: Notification) -> None:
        """Deliver a notification to `target`, subject to the fault plan's drops, duplicates
        and reordering."""
        with self._lock:
            f = self.faults
            if f.drop_rate > 0 and self._rng.random() < f.drop_rate:
                return
            if f.reorder_rate > 0 and self._held_note is None and self._rng.random() < f.reorder_rate:
                self._held_note = (target, note)  # delivered after the next notification
                return
            target.deliver(note)
            if f.duplicate_rate > 0 and self._rng.random() < f.duplicate_rate:
                target.deliver(note)
            if self._held_note is not None:
                held_target, held = self._held_note
                self._held_note = None
                held_target.deliver(held)

    def flush_held_notifications(self) -> None:
        """Deliver a notification kept back for reordering (it would otherwise wait forever)."""
        with self._lock:
            if self._held_note is not None:
                target, note = self._held_note
                self._held_note = None
                target.deliver(note)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
            self._wake.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)


class LoopbackTransport:
    """One endpoint on a `LoopbackFabric` (a private fabric if none is given)."""

    def __init__(self, name: str, *, fabric: LoopbackFabric | None = None) -> None:
        self.name = name
        self.fabric = fabric if fabric is not None else LoopbackFabric()
        self._regions: list[Region] = []
        self._peers: dict[str, list[Region]] = {}
        self._completions: deque[Completion] = deque()
        self._notifications: deque[Notification] = deque()
        self._listener: Callable[[], None] | None = None
        self._closed = False
        self.fabric.attach(self)

    @property
    def capabilities(self) -> TransportCapabilities:
        return TransportCapabilities("loopback", frozenset({MemoryType.DRAM}))

    def register_regions(self, regions: Sequence[Region]) -> None:
        self._alive()
        for region in regions:
            if region.memory is not MemoryType.DRAM:
                raise TransportError(f"loopback moves host memory only, not {region.memory.value}")
        self._regions.extend(regions)

    def deregister_regions(self) -> None:
        with self.fabric.lock:  # atomic with the peers' ops being checked against our memory
            self._regions = []

    def local_metadata(self) -> bytes:
        return self.name.encode()

    def add_peer(self, name: str, metadata: bytes, regions: Sequence[Region]) -> None:
        self._alive()
        if metadata != name.encode():
            raise TransportError(f"metadata for {name!r} names another endpoint")
        if self.fabric.attached(name) is None:
            raise TransportError(f"no loopback endpoint {name!r} on this fabric")
        with self.fabric.lock:  # atomic with submit and with the peer's ops being moved
            self._peers[name] = list(regions)

    def remove_peer(self, name: str) -> None:
        """Both directions are fenced: this endpoint's ops to `name`, and `name`'s one-sided
        ops into this endpoint's memory (a peer torn down must not land a stale WRITE here, nor
        READ blocks that are about to be reused)."""
        with self.fabric.lock:
            self._peers.pop(name, None)
            self.fabric.cancel(
                lambda op: (
                    (op.initiator is self and op.peer == name) or (op.initiator.name == name and op.peer == self.name)
                )
            )

    def submit(self, op_id: int, kind: OpKind, peer: str, plan: DescriptorPlan, notification: bytes) -> None:
        self._alive()
        regions = self._peers.get(peer)
        if regions is None:
            raise TransportError(f"op {op_id}: unknown peer {peer!r}")
        if self.fabric.is_dead(peer):
            raise TransportError(f"op {op_id}: peer {peer!r} is dead")
        copies: list[tuple[int, int, int]] = []
        for d in plan:
            local = region_address(self._regions, d.local_region, d.local_offset, d.length, "local")
            remote = region_address(regions, d.remote_region, d.remote_offset, d.length, f"peer {peer!r}")
            copies.append((remote, local, d.length) if kind is OpKind.WRITE else (local, remote, d.length))
        number, fail, stall = self.fabric.new_op_number()
        with self.fabric.lock:  # atomic with remove_peer: a removed peer's op is never queued
            if self._peers.get(peer) is not regions:  # removed (or replaced) since it was planned
                raise TransportError(f"op {op_id}: peer {peer!r} was removed")
            ready = self.fabric.ready_time(self.name, peer, plan.total_bytes)
            self.fabric.post(_Op(number, op_id, self, peer, kind, copies, notification, ready, fail, stall))

    def poll(self) -> tuple[list[Completion], list[Notification]]:
        return drain(self._completions), drain(self._notifications)

    def send_notification(self, peer: str, payload: bytes) -> None:
        self._alive()
        target = self.fabric.attached(peer)
        if target is None or peer not in self._peers or self.fabric.is_dead(peer):
            raise TransportError(f"cannot notify {peer!r}: unknown or dead")
        self.fabric.notify(target, Notification(self.name, payload))

    def expect_traffic(self, active: bool) -> None:
        return None  # completions and notifications wake the listener when they happen

    def set_listener(self, callback: Callable[[], None] | None) -> None:
        self._listener = callback

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self.fabric.lock:
            self.fabric.cancel(lambda op: op.initiator is self or op.peer == self.name)
            self._regions.clear()
            self._peers.clear()
        self.fabric.detach(self)

    # ------------------------------------------------------------------ fabric side

    def _alive(self) -> None:
        if self._closed or self.fabric.is_dead(self.name):
            raise TransportError(f"loopback endpoint {self.name!r} is closed or dead")

    def accepts_ops_from(self, name: str) -> bool:
        """Whether `name` is a peer here (one torn down may no longer touch this memory)."""
        return name in self._peers

    def check_range(self, address: int, length: int) -> None:
        """The peer may have named addresses it never registered: refuse them.

        :raises TransportError: the range is not inside one registered region.
        """
        for region in self._regions:
            if region.base <= address and address + length <= region.base + region.length:
                return
        raise TransportError(f"range {address:#x}+{length} is not registered by {self.name!r}")

    def complete(self, completion: Completion) -> None:
        self._completions.append(completion)
        self._signal()

    def deliver(self, note: Notification) -> None:
        if self._closed or self.fabric.is_dead(self.name):
            return
        self._notifications.append(note)
        self._signal()

    def _signal(self) -> None:
        listener = self._listener
        if listener is not None:
            listener()
