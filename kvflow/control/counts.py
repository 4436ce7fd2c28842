"""What the ZeroMQ control channel counts: each count a field, each reason to drop a frame a `Rejection`.

Why typed: the channel's counts were a bag keyed by strings, with ``rejected_<reason>`` built
from the reason's text, so a misspelt name made a new key that nothing read.  Here a misspelling
does not type-check, and a reason is one of a closed set.  `ControlCounts.snapshot` still gives
the flat names the engine's stats, the tests and the benchmarks read (``frames_sent``,
``rejected``, ``rejected_bad_mac``, ...; one never counted reads 0).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum

__all__ = ("ControlCounts", "Rejection")


class Rejection(StrEnum):
    """Why the channel dropped a frame (counted as ``rejected_<value>``)."""

    SHAPE = "shape"  # not a frame and a MAC, or more parts than a frame has
    OVERSIZED = "oversized"
    BAD_MAC = "bad_mac"
    UNEXPECTED_MAC = "unexpected_mac"  # the peer signs, this engine has no secret
    VERSION = "version"
    MALFORMED = "malformed"
    MISDIRECTED = "misdirected"  # for another engine
    IDENTITY = "identity"  # claims another sender than its connection's
    STALE = "stale"  # for an earlier run of this engine
    UNBOUND = "unbound"  # names no run of this engine
    FUTURE = "future"  # an incarnation that is no clock reading yet
    REPLAYED = "replayed"
    ROUTE = "route"  # a Hello whose control address cannot be a route


@dataclass(slots=True)
class ControlCounts:
    """The channel's counts since it was made (only the event loop's thread changes them)."""

    frames_sent: int = 0
    frames_received: int = 0
    messages_delivered: int = 0
    send_queue_full: int = 0  # a send refused: the peer is not reading
    connections_forgotten: int = 0  # DEALERs closed by `forget`
    zap_admitted: int = 0  # CURVE clients the ZAP handler let in
    zap_refused: int = 0
    rejected: Counter[Rejection] = field(default_factory=Counter)

    def reject(self, reason: Rejection) -> int:
        """Count a frame dropped for `reason`; the frames dropped so far.  Never raises."""
        self.rejected[reason] += 1
        return self.rejected.total()

    def snapshot(self, connections: Mapping[str, int]) -> Counter[str]:
        """The counts under their flat names, with `connections` (the ROUTER's connection
        counts, `kvflow.control.connections`) beside them: a copy.  Never raises."""
        flat: Counter[str] = Counter({f.name: getattr(self, f.name) for f in fields(self) if f.name != "rejected"})
        for reason, count in self.rejected.items():
            flat[f"rejected_{reason.value}"] = count
        flat["rejected"] = self.rejected.total()
        for name, count in connections.items():
            flat[name] = count
        return flat
