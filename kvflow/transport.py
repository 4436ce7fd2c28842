"""The data-plane contract every transport meets, and the registry that loads them by name.

Why a Protocol: transports (loopback, NIXL over UCX or LIBFABRIC, ...) share no code, only a
contract, and mypy checks it structurally.  The engine never imports a backend library; it asks
`load_transport(name)`, which imports the backend lazily and, when its library is missing,
raises `TransportUnavailable` with the command that installs it (anyio's backend loading).

The contract, which the engine's safety depends on:

* All methods are thread-safe.  `submit` may block (it plans and posts the op); the engine calls
  it from its writer thread, never from the event loop.  `poll` never blocks.
* An op reported by `poll` as completed or failed will not touch memory any more, on either side.
* A WRITE's notification is delivered to the peer only after the WRITE's bytes have landed there.
* After `remove_peer(name)` returns, no op of this endpoint to that peer can touch memory any
  more; ops still in flight are reported as failed, and a `submit` to it (even one racing with
  the removal on another thread) is refused or fenced, never landed.  If
  `capabilities.fences_inbound`, the same holds for the peer's ops into this endpoint's memory.
* Only `TransportError` (and subclasses) escape; backend exceptions are mapped at the edge.
"""

from __future__ import annotations

import importlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from kvflow.actions import OpKind
from kvflow.errors import TransportError, TransportUnavailable, UnknownTransport
from kvflow.layout import DescriptorPlan, MemoryType, Region

__all__ = (
    "BUILTIN_TRANSPORTS",
    "Completion",
    "Notification",
    "Transport",
    "TransportCapabilities",
    "available_transports",
    "drain",
    "load_transport",
    "region_address",
)


@dataclass(frozen=True, slots=True)
class TransportCapabilities:
    name: str
    memory_types: frozenset[MemoryType]
    cross_process: bool  # can reach peers in other processes
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

    def local_metadata(self) -> bytes:
        """What a peer needs in `add_peer` to reach this endpoint and its regions."""

    def add_peer(self, name: str, metadata: bytes, regions: Sequence[Region]) -> None:
        """Make `name` reachable; `regions` are the peer's, in its layout's order.

        :raises TransportError: metadata unusable or peer unreachable.
        """

    def remove_peer(self, name: str) -> None:
        """Tear the peer down; see the module contract.  Unknown names are ignored."""

    def submit(self, op_id: int, kind: OpKind, peer: str, plan: DescriptorPlan, notification: bytes) -> None:
        """Post an op moving `plan`'s byte ranges (WRITE: local to peer; READ: peer to local).

        `notification` (WRITE only, may be empty) reaches the peer after the bytes.
        :raises TransportError: the op could not be posted (unknown peer, unregistered memory,
            peer dead).  A posted op reports its outcome through `poll` instead.
        """

    def poll(self) -> tuple[list[Completion], list[Notification]]:
        """Completions of this endpoint's ops and notifications received, without blocking."""

    def send_notification(self, peer: str, payload: bytes) -> None:
        """A standalone notification.  :raises TransportError: unknown or dead peer."""

    def set_listener(self, callback: Callable[[], None] | None) -> None:
        """`callback` is called, from any thread, when `poll` may have something new."""

    def close(self) -> None:
        """Release every registration and handle.  Idempotent."""


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


@dataclass(frozen=True, slots=True)
class _Entry:
    module: str
    attribute: str
    requires: tuple[str, ...]
    install_hint: str


BUILTIN_TRANSPORTS: dict[str, _Entry] = {
    "loopback": _Entry("kvflow.transports.loopback", "LoopbackTransport", ("numpy",), "pip install kvflow"),
    "shm": _Entry("kvflow.transports.shm", "ShmTransport", ("numpy", "msgpack"), "pip install kvflow"),
    "nixl": _Entry("kvflow.transports.nixl", "NixlTransport", ("nixl",), "pip install 'kvflow[nixl]'"),
}

_loaded: dict[str, Callable[..., Any]] = {}


def available_transports() -> list[str]:
    """Names `load_transport` knows: built-ins plus the `kvflow.transports` entry-point group."""
    names = set(BUILTIN_TRANSPORTS)
    names.update(ep.name for ep in metadata.entry_points(group="kvflow.transports"))
    return sorted(names)


def load_transport(name: str) -> Callable[..., Any]:
    """The transport class (or factory) registered under `name`, imported on first use.

    :raises UnknownTransport: no transport has that name; the message lists those that exist.
    :raises TransportUnavailable: its library is not installed; the message says how to get it.
    """
    if name in _loaded:
        return _loaded[name]
    entry = BUILTIN_TRANSPORTS.get(name)
    if entry is not None:
        try:
            module = importlib.import_module(entry.module)
        except ModuleNotFoundError as exc:
            missing = exc.name or "?"
            if missing == "kvflow" or missing.startswith("kvflow."):
                raise
            raise TransportUnavailable(
                f"transport {name!r} needs the {missing!r} package, which is not installed; "
                f"install it with: {entry.install_hint}"
            ) from exc
        require = getattr(module, "require", None)
        if callable(require):
            require()  # a backend whose library loads lazily says here if it is missing
        factory = cast(Callable[..., Any], getattr(module, entry.attribute))
    else:
        points = [ep for ep in metadata.entry_points(group="kvflow.transports") if ep.name == name]
        if not points:
            raise UnknownTransport(f"no transport named {name!r}; known: {', '.join(available_transports())}")
        try:
            factory = points[0].load()
        except ModuleNotFoundError as exc:
            raise TransportUnavailable(
                f"transport {name!r} from {points[0].value} cannot be imported: the {exc.name!r} package is missing"
            ) from exc
    _loaded[name] = factory
    return factory
