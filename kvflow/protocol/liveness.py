"""When each associated peer is due a heartbeat, and when a silent one counts as lost.

Why apart from the associations: it is a schedule of per-peer instants, nothing more, and the
associations ask it questions (`due`, `expired`, `next_deadline`); time is always an argument.
"""

from __future__ import annotations

__all__ = ("Liveness",)


class Liveness:
    """When each peer is due a heartbeat, and when a silent one counts as lost.

    A peer whose connection dropped is *suspect*: unless its link comes back or it is heard from
    within `confirm` seconds, it counts as lost then, without waiting for the lease."""

    def __init__(self, lease: float, interval: float, confirm: float = 1.0) -> None:
        self.lease = lease
        self.interval = interval
        self.confirm = confirm
        self._heard: dict[str, float] = {}
        self._next_beat: dict[str, float] = {}
        self._suspect: dict[str, float] = {}  # peer -> lost at this time unless cleared before

    def add(self, peer: str, now: float) -> None:
        self._heard[peer] = now
        self._next_beat[peer] = now + self.interval
        self._suspect.pop(peer, None)

    def remove(self, peer: str) -> None:
        self._heard.pop(peer, None)
        self._next_beat.pop(peer, None)
        self._suspect.pop(peer, None)

    def heard(self, peer: str, now: float) -> None:
        if peer in self._heard:
            self._heard[peer] = max(self._heard[peer], now)
            self.cleared(peer)

    def suspect(self, peer: str, now: float) -> bool:
        """The link to `peer` dropped; True when this makes an associated peer newly suspect."""
        if peer not in self._heard or peer in self._suspect:
            return False
        self._suspect[peer] = now + self.confirm
        return True

    def cleared(self, peer: str) -> None:
        """The link to `peer` is back (or it spoke): no longer suspect."""
        self._suspect.pop(peer, None)

    def is_suspect(self, peer: str) -> bool:
        return peer in self._suspect

    def due(self, now: float) -> list[str]:
        """Peers to send a heartbeat to now (each is then scheduled one interval later)."""
        peers = [p for p, at in self._next_beat.items() if at <= now]
        for peer in peers:
            self._next_beat[peer] = now + self.interval
        return sorted(peers)

    def expired(self, now: float) -> list[str]:
        silent = {p for p, at in self._heard.items() if at + self.lease <= now}
        return sorted(silent | {p for p, at in self._suspect.items() if at <= now})

    def next_deadline(self) -> float | None:
        times = [*self._next_beat.values(), *(at + self.lease for at in self._heard.values())]
        return min([*times, *self._suspect.values()], default=None)
