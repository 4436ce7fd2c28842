"""Which client connections the router keeps when they are more than it may hold: pure bookkeeping.

Why: a global cap on connections alone let clients that hold connections doing nothing lock
everyone else out (320 kept-alive connections, each idle after one request, and 0 of 20 genuine
requests served for the 75 s of the idle deadline).  Two rules close that, and they are policy,
so they live here without sockets or clocks, and the router's protocol wrapper
(`kvflow_tools.routing.http_limits`) only tells this book what its connections do:

* **Idle connections give way.**  A connection that waits for its next request (kept alive
  after an answer, or open and silent since it was accepted) is closed to make room for a new
  one when the router is at a cap, the one idle longest first.  Closing a kept-alive connection
  that is idle is what HTTP/1.1 allows a server at any time; a connection with part of a request
  in, or a request being answered, is never closed for room.
* **A share per client address** (`per_client`): one address holds at most that many; beyond it
  its own longest-idle connection gives way, or its new one is refused.  So one address cannot
  take the others' room however many connections it opens; with `per_client` at the cap, the
  share is off (one client behind a proxy, for example).

A connection evicted leaves the book at once, so that a burst of new connections evicts distinct
ones; the wrapper then closes it and tells `gone` again, which is harmless.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ("Admitted", "Refused", "Shares")


@dataclass(frozen=True)
class Admitted:
    """The new connection is in; `evicted`, if not None, must be closed for it."""

    evicted: Hashable | None = None


@dataclass(frozen=True)
class Refused:
    """The new connection is to be closed at once: `kind` is "connections" (the router is at its
    cap, nothing idle) or "client_share" (its address is at its share, nothing of its own idle)."""

    kind: str
    message: str


class Shares:
    """The connections the router holds, by client address, and which of them wait idle."""

    def __init__(self, max_connections: int, per_client: int) -> None:
        """:raises ValueError: a bound below 1."""
        if max_connections < 1 or per_client < 1:
            raise ValueError(f"connection bounds must be at least 1, not {max_connections} and {per_client}")
        self.max_connections = max_connections
        self.per_client = min(per_client, max_connections)
        self._address: dict[Hashable, str] = {}  # every connection held -> its client's address
        self._held: Counter[str] = Counter()  # connections held per address
        self._idle: dict[Hashable, None] = {}  # the idle ones, longest idle first (insertion order)

    def __len__(self) -> int:
        return len(self._address)

    def held_by(self, address: str) -> int:
        return self._held[address]

    @property
    def idle_count(self) -> int:
        return len(self._idle)

    def admit(self, connection: Hashable, address: str) -> Admitted | Refused:
        """A new `connection` from `address`: in (silent, so idle), perhaps at the cost of an idle
        one, or refused.  Nothing changes on a refusal.  :raises ValueError: held already."""
        if connection in self._address:
            raise ValueError(f"connection {connection!r} is held already")
        full, evicted = self._at_cap(address), None
        if full is not None:
            scope, refusal = full
            evicted = self._longest_idle(scope)
            if evicted is None:
                return refusal
            self.gone(evicted)
        self._address[connection] = address
        self._held[address] += 1
        self._idle[connection] = None
        return Admitted(evicted)

    def busy(self, connection: Hashable) -> None:
        """Part of a request came on `connection`, or its handler runs: not to be evicted."""
        self._idle.pop(connection, None)

    def idle(self, connection: Hashable) -> None:
        """`connection` was answered and waits for its next request (if it is held)."""
        if connection in self._address:
            self._idle.pop(connection, None)
            self._idle[connection] = None  # to the end: idle since now

    def gone(self, connection: Hashable) -> None:
        """`connection` is closed or evicted (again: nothing)."""
        address = self._address.pop(connection, None)
        if address is None:
            return
        self._idle.pop(connection, None)
        self._held[address] -= 1
        if not self._held[address]:
            del self._held[address]

    def _at_cap(self, address: str) -> tuple[str | None, Refused] | None:
        """None when there is room for a new connection from `address`; else whose idle connection
        must give way (that address's, or None: anyone's) and the refusal when none is idle."""
        held = self._held[address]
        if self.per_client < self.max_connections and held >= self.per_client:
            option = f"--max-connections-per-client {self.per_client}"
            return address, Refused(
                "client_share", f"refused a connection from {address}: it holds {held}, none idle ({option})"
            )
        if len(self._address) >= self.max_connections:
            option = f"--max-connections {self.max_connections}"
            return None, Refused(
                "connections", f"refused a connection: {len(self._address)} open, none idle ({option})"
            )
        return None

    def _longest_idle(self, address: str | None) -> Hashable | None:
        """The connection idle longest, of `address` (None: of any)."""
        for connection in self._idle:
            if address is None or self._address[connection] == address:
                return connection
        return None
