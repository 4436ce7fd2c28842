"""The engine process: an `Engine` serving its host over a socket (see `kvflow.runtime.process`).

Why a program of its own: the host's interpreter stays the host's.  Here the engine runs on
this process's event loop (uvloop when installed) with its writer, its transport's threads and
its control channel; the host's calls arrive as records in a ring of shared memory (the loop
wakes on an eventfd when the host finds it asleep, and looks at the ring every `RING_LOOK` in
case a wake-up was missed), run on an agent in arrival order (each to its first wait, as
`EngineThread` runs them), and their results, released blocks and per-transfer figures go back
through the other ring, written once per pass of the loop.  A record that is not a call the
agent has is refused (answered with `UsageError` when it names a call) and counted; a ring
that stays unreadable is corrupt, and the engine closes as if its host had gone.

The agent is the engine's API as commands (`kvflow.runtime.engine_agent.EngineAgent`, or an
embedder's extension of it, named in the host's spec); only the names it lists can be called.

Lifetime: the process ends when the host says close, or when its end of the socket closes (the
host died): the engine is closed as `Engine.aclose` does (abort, fence, release), within
`SHUTDOWN_TIMEOUT`.  Interrupts (Ctrl-C reaches the host's whole process group) are ignored:
the host decides.  Run as ``python -m kvflow.runtime.engine_process FD``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import socket
import sys
import time
import traceback
from typing import Any

import msgpack

from kvflow.control.zeromq import ZmqControl
from kvflow.errors import ConfigError, KVFlowError, RingCorrupt
from kvflow.layout import MemoryType, Region, layout_from_wire
from kvflow.protocol.actions import ReleaseBlocks
from kvflow.protocol.admission import PeerAllowList
from kvflow.protocol.core import CoreConfig
from kvflow.runtime.bell import Bell
from kvflow.runtime.config import EngineConfig
from kvflow.runtime.cuda_ipc import OpenedShares
from kvflow.runtime.cuda_vmm import ImportedChunks, chunks_from_wire, open_gpu_memory
from kvflow.runtime.engine import Engine
from kvflow.runtime.engine_agent import EngineAgent, agent_class
from kvflow.runtime.fd_passing import FdInbox
from kvflow.runtime.frames import FrameReader, decode_record, encode_frame, encode_record, error_record
from kvflow.runtime.host_memory import MappedSpans
from kvflow.runtime.loop import new_event_loop
from kvflow.runtime.process import STALL_LIMIT
from kvflow.runtime.results import TransferResult
from kvflow.runtime.ring_memory import EngineRings
from kvflow.transports.registry import load_transport

__all__ = ("SHUTDOWN_TIMEOUT", "main")

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT = 20.0
PARENT_CHECK = 1.0  # seconds between two looks at whether the host is still this process's parent
RING_LOOK = 0.05  # seconds between two looks at the ring of orders without a wake-up
# After orders came, the loop keeps looking at the ring this long (every `RING_POLL`) before it
# says it sleeps: a prefill step's layer groups come a few milliseconds apart, and each found
# asleep would cost the host a wake-up (on a busy host, its core for a while)
RING_LINGER = 0.005
RING_POLL = 0.001  # ... and after a record not yet whole
RING_RETRY = 0.001  # seconds before a ring of answers that had no room is tried again


class Server:
    """One engine and its agent, serving the host on `sock`."""

    def __init__(self, sock: socket.socket, spec: dict[str, Any]) -> None:
        self.sock = sock
        self.spec = spec
        self.engine: Engine | None = None
        self.agent: EngineAgent | None = None
        self._reader = FrameReader()
        self._out: list[Any] = []
        self._backlog: list[bytes] = []  # answers the ring had no room for yet, in order
        self._flush_scheduled = False
        self._awake_until = 0.0  # the loop's time until which it looks at the ring without being woken
        self._look_due = False  # a look at the ring is scheduled within `RING_POLL`
        self.refused_records = 0  # orders that were not calls of the agent
        self.rings: EngineRings | None = None
        self.gpu: OpenedShares | ImportedChunks | None = None  # the host's GPU memory, when the layout has some
        self.inbox = FdInbox()  # descriptors the host sent since start, for the call that takes them
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing: asyncio.Future[None] | None = None
        # the host's scheduler may sleep until its workers have news: rung once what it would
        # act on (blocks given back, a failed call) is in the ring (`kvflow.runtime.bell`)
        self._bell = Bell(spec["bell"]) if spec.get("bell") else None
        self._ring_owed = False

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._closing = loop.create_future()
        try:
            engine = self._build()
            await engine.start()
            self.agent = agent_class(self.spec["agent"])(engine, **self.spec["agent_options"])
        except KVFlowError as exc:
            self.sock.setblocking(True)
            self.sock.sendall(encode_frame([["failed", *error_record(exc)]]))
            if self.engine is not None:
                with contextlib.suppress(KVFlowError):
                    await self.engine.aclose(drain_timeout=0.1)
            return 1
        gc.collect()
        gc.freeze()  # what start-up made lives as long as the process: the collector skips it
        self.sock.sendall(encode_frame([["ready", engine.control.address, os.getpid()]]))
        self.sock.setblocking(False)
        loop.add_reader(self.sock.fileno(), self._readable)
        loop.add_reader(self._ends().wake_fd, self._woken)
        # the host's pid, not `os.getppid()` now: the host may have died since it forked us
        self._watch_parent(int(self.spec["host_pid"]))
        self._look()
        await self._closing
        loop.remove_reader(self._ends().wake_fd)
        loop.remove_reader(self.sock.fileno())
        self.agent.close()
        crashes: list[str] = []
        try:
            drain = min(engine.config.drain_timeout, SHUTDOWN_TIMEOUT / 2)  # the host asked for less, or this
            await asyncio.wait_for(engine.aclose(drain_timeout=drain), SHUTDOWN_TIMEOUT)
        except KVFlowError as exc:
            crashes.append(f"{type(exc).__name__}: {exc}")
        except TimeoutError:
            crashes.append(f"the engine did not close within {SHUTDOWN_TIMEOUT}s")
        if self.gpu is not None:
            self.gpu.close()
        self._say_closed(crashes)
        if self._bell is not None:
            self._bell.close()
        return 0 if not crashes else 1

    def _build(self) -> Engine:
        """:raises KVFlowError: the memory, transport or control channel cannot be set up."""
        spec = self.spec
        self.rings = EngineRings(*spec["rings"])
        mapped = MappedSpans([tuple(span) for span in spec["spans"]])
        self.mapped = mapped  # the mappings live as long as the engine
        gpu = self.gpu = open_gpu_memory(spec)

        def place(region: Region) -> Region:
            return (
                gpu.translate(region)
                if gpu is not None and region.memory is MemoryType.VRAM
                else mapped.translate(region)
            )

        layout = layout_from_wire(spec["layout"])
        layout = dataclasses.replace(layout, regions=tuple(place(r) for r in layout.regions))
        raw = dict(spec["config"])
        allowed = PeerAllowList(tuple(raw["allowed_peers"]["engines"]), tuple(raw["allowed_peers"]["networks"]))
        config = EngineConfig(**{**raw, "core": CoreConfig(**raw["core"]), "allowed_peers": allowed})
        options = dict(spec["transport_options"])
        if gpu is not None:  # every thread that touches the memory (the engine's, NIXL's) on its GPU
            gpu.bind()
            config = dataclasses.replace(config, thread_setup=gpu.bind)
            options.update(cuda=True, thread_setup=gpu.bind)
        transport = load_transport(spec["transport"])(spec["engine_id"], **options)
        control = ZmqControl(spec["engine_id"], bind=spec["bind"])
        self.engine = Engine(
            spec["engine_id"], layout, transport, control, config=config, on_release=self._released, on_end=self._ended
        )
        return self.engine

    def _ends(self) -> EngineRings:
        assert self.rings is not None  # made by `_build`, before anything reads or writes them
        return self.rings

    # ---------------------------------------------------------------- from the host

    def _woken(self) -> None:
        self._ends().take_wake()
        self._drain()

    def _look(self) -> None:
        """The ring every `RING_LOOK` seconds, whether or not the host woke us."""
        if self._closing is None or self._closing.done():
            return
        self._drain()
        asyncio.get_running_loop().call_later(RING_LOOK, self._look)

    def _drain(self) -> None:
        """Obey every order in the ring; keep looking for `RING_LINGER` after the last one;
        then say we sleep, and look once more (an order written meanwhile may have found us
        awake and not woken us)."""
        loop = asyncio.get_running_loop()
        orders = self._ends().orders
        orders.wake()
        try:
            while True:
                records = orders.read()
                for payload in records:
                    self._obey_packed(payload)
                if orders.stalled:
                    self._stalled()
                    return
                if records:
                    self._awake_until = loop.time() + RING_LINGER
                if loop.time() < self._awake_until:
                    self._look_soon()
                    return
                orders.sleep()
                if not orders.pending():
                    return
                orders.wake()
        except RingCorrupt as exc:
            log.error("engine process: %s; closing", exc)
            self._close()

    def _look_soon(self) -> None:
        """Look at the ring again within `RING_POLL` (once, however many ask meanwhile)."""
        if not self._look_due:
            self._look_due = True
            asyncio.get_running_loop().call_later(RING_POLL, self._look_now)

    def _look_now(self) -> None:
        self._look_due = False
        if self._closing is not None and not self._closing.done():
            self._drain()

    def _stalled(self) -> None:
        """A record not (yet) whole: look again soon; one that stays so means the ring is corrupt."""
        orders = self._ends().orders
        if orders.stalled_for(asyncio.get_running_loop().time()) > STALL_LIMIT:
            log.error(
                "engine process: an order at %d stayed unreadable for %ss: the ring is corrupt",
                orders.position,
                STALL_LIMIT,
            )
            self._close()
            return
        self._look_soon()

    def _obey_packed(self, payload: bytes) -> None:
        try:
            record = decode_record(payload)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            self._refuse(None, f"an order that is not msgpack ({exc})")
            return
        if record == ["close"]:  # the host says that on the socket, after what it ordered here
            self._refuse(None, "a close in the ring")
            return
        self._obey(record)

    def _refuse(self, seq: object, why: str) -> None:
        self.refused_records += 1
        log.error("engine process: refused %s", why)
        if isinstance(seq, int) and not isinstance(seq, bool):
            self._queue(["done", seq, ["UsageError", f"the engine process refused {why}"], None])

    def _readable(self) -> None:
        while True:
            try:
                count, frames = self._reader.read(self.sock, self.inbox)
            except BlockingIOError:
                return
            except OSError:
                count, frames = 0, []
            except KVFlowError as exc:
                log.error("engine process: %s", exc)
                self._close()
                return
            if not count:  # the host is gone
                self._close()
                return
            for frame in frames:
                for record in frame:
                    self._obey(record)

    def _obey(self, record: Any) -> None:
        if record == ["close"]:
            self._drain()  # what the host ordered before it said close
            self._close()
            return
        if isinstance(record, list) and len(record) == 2 and record[0] == "fds":
            return  # descriptors came with it: into the inbox, for the call that takes them
        if not (isinstance(record, list) and len(record) == 4 and record[0] == "call"):
            self._refuse(record[1] if isinstance(record, list) and len(record) > 1 else None, f"{record!r:.100}")
            return
        _, seq, name, args = record
        assert self.agent is not None
        if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(args, list):
            self._refuse(seq, f"a call with sequence number {seq!r:.40} and arguments {args!r:.60}")
            return
        if not isinstance(name, str) or name not in self.agent.COMMANDS:
            self._queue(["done", seq, ["UsageError", f"the engine process has no command {name!r:.80}"], None])
            return
        # the memory's own commands: the engine's, and what this process maps of the host's GPU memory
        mine = name in ("unregister_memory", "restore_memory")
        method = getattr(self, "_" + name) if mine else getattr(self.agent, name)
        news = name in getattr(self.agent, "NEWS", ())
        task = asyncio.get_running_loop().create_task(self._call(seq, method, args, news))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(self, seq: int, method: Any, args: list[Any], news: bool = False) -> None:
        """Run one call and queue its answer; a failure, or the answer of a call that is `news`,
        rings the host's bell."""
        try:
            result = await method(*args)
        except KVFlowError as exc:
            self._ring_owed = True
            self._queue(["done", seq, error_record(exc), None])
        except Exception as exc:  # a bug: the call fails, the host hears of it, the engine goes on
            text = "".join(traceback.format_exception_only(exc)).strip()
            log.error("engine process: %s failed", getattr(method, "__name__", method), exc_info=exc)
            self._ring_owed = True
            self._queue(["done", seq, ["EngineCrashed", text], None])
            self._queue(["crashed", [text]])
        else:
            self._ring_owed = self._ring_owed or news
            self._queue(["done", seq, None, result])

    async def _unregister_memory(self) -> None:
        """The engine lets go of the memory; then this process's mapping of exported GPU chunks
        goes, or it would keep the physical memory the host is about to release.
        :raises KVFlowError: see `Engine.unregister_memory`."""
        assert self.agent is not None
        await self.agent.unregister_memory()
        if isinstance(self.gpu, ImportedChunks):
            self.gpu.unmap()

    async def _restore_memory(self, chunks: Any = None) -> None:
        """Exported GPU chunks come back (`chunks`, their descriptors sent before the call) and
        are mapped where they were; then the engine registers the memory again.
        :raises ConfigError: chunks given where none are mapped, or missing where they are.
        :raises KVFlowError: see `ImportedChunks.remap`, `Engine.restore_memory`."""
        assert self.agent is not None
        if isinstance(self.gpu, ImportedChunks) != (chunks is not None):
            raise ConfigError("exported GPU chunks come back to the engine process that maps them, and only there")
        if isinstance(self.gpu, ImportedChunks):
            count = len(chunks) if isinstance(chunks, list) else 0
            fds = self.inbox.take(count, refill=self._readable)
            try:
                back = chunks_from_wire(chunks, fds)
            except ConfigError:
                for fd in fds:
                    os.close(fd)
                raise
            self.gpu.remap(back)
        await self.agent.restore_memory()

    def _close(self) -> None:
        self.inbox.close()
        if self._closing is not None and not self._closing.done():
            self._closing.set_result(None)

    def _watch_parent(self, parent: int) -> None:
        """Close once this process's parent is not `parent` any more (the host died and the
        process was handed to another): the host's socket closing says so first, this says
        so when something kept it open (a child the host started with it, say)."""
        if os.getppid() != parent:
            log.error("engine process: its host (pid %d) is gone", parent)
            self._close()
            return
        asyncio.get_running_loop().call_later(PARENT_CHECK, self._watch_parent, parent)

    # ---------------------------------------------------------------- to the host

    def _released(self, release: ReleaseBlocks) -> None:
        key = release.key
        self._ring_owed = True
        self._queue(
            ["released", key.transfer_id, key.epoch, release.role.value, release.outcome.value, release.block_ids]
        )

    def _ended(self, _: TransferResult) -> None:
        """A transfer ended (its outcome goes in the meter's next record): its failure, and
        the gauges it moves (quarantined blocks, a peer's teardown), reach the host's scheduler
        at its next step, which the bell starts when it sleeps."""
        if self._bell is not None:
            self._ring_owed = True
            self._queue_flush()

    def _queue(self, record: list[Any]) -> None:
        self._out.append(record)
        self._queue_flush()

    def _queue_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Everything queued (with the meter's news) into the ring of answers, as far as it has room."""
        self._flush_scheduled = False
        if self.engine is not None:
            reading = self.engine.meter.take()
            if reading.samples or reading.outcomes or reading.dropped:
                samples = [[s.seconds, s.post_seconds, s.nbytes, s.descriptors] for s in reading.samples]
                self._out.append(["meter", samples, reading.outcomes, reading.dropped])
        for record in self._out:
            try:
                self._backlog.append(encode_record(record))
            except KVFlowError as exc:  # a result msgpack cannot carry: the call fails instead
                log.error("engine process: %s", exc)
                if record[0] == "done":
                    self._backlog.append(encode_record(["done", record[1], error_record(exc), None]))
        self._out = []
        if self._write_backlog():
            asyncio.get_running_loop().call_later(RING_RETRY, self._flush)

    def _write_backlog(self) -> bool:
        """Write what the ring takes; whether some is left."""
        answers, written = self._ends().answers, 0
        try:
            for packed in self._backlog:
                if len(packed) > answers.max_record:
                    log.error(
                        "engine process: an answer of %d bytes exceeds the ring's %d: dropped: %r",
                        len(packed),
                        answers.max_record,
                        packed[:80],
                    )
                elif not answers.write(packed):
                    break
                written += 1
        except RingCorrupt as exc:
            log.error("engine process: %s; closing", exc)
            self._close()
        del self._backlog[:written]
        if answers.unread() and answers.wake_owed():  # the host sleeps on its ring (also a wake-up missed before)
            self._ends().wake_host()
        if self._ring_owed and not self._backlog and self._bell is not None:
            self._ring_owed = False
            self._bell.ring()
        return bool(self._backlog)

    def _say_closed(self, crashes: list[str]) -> None:
        """The last answers into the ring (the host reads them while it waits), then ``closed`` on the socket."""
        self._flush_scheduled = False
        self._flush()
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT / 4
        while self._write_backlog() and time.monotonic() < deadline:
            time.sleep(RING_RETRY)
        self.sock.setblocking(True)
        with contextlib.suppress(OSError):
            self.sock.sendall(encode_frame([["closed", crashes]]))


def _read_spec(sock: socket.socket) -> dict[str, Any]:
    reader = FrameReader()
    while True:
        data = sock.recv(1 << 20)
        if not data:
            raise SystemExit(2)  # the host went away before saying what to run
        frames = reader.feed(data)
        if frames:
            spec: dict[str, Any] = frames[0]
            return spec


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host stops us, not the terminal
    sock = socket.socket(fileno=int(argv[0]))
    spec = _read_spec(sock)
    if spec.get("cpus"):  # before any thread starts: every thread of the engine runs there
        os.sched_setaffinity(0, spec["cpus"])
    if spec.get("scheduling", "batch") == "batch":  # before any thread starts: they inherit it
        with contextlib.suppress(OSError, AttributeError):  # not Linux: the default policy
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    logging.basicConfig(
        level=int(spec.get("log_level", logging.WARNING)),
        format=f"%(asctime)s %(levelname)s kvflow engine process {spec.get('engine_id')} (pid {os.getpid()}): "
        "%(name)s: %(message)s",
    )
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(Server(sock, spec).run())
    finally:
        loop.close()


if __name__ == "__main__":  # run the importable module's main, not this copy's: its logger is the module's
    from kvflow.runtime.engine_process import main as module_main

    sys.exit(module_main())
