"""The ROUTER's connections, counted on a thread of the channel, and the descriptors they take.

Why a thread: a stranger can open connections as fast as the kernel completes them, and each one
is two or three socket-monitor events (accepted, handshake failed, disconnected); at the
process's descriptor limit, libzmq retries the failed accept on every turn of its I/O thread,
one more event each time.  Read on the event loop (an asyncio socket, a turn of the loop per
event) a flood of 300-500 connections a second cost the loop 6 % of a core, and 9–29 % once
the process was out of descriptors (docs/security.md has the figures).  Here a
thread reads the monitor (a plain socket, polled with a deadline), counts in batches and logs
through a `DropLog`; the loop reads the totals only when it reads the channel's counters
(`ConnectionWatch.counts`), so no event costs the loop a turn.  The thread still takes the GIL
for each batch; it waits `GAP` between batches, so it wakes at most 100 times a second whatever
the rate.  libzmq blocks its I/O thread while the monitor's queue (1,000 events) is full, so a
reader pacing itself also paces libzmq's accept retries at the limit: after a batch of
`BURST` events or more (only that retry loop produces them) it waits `PAUSE`.

Why raise the descriptor limit (`raise_descriptor_limit`): ZeroMQ has no cap on connections;
each one a stranger opens holds a descriptor until `handshake_timeout` runs out and libzmq has
closed it (`kvflow bench floods`: 2.0 s each with the 2 s default), so a flood holds its rate
times that long.  A soft limit of 1,024 (a common default) is reached at 500 connections a second
from one process; then libzmq's accepts fail and are retried on every turn of its I/O thread,
and every descriptor freed goes to whoever asks first.  The hard limit is what the operator
allows; the soft one is raised to it when a channel starts, up to `DESCRIPTORS` (more than the
28,000 ephemeral ports of one source address can hold open to one port).

Why the thread also closes connections: one that completed its handshake stays open until its
other end closes it, so a peer holding the secret could hold every descriptor with connections
that carry nothing.  When fewer than `KEEP_FREE` descriptors are left (checked after each batch
of new connections and every `CHECK_EVERY`), the thread closes the connections that carry no
routed peer's association, in `kvflow.control.connection_book`'s order, until that many are
free again.  It closes a connection by shutting down a duplicate of its descriptor whose socket
is the one the book names (the same inode, on the ROUTER's port), never the number alone:
libzmq sees the end of the connection and closes its descriptor itself.  The duplicate is made
in a descriptor the thread keeps for it (``dup2``), so that it works when the process has none
left, where libzmq's accept takes every descriptor freed at once.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

import zmq

from kvflow.control.connection_book import ConnectionBook
from kvflow.control.hardening import DropLog
from kvflow.control.monitor import open_monitor

__all__ = (
    "BURST",
    "CHECK_EVERY",
    "DESCRIPTORS",
    "GAP",
    "KEEP_FREE",
    "KEEP_FREE_FLOOR",
    "KEEP_FREE_SHARE",
    "PAUSE",
    "PRESSURE_S",
    "ConnectionWatch",
    "descriptors_left",
    "keep_free",
    "keep_free_for",
    "open_descriptors",
    "raise_descriptor_limit",
)

log = logging.getLogger("kvflow.control.zeromq")

POLL_MS = 100  # the thread's longest wait for an event: how soon it sees that it must stop
GAP = 0.01  # seconds between two batches
BURST = 200  # events in one batch (one `GAP`) that only libzmq's accept retries produce
PAUSE = 0.1  # seconds the thread waits after such a batch
BATCH = 4096  # events read at most in one batch
JOIN_S = 2.0  # how long close() waits for the thread
DESCRIPTORS = 1 << 16  # the soft limit is raised to the hard one, but not above this
KEEP_FREE = 96  # descriptors the thread keeps free by closing idle connections (a Hello wants 64) ...
KEEP_FREE_SHARE = 8  # ... or an eighth of the limit, if less (a limit of 128 would otherwise close all) ...
KEEP_FREE_FLOOR = 48  # ... but never less: twice the least a Hello wants (24, `kvflow.runtime.descriptors`)
CHECK_EVERY = 1.0  # seconds between two checks of the descriptors left when no connection comes
PRESSURE_S = 10.0  # seconds after an idle connection was closed during which new ones are refused when short

_EVENTS: dict[int, tuple[str, str]] = {
    zmq.EVENT_ACCEPT_FAILED: ("accept_failed", "a connection could not be accepted (out of descriptors?)"),
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: ("rejected_handshake", "a connection that did not complete the handshake"),
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: ("rejected_handshake_protocol", "a connection that broke the handshake"),
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: ("rejected_handshake_auth", "a connection whose key is not admitted"),
}


class ConnectionWatch:
    """Counts the events of a ROUTER's monitor socket `monitor` (a plain socket, used by the
    watch's thread alone, which closes it) until `close`: `connections_accepted`,
    `connections_open` (a gauge) and the drops in `_EVENTS`, each logged by a `DropLog`."""

    def __init__(
        self,
        monitor: zmq.Socket[bytes],
        owner: str,
        thread_setup: Callable[[], None] | None = None,
        grace: float = 1.0,
    ) -> None:
        """Starts the thread, which runs `thread_setup` first; `start` sets up the monitor first.
        `grace`: seconds a new connection may stay silent before it counts as idle."""
        self._monitor = monitor
        self._thread_setup = thread_setup
        self._drops = DropLog(owner)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._book = ConnectionBook(grace)  # under `_lock`
        self._port = 0  # the ROUTER's port: set by `listening`; until then nothing is closed
        self.routed: Callable[[str], bool] = lambda sender: True  # whether a sender is a routed peer
        self._null, self._slot = _open_null(), _open_null()  # /dev/null: see `_shut`
        self._slot_lock = threading.Lock()  # the slot is used by the thread and by `room` on the loop
        self._checked = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvflow-connections-{owner}", daemon=True)
        self.batches = 0  # batches read so far
        self._thread.start()

    @classmethod
    def start(
        cls,
        sock: zmq.Socket[bytes],
        events: int,
        owner: str,
        thread_setup: Callable[[], None] | None = None,
        grace: float = 1.0,
    ) -> ConnectionWatch:
        """Monitor `events` of `sock` and count them on a new thread (`grace`: see `__init__`).

        :raises zmq.ZMQError: the monitor cannot be set up (out of descriptors); then `sock` is
            left unmonitored (`kvflow.control.monitor.open_monitor`)."""
        monitor: zmq.Socket[bytes] = open_monitor(sock, events, zmq.Socket)  # plain: the watch's thread alone reads it
        return cls(monitor, owner, thread_setup, grace)

    def listening(self, port: int, routed: Callable[[str], bool]) -> None:
        """The ROUTER listens on TCP `port`; `routed(sender)` says whether a peer is routed here
        (read from this thread: it must not block).  From then on idle connections may be closed."""
        self.routed = routed
        self._port = port

    def spoke(self, fd: int, sender: str) -> None:
        """A frame of `sender` that passed every check came on the connection at descriptor `fd`
        (libzmq's, as the frame says: ``SRCFD``).  Never raises."""
        try:
            inode = os.fstat(fd).st_ino
        except OSError:
            return  # closed meanwhile
        with self._lock:
            self._book.spoke(inode, fd, sender, time.monotonic())

    def counts(self) -> dict[str, int]:
        """The totals so far (a copy; from any thread).  Never raises."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        """Stop the thread (within `POLL_MS` plus a batch; waits at most `JOIN_S`).  Call it
        before the context terminates: the thread closes the monitor socket.  Never raises."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(JOIN_S)
        if self._thread.is_alive():  # the context's termination ends its poll (ETERM)
            log.error("the connection monitor thread did not stop within %.0f s", JOIN_S)
        else:
            for fd in (self._null, self._slot):
                if fd is not None:
                    os.close(fd)
            self._null = self._slot = None

    def _run(self) -> None:
        sock = self._monitor
        try:
            if self._thread_setup is not None:
                try:
                    self._thread_setup()
                except Exception:  # the host's set-up: counting needs no device, so go on
                    log.exception("the connection monitor thread's set-up failed")
            while not self._stop.is_set():
                try:
                    if not sock.poll(POLL_MS):
                        if time.monotonic() - self._checked >= CHECK_EVERY:
                            self._relieve()
                        continue
                    read = self._batch(sock)
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.ETERM:  # the context is terminating
                        return
                    # any other error: read on, since a monitor left unread fills and then
                    # blocks libzmq's I/O thread, and with it every connection of the context
                    self._drops.note("monitor_error", f"the connection monitor could not read: {exc}")
                    read = BURST
                self._stop.wait(PAUSE if read >= BURST else GAP)
        finally:
            sock.close(linger=0)

    def _batch(self, sock: zmq.Socket[bytes]) -> int:
        """Read and count what the monitor holds (at most `BATCH` events); how many were read."""
        seen: Counter[int] = Counter()
        opened = closed = read = 0
        accepted: list[int] = []
        while read < BATCH:
            try:
                head = sock.recv(zmq.NOBLOCK)  # ZeroMQ's monitor message: event (u16), value (u32)
                sock.recv(zmq.NOBLOCK)  # and the endpoint, its second and last part
            except zmq.Again:
                break
            read += 1
            kind = int.from_bytes(head[:2], "little")
            if kind == zmq.EVENT_ACCEPTED:
                opened += 1
                accepted.append(int.from_bytes(head[2:6], "little"))  # its value: the descriptor
            elif kind == zmq.EVENT_DISCONNECTED:
                closed += 1
            elif kind in _EVENTS:
                seen[kind] += 1
        self.batches += 1
        with self._lock:
            counts = self._counts
            counts["connections_accepted"] += opened
            counts["connections_open"] = max(counts["connections_open"] + opened - closed, 0)
            for kind, n in seen.items():
                counts[_EVENTS[kind][0]] += n
            totals = {kind: counts[_EVENTS[kind][0]] for kind in seen}
        for kind, total in totals.items():
            name, detail = _EVENTS[kind]
            self._drops.note(name, f"{detail} ({total} so far)")
        now = time.monotonic()
        for fd in accepted:
            try:
                inode = os.fstat(fd).st_ino
            except OSError:
                continue  # closed already
            with self._lock:
                self._book.accepted(inode, fd, now)
        if accepted or zmq.EVENT_ACCEPT_FAILED in seen or now - self._checked >= CHECK_EVERY:
            self._relieve()
        return read

    def _relieve(self) -> None:
        """Forget the connections closed since; close idle ones while descriptors are short."""
        self._checked = time.monotonic()
        with self._lock:
            self._book.prune(_still_open)
        left, keep = descriptors_left(), keep_free()
        if left is not None and left < keep and self._port:
            self._close_idle(left, keep)

    def room(self) -> bool:
        """Whether a connection completing its handshake now may stay (asked by the ZAP handler,
        on the loop).  Yes while `keep_free()` descriptors are left.  When fewer are, idle
        connections are closed to make room; if any was closed now or within `PRESSURE_S`
        (connections that carry nothing are taking the descriptors), this one is refused: its
        descriptor comes back at once, where an accepted one would keep it, and a genuine peer's
        DEALER tries again by itself.  If none was, the descriptors are held by the peers this
        engine serves, and the connection stays: its Hello then gets the refusal that names the
        limit (`kvflow.runtime.descriptors`), which a peer refused at its handshake never sees.
        Never raises."""
        left, keep = descriptors_left(), keep_free()
        if left is None or left >= keep or not self._port:
            return True
        self._close_idle(left, keep)
        with self._lock:
            if not self._book.pressed(time.monotonic(), PRESSURE_S):
                return True
            self._counts["connections_refused_short"] += 1
            total = self._counts["connections_refused_short"]
        self._drops.note(
            "connections_refused_short",
            f"refused a connection at its handshake: {left} descriptors left (kept free: {keep}; {total} so far)",
        )
        return False

    def _close_idle(self, left: int, keep: int) -> None:
        """Close idle connections, in the book's order, until `keep` descriptors would be free."""
        with self._lock:
            victims = self._book.victims(time.monotonic(), self.routed)
        for inode, fd in victims:
            if left >= keep:
                break
            with self._slot_lock:
                shut = self._shut(fd, inode)
            if shut is None:
                return
            with self._lock:
                if shut:
                    self._book.gave_way(inode, time.monotonic())
                    self._counts["connections_closed_short"] += 1
                    total = self._counts["connections_closed_short"]
                else:
                    self._book.forget(inode)
            if shut:
                left += 1
                self._drops.note(
                    "connections_closed_short",
                    f"closed a connection that carries no peer's association: {left - 1} descriptors were left "
                    f"(kept free: {keep}; {total} so far)",
                )

    def _shut(self, fd: int, inode: int) -> bool | None:
        """Shut down the connection at `fd` if it still is the socket `inode` on the ROUTER's
        port; None when it could not look (no slot).  It looks through the watch's own slot
        descriptor, made a duplicate of `fd` (``dup2``: no new descriptor is taken, so a process
        with none left can still do it, and libzmq's accept, which takes every one freed, cannot
        take the slot), and made /dev/null again after."""
        null, slot = self._null, self._slot
        if null is None or slot is None:
            return None
        try:
            os.dup2(fd, slot, inheritable=False)
        except OSError:
            return False  # closed meanwhile
        try:
            if os.fstat(slot).st_ino != inode:
                return False
            conn = socket.socket(fileno=slot)
            try:
                if conn.getsockname()[1] != self._port:
                    return False
                conn.shutdown(socket.SHUT_RDWR)
                return True
            finally:
                conn.detach()  # the slot stays the watch's
        except (OSError, IndexError):  # not a socket, or not a TCP one
            return False
        finally:
            os.dup2(null, slot, inheritable=False)


def descriptors_left() -> int | None:
    """Descriptors this process may still open under its soft limit; None when it cannot tell
    (no ``/proc/self/fd``, or no limit).  Never raises."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        return soft - open_descriptors()
    except OSError as exc:
        return 0 if exc.errno in (errno.EMFILE, errno.ENFILE) else None  # listing it takes one too


def open_descriptors() -> int:
    """How many descriptors this process has open.  Linux (6.2 on) gives the count as the size
    of ``/proc/self/fd``: one ``stat``.  Listing the folder instead, the fallback, lets go of the
    interpreter's lock at each entry: with thousands open and another thread wanting the lock,
    one listing took seconds (a connection thread and the loop both counting, 1,100 peers).

    :raises OSError: ``/proc/self/fd`` cannot be read."""
    size = os.stat("/proc/self/fd").st_size
    return size if size > 0 else len(os.listdir("/proc/self/fd"))


def keep_free() -> int:
    """Descriptors the connection thread keeps free under this process's soft limit
    (`keep_free_for`).  Never raises."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return KEEP_FREE if soft == resource.RLIM_INFINITY else keep_free_for(soft)


def keep_free_for(limit: int) -> int:
    """Descriptors the connection thread keeps free under soft limit `limit`: `KEEP_FREE`, or a
    `KEEP_FREE_SHARE`th of a lower limit, at least `KEEP_FREE_FLOOR`; always more than a Hello
    wants, so that a peer whose connection got in is not refused for want of them.  Never raises."""
    return min(KEEP_FREE, max(limit // KEEP_FREE_SHARE, KEEP_FREE_FLOOR))


def _still_open(inode: int, fd: int) -> bool:
    try:
        return os.fstat(fd).st_ino == inode
    except OSError:
        return False


def _open_null() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def raise_descriptor_limit() -> None:
    """Raise this process's soft descriptor limit to its hard one (at most `DESCRIPTORS`), and
    log it when it did.  Never raises: a limit that cannot be raised is logged and kept."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = DESCRIPTORS if hard == resource.RLIM_INFINITY else min(hard, DESCRIPTORS)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.info(
                "raised the open-files limit from %d to %d: a connection flood holds one per connection", soft, target
            )
            soft = target
    except (OSError, ValueError) as exc:
        log.warning("cannot raise the open-files limit: %s", exc)
        return
    if soft < 4096:
        log.warning(
            "open-files limit %d: a stranger opening %d connections a second keeps every descriptor busy",
            soft,
            soft // 2,
        )
