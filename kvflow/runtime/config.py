"""How an engine is tuned: deadlines, leases, heartbeats, and what runs on its threads.

Why apart from the engine: a host (the vLLM connector, a test, a benchmark) builds the config
from its own settings before any engine exists; the values are checked here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvflow.errors import ConfigError
from kvflow.protocol.admission import PeerAllowList
from kvflow.protocol.core import CoreConfig

__all__ = ("EngineConfig",)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    core: CoreConfig = field(default_factory=CoreConfig)
    transfer_timeout: float = 30.0  # deadline of a transfer when the caller gives none
    handshake_timeout: float = 10.0
    drain_timeout: float = 30.0  # how long `aclose` lets transfers finish before aborting them
    auto_deliver: bool = True  # D: hand blocks over as soon as a transfer succeeds
    lease: float = 30.0  # a peer silent this long is lost; P's blocks are held this long unrenewed
    heartbeat_interval: float | None = None  # default: lease / 6
    # a peer whose control connection dropped is lost unless the connection comes back (or the
    # peer is heard from) within this long; a silent peer with its connection up waits the lease
    suspect_timeout: float = 1.0
    # after tearing a peer down on a transport that cannot fence the peer's one-sided ops (RDMA),
    # wait this long before its transfers' blocks count as safe to release
    unfenced_grace: float = 5.0
    # ... and the blocks such a peer may still write (push) or read (pull) stay quarantined until
    # it is reachable again and its late ops have had their chance to land, or this long at most
    # (a peer that never comes back: its ops cannot land either unless the link does)
    unfenced_hold: float = 120.0
    # the most peers associated at once; a Hello beyond it is refused (each association holds a
    # control socket and transport state: a process can hold only so many)
    max_peers: int = 256
    # the engines this one may associate with and the networks of the control addresses it may
    # dial, whoever names them (a local `connect`, a request's parameters, a peer's Hello);
    # default: any engine id on loopback, link-local and private networks
    allowed_peers: PeerAllowList = field(default_factory=PeerAllowList)
    # how many released-block and finished-transfer records `Engine.released` / `Engine.finished`
    # keep for a poller; beyond it the oldest is dropped and counted (`released_dropped`,
    # `finished_dropped`), so an engine nobody polls does not grow without bound
    results_kept: int = 65_536
    # a data op moving at most this many bytes is planned and posted on the event loop, when the
    # writer has nothing queued, instead of on the writer thread: two thread hand-overs cost
    # more than a small op's planning and post (0: every op on the writer)
    inline_op_bytes: int = 0
    # runs first on every thread the engine starts (its writer): a GPU host binds it to its device
    thread_setup: Callable[[], None] | None = None
    # the end-to-end check of what each WRITE carried (`kvflow.runtime.integrity`): P seals each
    # WRITE with digests of what it read, D checks what landed (off by default: it costs a hash of
    # every byte on both sides); both sides must turn it on
    integrity: bool = False
    # D checks one transfer in this many, picked with a secret of its own (P seals every WRITE)
    integrity_sample: int = 1

    def __post_init__(self) -> None:
        """:raises ConfigError: a timeout, the lease, the heartbeat interval, a bound or the
        integrity sample is out of range."""
        positive = (
            "transfer_timeout",
            "handshake_timeout",
            "drain_timeout",
            "lease",
            "suspect_timeout",
            "unfenced_hold",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"engine config {name} must be > 0")
        for bound in ("results_kept", "max_peers"):
            if getattr(self, bound) < 1:
                raise ConfigError(f"engine config {bound} must be >= 1")
        if self.inline_op_bytes < 0:
            raise ConfigError("engine config inline_op_bytes must be >= 0")
        if type(self.integrity_sample) is not int or self.integrity_sample < 1:
            raise ConfigError(f"engine config integrity_sample must be an integer >= 1, not {self.integrity_sample!r}")
        if self.heartbeat_interval is not None and not 0 < self.heartbeat_interval < self.lease:
            raise ConfigError("engine config heartbeat_interval must be in (0, lease)")
