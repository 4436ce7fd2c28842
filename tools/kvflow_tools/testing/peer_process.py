"""One kvflow engine in its own process, driven by JSON lines on stdin, reporting on stdout.

Why: the cross-process tests need real processes (so that SIGKILL is real) with real sockets and
shared memory, and a driver that is plain text both ways.  Run as
``python -m kvflow_tools.testing.peer_process --name P`` (see `--help`).  Commands, one JSON object per line:

    {"cmd": "connect", "peer": "D", "address": "tcp://127.0.0.1:5555"}
    {"cmd": "expect", "tid": "r", "epoch": 1, "peer": "P", "blocks": [1, 2], "mode": "push", "ttl": 5}
    {"cmd": "kv_ready", "tid": "r", "epoch": 1, "blocks": [3, 4], "mode": "push", "peer": "D", "seed": 7}

`expect` may add ``"batches": n`` (expected batches) and ``"verify": seed``: the result event then
carries ``"verified": true/false``, whether the blocks hold the bytes `kv_ready` with that seed
wrote.  `kv_ready` may add ``"final": false`` and ``"first": position`` (one batch of several); it
fills its blocks with the seed's pattern, the same bytes for the same seed, position and layer.
    {"cmd": "digest", "blocks": [1, 2]}          -> {"event": "digest", "sha256": ...}
    {"cmd": "stats"}                             -> {"event": "stats", ...}
    {"cmd": "threads"}                           -> {"event": "threads", "names": {native id: name}}
    {"cmd": "close"}                             -> {"event": "closed"}, then the process exits

Events: {"event": "ready", "address": ..., "pid": ...} once started, {"event": "result", ...} when
a transfer's outcome is decided, {"event": "released", ...} when blocks come back,
{"event": "error", ...} when a command fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import resource
import sys
import threading
from collections.abc import Coroutine
from typing import Any

import numpy as np
import numpy.random  # now, not at the first seed: at its descriptor limit an import fails
import numpy.typing as npt

import kvflow.control.wire
from kvflow.control.zeromq import HANDSHAKE_TIMEOUT, ZmqControl
from kvflow.errors import KVFlowError
from kvflow.layout import KVLayout, KVSpec
from kvflow.layout.buffers import region_of
from kvflow.protocol.actions import ReleaseBlocks
from kvflow.protocol.admission import PeerAllowList
from kvflow.protocol.core import CoreConfig
from kvflow.protocol.state import Mode
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.runtime.loop import run
from kvflow.transports.base import Completion, Notification, Transport
from kvflow.transports.nixl import NixlTransport
from kvflow.transports.shm import ShmTransport


def spec(dtype: str) -> KVSpec:
    return KVSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=32, dtype=dtype)


_events = sys.stdout  # where the JSON lines go (see `_own_stdout`)


def emit(event: str, **fields: Any) -> None:
    _events.write(json.dumps({"event": event, **fields}) + "\n")
    _events.flush()


def _own_stdout() -> None:
    """Keep the process's stdout for the JSON lines alone: what native libraries print (UCX logs
    its errors on stdout) goes to stderr instead."""
    global _events
    _events = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)


class DroppingShm(ShmTransport):
    """Shared memory that loses a fraction of the notifications it receives (fault injection)."""

    def __init__(self, name: str, *, prefix: str | None, drop: float, seed: int) -> None:
        super().__init__(name, prefix=prefix)
        self.drop = drop
        self.dropped = 0
        self._dice = np.random.default_rng(seed)

    def poll(self) -> tuple[list[Completion], list[Notification]]:
        completions, notifications = super().poll()
        kept = [n for n in notifications if self._dice.random() >= self.drop]
        self.dropped += len(notifications) - len(kept)
        return completions, kept


def pattern(seed: int, layer: int, position: int, shape: tuple[int, int]) -> npt.NDArray[np.uint8]:
    """The bytes a transfer stamped with `seed` holds at block `position` of `layer`."""
    return np.random.default_rng([seed, layer, position]).integers(0, 256, shape, dtype=np.uint8)


class Peer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stamped = 0
        self.watchers: set[asyncio.Task[None]] = set()  # kept: a watcher that raises says so
        self.spec = kv = spec(args.dtype)
        self.transport: Transport
        size = 2 * args.blocks * kv.block_len
        if args.transport == "nixl":
            self.transport = NixlTransport(args.name, mode=args.nixl_mode, granule=kv.block_len)
            buffers = [np.zeros(size, np.uint8) for _ in range(kv.num_layers)]
        else:
            shm = (
                DroppingShm(args.name, prefix=args.prefix, drop=args.drop_notifications, seed=args.fault_seed)
                if args.drop_notifications
                else ShmTransport(args.name, prefix=args.prefix)
            )
            self.transport = shm
            buffers = [shm.allocate(size) for _ in range(kv.num_layers)]
        self.layers = [b.reshape(2, args.blocks, kv.block_len) for b in buffers]
        layout = KVLayout.per_layer_regions(kv, args.blocks, [region_of(a.reshape(-1)) for a in self.layers])
        config = EngineConfig(
            core=CoreConfig(fence_timeout=args.fence, retention=args.retention, max_finished=args.max_finished),
            transfer_timeout=args.ttl,
            lease=args.lease,
            drain_timeout=1.0,
            unfenced_grace=args.grace,
            # outcomes are read from handles and releases from `on_release`: nobody polls the
            # engine's queues, which would otherwise keep 65,536 records each (memory that grows
            # with every transfer up to then, and a soak that counts memory must not see it)
            results_kept=64,
            integrity=args.integrity,
            allowed_peers=PeerAllowList(tuple(args.allowed_peers.split(",")))
            if args.allowed_peers
            else PeerAllowList(),
        )
        control = ZmqControl(args.name, args.bind, curve=not args.no_curve, handshake_timeout=args.handshake_timeout)
        self.engine = Engine(args.name, layout, self.transport, control, config=config, on_release=self.released)

    def released(self, release: ReleaseBlocks) -> None:
        self.engine.meter.take()  # nobody reads the per-transfer figures here: keep none
        emit("released", tid=release.key.transfer_id, role=release.role.value, blocks=list(release.block_ids))

    def spawn(self, watcher: Coroutine[Any, Any, None]) -> None:
        """Run a watcher, kept until it ends; one that raises emits an "error" event (the parent
        then sees why, not only a result that never comes)."""
        task = asyncio.ensure_future(watcher)
        self.watchers.add(task)

        def ended(task: asyncio.Task[None]) -> None:
            self.watchers.discard(task)
            if not task.cancelled() and (error := task.exception()) is not None:
                emit("error", error=f"{type(error).__name__}: {error}")

        task.add_done_callback(ended)

    async def watch(self, handle: Any, blocks: list[int] | None = None, seed: int | None = None) -> None:
        result = await handle.wait()
        checked = {} if seed is None or blocks is None else {"verified": result.ok and self.holds(blocks, seed)}
        emit(
            "result",
            tid=result.key.transfer_id,
            role=result.role.value,
            outcome=result.outcome.value,
            reason=result.reason,
            **checked,
        )

    def fill(self, blocks: list[int], seed: int, first: int = 0) -> None:
        for index, layer in enumerate(self.layers):
            for position, block in enumerate(blocks, first):
                layer[:, block] = pattern(seed, index, position, (2, self.spec.block_len))

    def holds(self, blocks: list[int], seed: int) -> bool:
        """Whether `blocks` hold what a transfer stamped with `seed` wrote."""
        return all(
            np.array_equal(layer[:, block], pattern(seed, index, position, (2, self.spec.block_len)))
            for index, layer in enumerate(self.layers)
            for position, block in enumerate(blocks)
        )

    def digest(self, blocks: list[int]) -> str:
        h = hashlib.sha256()
        for layer in self.layers:
            for block in blocks:
                h.update(layer[:, block].tobytes())
        return h.hexdigest()

    async def handle(self, cmd: dict[str, Any]) -> None:
        e = self.engine
        kind = cmd["cmd"]
        if kind == "connect":
            await e.connect(cmd["peer"], cmd["address"], timeout=cmd.get("timeout", 5.0))
            emit("connected", peer=cmd["peer"])
        elif kind == "expect":
            handle = await e.expect(
                cmd["tid"],
                cmd["epoch"],
                peer=cmd["peer"],
                block_ids=cmd["blocks"],
                mode=Mode(cmd["mode"]),
                timeout=cmd.get("ttl"),
                expected_batches=cmd.get("batches", 1),
            )
            self.spawn(self.watch(handle, cmd["blocks"], cmd.get("verify")))
            emit("started", tid=cmd["tid"])
        elif kind == "kv_ready":
            self.stamped += 1
            wrong = self.args.misstamp_every and self.stamped % self.args.misstamp_every == 0
            self.fill(cmd["blocks"], cmd["seed"] + wrong, cmd.get("first", 0))
            handle = await e.kv_ready(
                cmd["tid"],
                cmd["epoch"],
                block_ids=cmd["blocks"],
                final=cmd.get("final", True),
                first_position=cmd.get("first", 0),
                mode=Mode(cmd["mode"]),
                peer=cmd.get("peer"),
                timeout=cmd.get("ttl"),
            )
            if not cmd.get("first", 0):  # a later batch: the first one's watcher reports the result
                self.spawn(self.watch(handle))
            emit("started", tid=cmd["tid"])
        elif kind == "digest":
            emit("digest", sha256=self.digest(cmd["blocks"]))
        elif kind == "stats":
            assert isinstance(e.control, ZmqControl)
            dropped = (
                {"dropped_notifications": self.transport.dropped} if isinstance(self.transport, DroppingShm) else {}
            )
            emit("stats", **e.stats(), **dropped, peers=e.peers(), control=dict(e.control.counters))
        elif kind == "threads":  # /proc names Python's threads after the process: these are their names
            emit("threads", names={str(t.native_id): t.name for t in threading.enumerate()})
        elif kind == "close":
            await e.aclose()
            emit("closed")
            raise SystemExit(0)

    async def main(self) -> None:
        await self.engine.start()
        emit("ready", address=self.engine.control.address, pid=os.getpid())
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue[str] = asyncio.Queue()

        def read_stdin() -> None:
            for line in sys.stdin:
                loop.call_soon_threadsafe(lines.put_nowait, line)
            loop.call_soon_threadsafe(lines.put_nowait, '{"cmd": "close"}')

        threading.Thread(target=read_stdin, daemon=True).start()
        while True:
            cmd = json.loads(await lines.get())
            try:
                await self.handle(cmd)
            except KVFlowError as exc:
                emit("error", cmd=cmd["cmd"], error=f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--prefix", default=None, help="shared-memory file prefix (unique per run)")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--ttl", type=float, default=10.0)
    parser.add_argument("--lease", type=float, default=30.0)
    parser.add_argument("--fence", type=float, default=2.0)
    parser.add_argument("--wire-version", type=int, default=kvflow.control.wire.VERSION)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--transport", choices=["shm", "nixl"], default="shm")
    parser.add_argument("--nixl-mode", choices=["direct", "prepped"], default="direct")
    parser.add_argument("--no-curve", action="store_true", help="sign frames only, no CURVE handshake")
    parser.add_argument("--grace", type=float, default=1.0, help="unfenced grace after a teardown (NIXL)")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="control-plane address to listen on")
    parser.add_argument("--retention", type=float, default=30.0, help="seconds finished transfers are kept")
    parser.add_argument(
        "--max-finished", type=int, default=CoreConfig().max_finished, help="finished transfers kept at most"
    )
    parser.add_argument("--drop-notifications", type=float, default=0.0, help="shm: lose this fraction of them")
    parser.add_argument("--fault-seed", type=int, default=0, help="seed of the injected faults")
    parser.add_argument("--misstamp-every", type=int, default=0, help="every Nth kv_ready stamps another seed")
    parser.add_argument(
        "--handshake-timeout", type=float, default=HANDSHAKE_TIMEOUT, help="seconds a stranger has to authenticate"
    )
    parser.add_argument("--nofile", type=int, default=0, help="soft and hard open-files limit (0: inherited)")
    parser.add_argument("--integrity", action="store_true", help="seal WRITEs with digests, check what lands")
    parser.add_argument("--allowed-peers", default="", help="engine ids P may associate with, comma-separated patterns")
    arguments = parser.parse_args()
    if arguments.nofile:  # soft and hard alike: the channel raises a soft limit to the hard one
        resource.setrlimit(resource.RLIMIT_NOFILE, (arguments.nofile, arguments.nofile))
    _own_stdout()
    kvflow.control.wire.VERSION = arguments.wire_version  # lets a test play a peer of another version
    with contextlib.suppress(SystemExit):  # the "close" command ends the process
        run(Peer(arguments).main())
