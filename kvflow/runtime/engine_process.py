"""The engine process: an `Engine` serving its host over a socket (see `kvflow.runtime.process`).

Why a program of its own: the host's interpreter stays the host's.  Here the engine runs on
this process's event loop (uvloop when installed) with its writer, its transport's threads and
its control channel; the host's calls arrive as records on the socket, run on an agent in
arrival order (each to its first wait, as `EngineThread` runs them), and their results,
released blocks and per-transfer figures go back in one frame per pass of the loop.

The agent is the engine's API as commands (`EngineAgent`); an embedder extends it with its own
commands (vLLM's connector: `kvflow.integrations.vllm.rank_agent`).  Only the names an agent
lists in `COMMANDS` can be called.

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
import importlib
import logging
import os
import signal
import socket
import sys
import traceback
from typing import Any, ClassVar

from kvflow.control.zeromq import ZmqControl
from kvflow.errors import ConfigError, KVFlowError
from kvflow.layout import layout_from_wire
from kvflow.protocol.actions import ReleaseBlocks
from kvflow.protocol.admission import PeerAllowList
from kvflow.protocol.core import CoreConfig
from kvflow.protocol.state import Mode, Role
from kvflow.runtime.config import EngineConfig
from kvflow.runtime.engine import Engine
from kvflow.runtime.host_memory import MappedSpans
from kvflow.runtime.loop import new_event_loop
from kvflow.runtime.process import FrameReader, encode_frame, error_record
from kvflow.transports.registry import load_transport

__all__ = ("SHUTDOWN_TIMEOUT", "EngineAgent", "main")

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT = 20.0
PARENT_CHECK = 1.0  # seconds between two looks at whether the host is still this process's parent


class EngineAgent:
    """The engine's API as commands the host may call (arguments and results plain data)."""

    COMMANDS: ClassVar[frozenset[str]] = frozenset(
        {"connect", "expect", "kv_ready", "abort", "promise", "stats", "unregister_memory", "restore_memory"}
    )

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def connect(self, peer: str, address: str = "") -> None:
        await self.engine.connect(peer, address)

    async def expect(self, transfer_id: str, epoch: int, peer: str, block_ids: list[int], mode: str = "push") -> None:
        await self.engine.expect(transfer_id, epoch, peer=peer, block_ids=block_ids, mode=Mode(mode))

    async def kv_ready(
        self, transfer_id: str, epoch: int, block_ids: list[int], mode: str = "push", peer: str | None = None
    ) -> None:
        await self.engine.kv_ready(transfer_id, epoch, block_ids=block_ids, mode=Mode(mode), peer=peer)

    async def abort(self, transfer_id: str, epoch: int, role: str, reason: str = "aborted by caller") -> None:
        await self.engine.abort(transfer_id, epoch, Role(role), reason)

    async def promise(self, transfer_id: str, epoch: int, peer: str) -> None:
        await self.engine.promise(transfer_id, epoch, peer=peer)

    async def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    async def unregister_memory(self) -> None:
        """:raises KVFlowError: see `Engine.unregister_memory`."""
        await self.engine.unregister_memory()

    async def restore_memory(self) -> None:
        """:raises KVFlowError: see `Engine.restore_memory`."""
        await self.engine.restore_memory()

    def close(self) -> None:
        """The engine is about to close: let go of anything the agent runs itself."""


def _agent_class(path: str) -> type[EngineAgent]:
    """:raises ConfigError: `path` (``module:Class``) names no `EngineAgent`."""
    module, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"no engine agent {path!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, EngineAgent)):
        raise ConfigError(f"{path!r} is not an EngineAgent")
    return cls


