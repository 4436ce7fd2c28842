"""Run an engine in a process of its own: the host's interpreter is not shared with kvflow.

Why: an inference engine's step loop is Python.  An engine on a thread of the host's process
(`EngineThread`) takes the host's GIL for everything it does in Python (the event loop, the
writer, NIXL's polling), and takes it in the middle of the host's steps: measured with
`kvflow bench host`, the steps of a host moving 100 transfers/s got 30 % fewer and up to 13 ms
longer at p99, far more than what its hooks cost.  `EngineProcess` runs the engine, its threads
and its transport in a child process; the host only copies orders into shared memory and reads
results from it.

The KV memory reaches the child as shared memory (host memory shared in place, GPU memory by
CUDA IPC handles or exported chunks' descriptors): `process_launch` starts the child with it.

The protocol: records, each a msgpack array of plain types.  The host's calls,
``["call", seq, name, args]`` (each runs `name` on the child's agent, which is the engine's own
API or an embedder's extension of it, `engine_agent.EngineAgent`; the engine's requests all go
through its one call ``submit``, in their wire form: `EngineProcess.submit`), go through a ring in shared
memory (`ring`, `ring_memory`), and the child's answers come back through another (a call's
result, blocks given back, the engine's figures, failures: `process_answers` keeps them until
the host reads them).  A hook's call costs a copy into the ring, and an eventfd write only when
the engine process sleeps and nobody has woken it yet; the host reads the answers on each step
with no system call, and a host step with nothing to do but wait for the engine may sleep on
them (`wait_for_answers`), woken by the engine process's eventfd write once per sleep.  The life
of the link goes over one Unix stream socket pair, in frames of a 4-byte big-endian length and a
msgpack array of records: the host's spec first (with the rings' descriptors), the child's
``["ready", address, pid]`` or ``["failed", ...]``, the host's ``["close"]``, the child's
``["closed", crashes]``.

The child exits when the host's end of the socket closes (the host died or closed it); the host
learns of a dead child from its socket too, looked at every `LIVENESS_CHECK` seconds (every
pending call then fails with `EngineCrashed`).  Every wait here has a deadline; nothing here
blocks a hook.

A child that lives but does not answer (stopped by a signal, frozen in a native call, starved of
CPU) is not seen from the socket, and each call the host makes meanwhile costs a future and a
record: 20,000 of them in 6 s of SIGSTOP before this bound.  So at most `max_unanswered` calls
may wait for their answers; past that, `call` refuses new work with `EngineBusy` (the vLLM
worker fails that request's load or hand-over at once, and vLLM frees its blocks), while a call
marked `always` (an abort, a release, the rest of a transfer the engine already took) still
goes: those are bounded by the work admitted before the bound, and refusing one would leave a
transfer or its blocks stranded.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import select
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from kvflow.errors import ConfigError, EngineBusy, EngineClosed, EngineCrashed, EngineTimeout, KVFlowError, RingCorrupt
from kvflow.protocol.actions import ReleaseBlocks
from kvflow.protocol.requests import Request
from kvflow.runtime.cuda_ipc import Share
from kvflow.runtime.cuda_vmm import Chunk
from kvflow.runtime.fd_passing import send_fds
from kvflow.runtime.frames import READ_CHUNK, FrameReader, encode_frame, encode_record, error_from_record
from kvflow.runtime.host_memory import SharedSpan
from kvflow.runtime.meter import MeterReading
from kvflow.runtime.process_answers import Answers
from kvflow.runtime.process_launch import launch
from kvflow.runtime.process_spec import SCHEDULING, ProcessSpec

__all__ = ("MAX_UNANSWERED", "SCHEDULING", "STALL_LIMIT", "EngineProcess", "ProcessSpec")

log = logging.getLogger(__name__)

LAZY_WAIT = 0.05  # seconds a lazy call may wait for another to go with before `pump` sends it
LIVENESS_CHECK = 0.05  # seconds between two looks at the socket (is the child still there?)
STALL_LIMIT = 1.0  # seconds a ring record may stay unreadable before the ring is taken as corrupt
# calls that may wait for the engine process's answer before new work is refused (a vLLM rank
# has a few per request it moves: thousands are a process that stopped answering)
MAX_UNANSWERED = 4096


class EngineProcess:
    """An engine in a child process, driven from any thread of the host without ever blocking
    it (but for `__init__` and `close`, which wait for the child with a deadline).

    `call` returns a `concurrent.futures.Future` at once; futures, released blocks and the
    meter are brought up to date by `pump`, which every reading method calls (it reads the
    ring of answers: no system call, but for a look at the socket every `LIVENESS_CHECK`).

    :raises ConfigError: a spec with an unknown `scheduling`, or `max_unanswered` below 1.
    :raises EngineTimeout: the child did not say ready within `start_timeout`.
    :raises KVFlowError: the child could not build or start its engine (the error it reported,
        by class); `TransportError` if the memory cannot be handed over.
    """

    def __init__(
        self,
        spec: ProcessSpec,
        spans: Sequence[SharedSpan],
        *,
        cuda_shares: Sequence[Share] = (),
        cuda_chunks: Sequence[Chunk] = (),
        start_timeout: float = 60.0,
        max_unanswered: int = MAX_UNANSWERED,
    ) -> None:
        """`spans`: the host memory of the layout's DRAM regions; `cuda_shares`: the exported
        allocations (`cuda_ipc`) holding its VRAM regions, or `cuda_chunks` the exported chunks
        (`cuda_vmm`; the caller keeps its descriptors); `max_unanswered`: see the module's
        header."""
        if spec.scheduling not in SCHEDULING:
            raise ConfigError(f"an engine process is scheduled as one of {list(SCHEDULING)}, not {spec.scheduling!r}")
        if type(max_unanswered) is not int or max_unanswered < 1:
            raise ConfigError(f"an engine process's max_unanswered must be an integer >= 1, not {max_unanswered!r}")
        self.max_unanswered = max_unanswered
        self.refused_busy = 0  # calls refused with EngineBusy
        self._refusing = False  # refusing since the last call admitted (logged once a stall)
        self.engine_id = spec.engine_id
        self._lock = threading.RLock()
        self._seq = 0
        self._futures: dict[int, concurrent.futures.Future[Any]] = {}
        self._pending: list[bytes] | None = None  # the calls of an open `batch`, packed
        self._lazy: list[bytes] = []  # calls that go with the next one sent
        self._lazy_since = 0.0  # when the oldest of them was made
        self._backlog: deque[bytes] = deque()  # records the ring had no room for yet, in order
        self._looked = 0.0  # when `pump` last looked at the socket
        self.wakeups = 0  # eventfd writes made to wake the engine process
        self.woken = 0  # sleeps of `wait_for_answers` the engine process ended with its eventfd
        self._reader = FrameReader()
        self._answers = Answers(self.engine_id)  # what the child said, until the host reads it
        self.dead: str | None = None  # why the child is gone, once it is
        self.proc, self._sock, self._rings, wire = launch(spec, spans, cuda_shares, cuda_chunks)
        try:
            self._sock.sendall(encode_frame(wire))
            ready = self._wait_for(("ready", "failed"), start_timeout, "start")
        except BaseException:
            self._kill()
            raise
        if ready[0] == "failed":
            self._kill()
            raise error_from_record(ready[1:])
        self._sock.setblocking(False)
        self.address: str = str(ready[1])
        self.pid: int = int(ready[2])

    # ---------------------------------------------------------------- calls

    def call(self, name: str, *args: Any, lazy: bool = False, always: bool = False) -> concurrent.futures.Future[Any]:
        """Run the agent's `name` with `args` (plain data) in the engine process; returns at
        once.  Inside `batch`, the call is sent when the batch ends; a `lazy` one waits for the
        next call that is not (or a `pump` at least `LAZY_WAIT` later): a call that may wait
        costs no system call (and no wake-up of the engine process) of its own.  An `always`
        call (one that ends, frees or continues work the engine took) is never refused as busy.

        :raises EngineClosed: the engine process is gone or closing.
        :raises EngineBusy: `max_unanswered` calls wait for their answers and this one is not
            `always` (nothing is sent).
        :raises ConfigError: `args` hold a value msgpack cannot carry, or more than a ring
            record holds (nothing is sent).
        """
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self.dead is not None:
                raise EngineClosed(f"engine process of {self.engine_id!r} is gone: {self.dead}")
            if not always:
                self._admit(name)
            record = encode_record(["call", self._seq + 1, name, list(args)])
            if len(record) > self._rings.orders.max_record:
                raise ConfigError(
                    f"cannot send {name!r} to the engine process: {len(record)} bytes, "
                    f"more than its ring's {self._rings.orders.max_record}"
                )
            self._seq += 1
            self._futures[self._seq] = future
            if lazy:
                if not self._lazy:
                    self._lazy_since = time.monotonic()
                self._lazy.append(record)
            elif self._pending is not None:
                self._pending.append(record)
            else:
                self._send([record])
        return future

    def submit(self, request: Request, *, lazy: bool = False, always: bool = False) -> concurrent.futures.Future[None]:
        """`call` of the agent's door for the engine's requests (`EngineAgent.submit`) with
        `request`'s wire form: the engine process takes its type from the form's tag.
        :raises EngineClosed, EngineBusy, ConfigError: see `call`."""
        return self.call("submit", request.to_wire(), lazy=lazy, always=always)

    def _admit(self, name: str) -> None:
        """:raises EngineBusy: see `call`."""
        if len(self._futures) < self.max_unanswered:
            if self._refusing:
                self._refusing = False
                log.warning("%s: the engine process answers again; new work is taken", self.engine_id)
            return
        self.refused_busy += 1
        if not self._refusing:
            self._refusing = True
            log.error("%s: the engine process has not answered %d calls (stopped or frozen?): new work is refused "
                      "until it does", self.engine_id, len(self._futures))  # fmt: skip
        raise EngineBusy(
            f"engine process of {self.engine_id!r} owes answers to {len(self._futures)} calls "
            f"(max_unanswered {self.max_unanswered}): {name!r} refused"
        )

    def send_fds(self, fds: Sequence[int], timeout: float = 5.0) -> None:
        """Hand `fds` to the engine process (the caller keeps its own), for the next call that
        takes descriptors (`engine_process.Server`: ``restore_memory`` of exported GPU chunks).

        :raises EngineClosed: the engine process is gone.
        :raises EngineTimeout, TransportError, ConfigError: see `fd_passing.send_fds`.
        """
        with self._lock:
            if self.dead is not None:
                raise EngineClosed(f"engine process of {self.engine_id!r} is gone: {self.dead}")
            send_fds(self._sock, encode_frame([["fds", len(fds)]]), fds, timeout)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """The calls made inside go out together when it ends (at most one wake-up of the
        engine process for them all).  Nested batches join the outer one.  Never raises."""
        with self._lock:
            if self._pending is not None:
                yield
                return
            self._pending = []
        try:
            yield
        finally:
            with self._lock:
                records, self._pending = self._pending, None
                if records and self.dead is None:
                    self._send(records)

    def _send(self, records: list[bytes]) -> None:
        """Put records in the ring (the lazy calls first, in their order), wake the engine
        process if it sleeps; what the ring has no room for waits for `pump`, in order."""
        if self._lazy:
            records, self._lazy = self._lazy + records, []
        self._backlog.extend(records)
        self._write_backlog()

    def _write_backlog(self) -> None:
        orders = self._rings.orders
        try:
            while self._backlog and orders.write(self._backlog[0]):
                self._backlog.popleft()
            if orders.unread() and orders.wake_owed():  # also a wake-up an earlier pass missed
                self.wakeups += 1
                self._rings.wake()
        except RingCorrupt as exc:
            self._gone(f"its ring is corrupt: {exc}")

    # ---------------------------------------------------------------- results

    def pump(self) -> None:
        """Read whatever the child said (never blocks): resolve calls, queue released blocks,
        gather the meter; a closed socket means the child is gone.  Lazy calls waiting longer
        than `LAZY_WAIT`, and calls the ring had no room for, go out now."""
        with self._lock:
            if self.dead is not None:
                return
            now = time.monotonic()
            if self._lazy and now - self._lazy_since >= LAZY_WAIT:
                self._send([])
            elif self._backlog or self._rings.orders.unread():
                self._write_backlog()
            self._read_answers(now)
            if now - self._looked >= LIVENESS_CHECK:
                self._looked = now
                self._read_socket()

    def _read_answers(self, now: float) -> None:
        """Take every record the ring holds; one that stays unreadable for `STALL_LIMIT` means the ring is corrupt."""
        answers = self._rings.answers
        try:
            records = answers.read()
        except RingCorrupt as exc:
            self._gone(f"its ring is corrupt: {exc}")
            return
        self._answers.take_payloads(records, self._futures)
        if answers.stalled_for(now) > STALL_LIMIT:
            self._gone(f"its ring is corrupt: a record at {answers.position} stayed unreadable for {STALL_LIMIT}s")

    def _read_socket(self) -> None:
        """Whether the child is still there (its socket's end of file), and what it said there."""
        while self.dead is None:
            try:
                count, frames = self._reader.read(self._sock)
            except BlockingIOError:
                break
            except OSError as exc:
                self._gone(f"its socket broke: {exc}")
                break
            if not count:
                self._read_answers(time.monotonic())  # what it said before it went
                self._gone(self._exit_status())
                break
            for frame in frames:
                for record in frame:
                    self._answers.take(record, self._futures)
            if count < READ_CHUNK:  # the socket is drained (what comes meanwhile waits for the next pump)
                break

    def wait(self, future: concurrent.futures.Future[Any], timeout: float) -> Any:
        """Block until a call's `future` is settled, reading what the child sends meanwhile
        (released blocks stay queued for `poll_released`); its result.

        :raises EngineTimeout: not settled within `timeout` seconds.
        :raises EngineClosed: the engine process is gone.
        :raises KVFlowError: what the call raised in the engine process.
        """
        deadline = time.monotonic() + timeout
        nap = 0.0005  # answers come through the ring, which nothing signals: look again soon, then less often
        while not future.done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineTimeout(f"engine process of {self.engine_id!r}: no answer within {timeout}s")
            if self.dead is not None:
                raise EngineClosed(f"engine process of {self.engine_id!r} is gone: {self.dead}")
            time.sleep(min(left, nap))
            nap = min(nap * 2, 0.02)
            self.pump()
        return future.result()

    def wait_for_answers(self, timeout: float) -> bool:
        """Sleep until the engine process says something (a call's answer, released blocks, its
        figures) or `timeout` seconds pass, whichever is first; whether it said anything.  For a
        host with nothing to do until then: the engine process wakes it with one eventfd write
        per sleep.  Never raises (a dead engine process is seen by the next call, as ever)."""
        self.pump()
        answers = self._rings.answers
        if self.dead is not None or self._answers.released or answers.pending():
            return True
        answers.sleep()
        try:
            if not answers.pending():  # written just before the sleep was announced: no wake-up comes
                with contextlib.suppress(OSError, ValueError):  # an fd closed meanwhile: the link is closing
                    readable, _, _ = select.select([self._rings.host_wake_fd], [], [], max(0.0, timeout))
                    self.woken += bool(readable)
        finally:
            answers.wake()
            self._rings.take_wake()
        said = answers.pending()
        self.pump()
        return said or bool(self._answers.released)

    def poll_released(self) -> list[ReleaseBlocks]:
        """Blocks the engine gave back since the last call (never blocks)."""
        self.pump()
        with self._lock:
            return self._answers.take_released()

    def meter_take(self) -> MeterReading:
        """The engine's per-transfer figures gathered since the last call (by `pump`, which the
        host calls each step for its results; never blocks)."""
        with self._lock:
            return self._answers.meter_take()

    @property
    def crashes(self) -> list[str]:
        """What the child reported as bugs in it."""
        return self._answers.crashes

    # ---------------------------------------------------------------- lifecycle

    def close(self, timeout: float = 30.0) -> None:
        """Close the engine (it drains, as `Engine.aclose`) and wait for the process to end; at
        most `timeout` seconds, then it is killed.

        :raises EngineCrashed: the engine process reported failures, or did not close in time.
        """
        with self._lock:
            alive = self.dead is None
            if alive:
                self._write_backlog()  # the child reads its ring to the end before it closes
                self._sock.setblocking(True)
                with contextlib.suppress(OSError):
                    self._sock.sendall(encode_frame([["close"]]))
        late = False
        if alive:
            with contextlib.suppress(KVFlowError):
                self._wait_for(("closed",), timeout, "close")
            try:
                self.proc.wait(timeout=max(1.0, timeout / 4))
            except subprocess.TimeoutExpired:
                late = True
        with self._lock:
            self._gone("closed")
        self._kill()
        if self.crashes or late:
            reasons: list[BaseException] = [RuntimeError(text) for text in self.crashes]
            if late:
                reasons.append(RuntimeError(f"engine process did not exit within {timeout}s"))
            raise EngineCrashed(reasons)

    def _wait_for(self, kinds: tuple[str, ...], timeout: float, what: str) -> list[Any]:
        """Block (the socket in blocking mode) until a record of `kinds` comes; the others are taken.

        :raises EngineTimeout: none within `timeout`.
        :raises EngineCrashed: the process ended first.
        """
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineTimeout(f"engine process of {self.engine_id!r} did not {what} within {timeout}s")
            with self._lock:
                if self.dead is None:
                    self._write_backlog()
                    self._read_answers(time.monotonic())  # the child's last answers may wait for room in the ring
            readable, _, _ = select.select([self._sock], [], [], min(left, 0.01))
            if not readable:
                if self.proc.poll() is not None:
                    raise EngineCrashed([RuntimeError(f"engine process did not {what}: {self._exit_status()}")])
                continue
            try:
                count, frames = self._reader.read(self._sock)
            except OSError as exc:  # e.g. a reset: the process went away with our bytes unread
                raise EngineCrashed([RuntimeError(f"engine process did not {what}: {exc!r}")]) from exc
            if not count:
                raise EngineCrashed([RuntimeError(f"engine process did not {what}: {self._exit_status()}")])
            for frame in frames:
                for record in frame:
                    if record[0] in kinds:
                        return list(record)
                    self._answers.take(record, self._futures)

    def _exit_status(self) -> str:
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "its socket closed (the process still runs)"
        return f"it exited with status {code}"

    def _gone(self, why: str) -> None:
        """The child is gone: every pending call fails."""
        if self.dead is not None:
            return
        self.dead = why
        failure = EngineCrashed([RuntimeError(f"engine process of {self.engine_id!r} is gone: {why}")])
        for future in self._futures.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(failure)
        self._futures.clear()
        if why != "closed":
            log.error("%s: engine process is gone: %s", self.engine_id, why)

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5.0)
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            if self.dead is None:
                self.dead = "killed"
            self._rings.close()

    @property
    def alive(self) -> bool:
        return self.dead is None and self.proc.poll() is None

    def __del__(self) -> None:  # a host that forgot close: no orphan
        with contextlib.suppress(Exception):
            if self.proc.poll() is None:
                self.proc.kill()
