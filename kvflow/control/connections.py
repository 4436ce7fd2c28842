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
"""

from __future__ import annotations

import logging
import resource
import threading
from collections import Counter
from collections.abc import Callable

import zmq

from kvflow.control.hardening import DropLog
from kvflow.control.monitor import open_monitor

__all__ = ("BURST", "DESCRIPTORS", "GAP", "PAUSE", "ConnectionWatch", "raise_descriptor_limit")

log = logging.getLogger("kvflow.control.zeromq")

POLL_MS = 100  # the thread's longest wait for an event: how soon it sees that it must stop
GAP = 0.01  # seconds between two batches
BURST = 200  # events in one batch (one `GAP`) that only libzmq's accept retries produce
PAUSE = 0.1  # seconds the thread waits after such a batch
BATCH = 4096  # events read at most in one batch
JOIN_S = 2.0  # how long close() waits for the thread
DESCRIPTORS = 1 << 16  # the soft limit is raised to the hard one, but not above this

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

    def __init__(self, monitor: zmq.Socket[bytes], owner: str, thread_setup: Callable[[], None] | None = None) -> None:
        """Starts the thread, which runs `thread_setup` first; `start` sets up the monitor first."""
        self._monitor = monitor
        self._thread_setup = thread_setup
        self._drops = DropLog(owner)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
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
    ) -> ConnectionWatch:
        """Monitor `events` of `sock` and count them on a new thread.

        :raises zmq.ZMQError: the monitor cannot be set up (out of descriptors); then `sock` is
            left unmonitored (`kvflow.control.monitor.open_monitor`)."""
        monitor: zmq.Socket[bytes] = open_monitor(sock, events, zmq.Socket)  # plain: the watch's thread alone reads it
        return cls(monitor, owner, thread_setup)

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
        return read


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
