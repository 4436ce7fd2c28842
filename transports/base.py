"""The data-plane contract every transport meets.

Why a Protocol: transports (loopback, NIXL over UCX or LIBFABRIC, ...) share no code, only a
contract, and mypy checks it structurally.  The engine never imports a backend library; it gets
a transport object from its embedder, who may look one up by name in `kvflow.transports.registry`.

The contract, which the engine's safety depends on:

* Threads.  Every method may be called from any thread, and these run concurrently: `submit`
  (the engine's writer thread), `poll` (the event loop), and `add_peer`, `remove_peer` and
  `local_metadata` (a worker thread of the engine's, never the event loop).  `register_regions`
  and `set_listener` come first, `close` last, each from one thread while nothing else runs.
  `deregister_regions`, and `register_regions` again after it, are called while no op is in
  flight and no peer is associated (the engine asleep: `Engine.unregister_memory`).
* Blocking.  `poll` never blocks: it takes no lock that a copy or a backend call holds.  `submit`
  may block to plan and post the op (loopback: the op being moved; shared memory: nothing longer
  than another submit's planning; NIXL: the post, and the peer lock held by another post or a
  teardown), never until the op completes.  `local_metadata` and `add_peer` may block for the
  backend's call (NIXL: at most its `call_timeout`, then `TransportError`).  `remove_peer` may
  block until this endpoint's copy to the peer in progress ends (one op; NIXL: at most
  `call_timeout`) and, where it fences inbound ops, until the peer's op into local memory in
  progress ends (shared memory: at most `fence_timeout`, then `TransportError`).  `close` may
  block a few seconds while the transport's threads stop.  The listener is called from the
  transport's threads and must not block or call back into the transport.
* An op reported by `poll` as completed or failed will not touch memory any more, on either side.
* A WRITE's notification is delivered to the peer only after the WRITE's bytes have landed there.
* After `remove_peer(name)` returns, no op of this endpoint to that peer can touch memory any
  more; ops still queued or in flight are reported as failed, and a `submit` to it (even one
  racing with the removal on another thread) is refused or fenced, never landed, until a new
  `add_peer`.  If `capabilities.fences_inbound`, the same holds for the peer's ops into this
  endpoint's memory.  Notifications already received from the peer may still be polled; the
  engine ignores those of a peer it no longer knows.  `add_peer` for a name already present
  replaces the association: this endpoint's ops to the old one are failed as by `remove_peer`.
* A failure is reported as `TransportError` (or a subclass): the exceptions by which a backend
  library reports a failed call are mapped to it at the edge.  Any other exception out of a
  backend is a bug (in kvflow or the backend) and propagates as it is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

from kvflow.errors import TransportError
from kvflow.layout import DescriptorPlan, MemoryType, Region
from kvflow.protocol.actions import OpKind

__all__ = (
    "Completion",
    "Notification",
    "Transport",
    "TransportCapabilities",
    "drain",
    "region_address",
)


@dataclass(frozen=True, slots=True)
class TransportCapabilities:
    name: str
    memory_types: frozenset[MemoryType]
    backends: tuple[str, ...] = ()
    # remove_peer also stops the *peer's* one-sided ops into local memory (loopback, shm: yes;
    # RDMA: no, a registration stays writable); without it the engine waits a grace period
    fences_inbound: bool = True


@dataclass(frozen=True, slots=True)
class Completion:
    """An op finished: `error` is None on success, else what went wrong."""

    op_id: int
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Notification:
    peer: str
    payload: bytes


@runtime_checkable
class Transport(Protocol):
    @property
    def capabilities(self) -> TransportCapabilities: ...

    def register_regions(self, regions: Sequence[Region]) -> None:
        """Register local memory; it must stay valid until `close`.

        :raises TransportError: the memory cannot be registered (type unsupported, overlap).
        """

    def deregister_regions(self) -> None:
        """Let go of every registration `register_regions` made (the memory stays the caller's,
        who may then free or remap it); ops naming local memory are refused until
        `register_regions` is called again, after which `local_metadata` describes the new
        registration.  Idempotent.

        :raises TransportError: the backend refused to release a registration.
        """

    def local_metadata(self) -> bytes:
        """What a peer needs in `add_peer` to reach this endpoint and its regions.

        :raises TransportError: the endpoint is closed, or the backend cannot describe it.
        """

    def add_peer(self, name: str, metadata: bytes, regions: Sequence[Region]) -> None:
        """Make `name` reachable; `regions` are the peer's, in its layout's order.  Called off the
        event loop, concurrently with `submit` and `poll`; may block for the backend's call.

        :raises TransportError: metadata unusable or peer unreachable.
        """

    def remove_peer(self, name: str) -> None:
        """Tear the peer down; see the module contract.  Unknown names are ignored.  Called off the
        event loop; may block until the copy in progress to (or, fencing inbound, from) the peer ends.

        :raises TransportError: the backend did not confirm the teardown in time.
        """

    def submit(self, op_id: int, kind: OpKind, peer: str, plan: DescriptorPlan, notification: bytes) -> None:
        """Post an op moving `plan`'s byte ranges (WRITE: local to peer; READ: peer to local).

        `notification` (WRITE only, may be empty) reaches the peer after the bytes.
        :raises TransportError: the op could not be posted (unknown peer, unregistered memory,
            peer dead).  A posted op reports its outcome through `poll` instead.
        """

    def poll(self) -> tuple[list[Completion], list[Notification]]:
        """Completions of this endpoint's ops and notifications received, without blocking.
        Never raises: a failed op is a `Completion` with an error."""

    def send_notification(self, peer: str, payload: bytes) -> None:
        """A standalone notification.  :raises TransportError: unknown or dead peer."""

    def set_listener(self, callback: Callable[[], None] | None) -> None:
        """`callback` is called, from any thread, when `poll` may have something new."""

    def expect_traffic(self, active: bool) -> None:
        """Whether the engine has transfers under way (it says so when that changes; until it
        does, they are).  While none is, no op or notification is awaited, and a transport
        that polls its backend may poll lazily (a stray notification then reaches `poll`
        later); while one is, `poll` must see what arrives promptly.  Never raises."""

    def close(self) -> None:
        """Release every registration and handle.  Idempotent; never raises for a backend that
        fails to release something (there is nothing left to do about it)."""


_T = TypeVar("_T")


def drain(queue: deque[_T]) -> list[_T]:
    """Every item `queue` holds now, oldest first, for its one consumer; other threads may
    append meanwhile (deque's append and popleft are atomic)."""
    items = []
    while True:
        try:
            items.append(queue.popleft())
        except IndexError:
            return items


def region_address(regions: Sequence[Region], index: int, offset: int, length: int, side: str) -> int:
    """The address of `length` bytes at `offset` in `regions[index]`, for transports to check a
    descriptor before touching memory.

    :raises TransportError: the region is not registered, or the range leaves it.
    """
    if not 0 <= index < len(regions):
        raise TransportError(f"{side} region {index} is not registered")
    region = regions[index]
    if offset < 0 or length <= 0 or offset + length > region.length:
        raise TransportError(f"{side} range {offset}+{length} lies outside region {index} ({region.length} bytes)")
    return region.base + offset
