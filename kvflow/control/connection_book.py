"""Which of the ROUTER's connections give their descriptors back when the process runs short: pure.

Why: ZeroMQ accepts every connection that completes its handshake and keeps it until the other
end closes it, and a peer holding the secret completes the handshake.  Such an insider held 143
connections open on P, sending nothing on them, until P was at 1,024 of 1,024 descriptors and a
genuine peer could not connect (the descriptor reserve guarded Hellos; connections were not
counted).  A connection is worth its descriptor while it carries a peer's association; so when
the process is short of descriptors, the channel closes the ones that carry none, in this order:

1. **those whose last sender has no route here**: a peer refused, forgotten or never associated;
2. **those that never carried a frame** since they were accepted more than `grace` ago (a peer
   sends its Hello as soon as it connects: its connection is younger, or has spoken);
3. **those a newer connection of the same sender superseded** (a peer's DEALER that reconnected,
   or one of many an insider opened under one name);

oldest first within each.  A connection carrying a routed peer's newest frames is never closed,
nor one younger than `grace` that has not spoken yet.  An insider's DEALERs reconnect by
themselves when they are closed, each then silent again: each is closed again once `grace` has
passed, and the descriptors freed meanwhile go to whoever connects, a genuine peer included.
Closing one is harmless to a genuine peer: its DEALER reconnects by itself.

Connections are known by their socket's inode, not by their descriptor number, which the kernel
gives to the next socket as soon as libzmq closes one: the driver (`kvflow.control.connections`)
reads the inode when it learns of a connection, and checks it again on a duplicate of the
descriptor before it closes anything, so that it never closes a socket this book does not name.
Time is an input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ("ConnectionBook", "Entry")


@dataclass
class Entry:
    fd: int  # the descriptor libzmq holds it by (when last seen)
    since: float  # when it was accepted, or first seen
    sender: str | None = None  # the engine id of its last frame; None: none yet
    spoke_at: float = 0.0  # when its last frame came


class ConnectionBook:
    """The ROUTER's connections by socket inode: when each came, who spoke on it last."""

    def __init__(self, grace: float) -> None:
        """`grace`: seconds a connection may stay silent after it was accepted before it counts
        as idle.  :raises ValueError: `grace` negative."""
        if grace < 0:
            raise ValueError(f"grace must not be negative, not {grace!r}")
        self.grace = grace
        self._entries: dict[int, Entry] = {}
        self._gave_way_at: float | None = None  # when a connection was last closed for its descriptor

    def __len__(self) -> int:
        return len(self._entries)

    def accepted(self, inode: int, fd: int, now: float) -> None:
        """A connection was accepted (again for one seen already: its descriptor, nothing else)."""
        entry = self._entries.get(inode)
        if entry is None:
            self._entries[inode] = Entry(fd, now)
        else:
            entry.fd = fd

    def spoke(self, inode: int, fd: int, sender: str, now: float) -> None:
        """A frame of `sender` came on the connection (first seen here if need be)."""
        entry = self._entries.get(inode)
        if entry is None:
            entry = self._entries[inode] = Entry(fd, now)
        entry.fd, entry.sender, entry.spoke_at = fd, sender, now

    def forget(self, inode: int) -> None:
        """The connection is closed (again: nothing)."""
        self._entries.pop(inode, None)

    def gave_way(self, inode: int, now: float) -> None:
        """The connection was closed for its descriptor."""
        self._entries.pop(inode, None)
        self._gave_way_at = now

    def pressed(self, now: float, window: float) -> bool:
        """Whether a connection was closed for its descriptor within the last `window` seconds:
        connections that carry nothing are taking the descriptors, so a new one is refused at
        its handshake rather than given one of the last (see `kvflow.control.connections`)."""
        return self._gave_way_at is not None and now - self._gave_way_at <= window

    def prune(self, open_now: Callable[[int, int], bool]) -> None:
        """Forget every connection for which `open_now(inode, fd)` is false (closed since)."""
        for inode in [inode for inode, entry in self._entries.items() if not open_now(inode, entry.fd)]:
            del self._entries[inode]

    def victims(self, now: float, routed: Callable[[str], bool]) -> list[tuple[int, int]]:
        """(inode, descriptor) of every connection that may be closed for its descriptor, in the
        order they should be (see the module); `routed(sender)`: whether a peer is routed here."""
        newest: dict[str, float] = {}
        for entry in self._entries.values():
            if entry.sender is not None and entry.spoke_at >= newest.get(entry.sender, -1.0):
                newest[entry.sender] = entry.spoke_at
        unrouted: list[tuple[float, int, int]] = []
        silent: list[tuple[float, int, int]] = []
        superseded: list[tuple[float, int, int]] = []
        for inode, entry in self._entries.items():
            if entry.sender is None:
                if now - entry.since > self.grace:
                    silent.append((entry.since, inode, entry.fd))
            elif not routed(entry.sender):
                unrouted.append((entry.spoke_at, inode, entry.fd))
            elif entry.spoke_at < newest[entry.sender]:
                superseded.append((entry.spoke_at, inode, entry.fd))
        return [(inode, fd) for group in (unrouted, silent, superseded) for _, inode, fd in sorted(group)]