class Server:
    """One engine and its agent, serving the host on `sock`."""

    def __init__(self, sock: socket.socket, spec: dict[str, Any]) -> None:
        self.sock = sock
        self.spec = spec
        self.engine: Engine | None = None
        self.agent: EngineAgent | None = None
        self._reader = FrameReader()
        self._out: list[Any] = []
        self._pending = bytearray()
        self._flush_scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing: asyncio.Future[None] | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._closing = loop.create_future()
        try:
            engine = self._build()
            await engine.start()
            self.agent = _agent_class(self.spec["agent"])(engine, **self.spec["agent_options"])
        except KVFlowError as exc:
            self.sock.setblocking(True)
            self.sock.sendall(encode_frame([["failed", *error_record(exc)]]))
            if self.engine is not None:
                with contextlib.suppress(KVFlowError):
                    await self.engine.aclose(drain_timeout=0.1)
            return 1
        self.sock.setblocking(False)
        gc.collect()
        gc.freeze()  # what start-up made lives as long as the process: the collector skips it
        self._queue(["ready", engine.control.address, os.getpid()])
        loop.add_reader(self.sock.fileno(), self._readable)
        self._watch_parent(os.getppid())
        await self._closing
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
        self._queue(["closed", crashes])
        self._flush(final=True)
        return 0 if not crashes else 1

    def _build(self) -> Engine:
        """:raises KVFlowError: the memory, transport or control channel cannot be set up."""
        spec = self.spec
        mapped = MappedSpans([tuple(span) for span in spec["spans"]])
        layout = layout_from_wire(spec["layout"])
        layout = dataclasses.replace(layout, regions=tuple(mapped.translate(r) for r in layout.regions))
        self.mapped = mapped  # the mappings live as long as the engine
        raw = dict(spec["config"])
        allowed = PeerAllowList(tuple(raw["allowed_peers"]["engines"]), tuple(raw["allowed_peers"]["networks"]))
        config = EngineConfig(**{**raw, "core": CoreConfig(**raw["core"]), "allowed_peers": allowed})
        transport = load_transport(spec["transport"])(spec["engine_id"], **spec["transport_options"])
        control = ZmqControl(spec["engine_id"], bind=spec["bind"])
        self.engine = Engine(spec["engine_id"], layout, transport, control, config=config, on_release=self._released)
        return self.engine

    # ---------------------------------------------------------------- from the host

    def _readable(self) -> None:
        while True:
            try:
                count, frames = self._reader.read(self.sock)
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

    def _obey(self, record: list[Any]) -> None:
        if record[0] == "close":
            self._close()
            return
        _, seq, name, args = record
        assert self.agent is not None
        if name not in self.agent.COMMANDS:
            self._queue(["done", seq, ["UsageError", f"the engine process has no command {name!r}"], None])
            return
        task = asyncio.get_running_loop().create_task(self._call(seq, getattr(self.agent, name), args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(self, seq: int, method: Any, args: list[Any]) -> None:
        try:
            result = await method(*args)
        except KVFlowError as exc:
            self._queue(["done", seq, error_record(exc), None])
        except Exception as exc:  # a bug: the call fails, the host hears of it, the engine goes on
            text = "".join(traceback.format_exception_only(exc)).strip()
            log.error("engine process: %s failed", getattr(method, "__name__", method), exc_info=exc)
            self._queue(["done", seq, ["EngineCrashed", text], None])
            self._queue(["crashed", [text]])
        else:
            self._queue(["done", seq, None, result])

    def _close(self) -> None:
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
        self._queue(
            ["released", key.transfer_id, key.epoch, release.role.value, release.outcome.value, release.block_ids]
        )

    def _queue(self, record: list[Any]) -> None:
        self._out.append(record)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self, final: bool = False) -> None:
        """One frame of everything queued (with the meter's news), written as far as the socket takes it."""
        self._flush_scheduled = False
        if self.engine is not None:
            reading = self.engine.meter.take()
            if reading.samples or reading.outcomes or reading.dropped:
                samples = [[s.seconds, s.post_seconds, s.nbytes, s.descriptors] for s in reading.samples]
                self._out.append(["meter", samples, reading.outcomes, reading.dropped])
        if self._out:
            self._pending += encode_frame(self._out)
            self._out = []
        if final:
            self.sock.setblocking(True)
            with contextlib.suppress(OSError):
                self.sock.sendall(self._pending)
            self._pending.clear()
            return
        loop = asyncio.get_running_loop()
        try:
            sent = self.sock.send(self._pending) if self._pending else 0
        except BlockingIOError:
            sent = 0
        except OSError:  # the host is gone: closing follows from the reader
            self._pending.clear()
            return
        del self._pending[:sent]
        if self._pending:
            loop.add_writer(self.sock.fileno(), self._writable)

    def _writable(self) -> None:
        asyncio.get_running_loop().remove_writer(self.sock.fileno())
        self._flush()


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


if __name__ == "__main__":  # run the importable module's main, so that agents subclass its EngineAgent
    from kvflow.runtime.engine_process import main as module_main

    sys.exit(module_main())
