"""One engine of the GPU check (P or D) in a child process, driven by JSON commands on stdin.

Why a process of its own: NIXL over UCX between two processes is what an inference engine
meets (CUDA IPC, or not, across process boundaries), and a child that hangs or crashes in
native code can be killed without losing the run.  Its KV caches are torch tensors (``cuda:0``,
or host memory for the CPU dry run) that `kvflow.region_of` turns into regions; every reply that
concerns bytes carries a sha256 of them, so the parent compares real bytes, never a claim.
This module imports torch and kvflow; `kvflow_tools.gpu.child` imports it only once it can
report a failure to import them as a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import sys
import threading
import time
import traceback
from typing import Any, TextIO

import torch

import kvflow
from kvflow.integrations.vllm.device import CudaDevice, GateWaiter
from kvflow.protocol.actions import OpKind, SubmitOp
from kvflow.protocol.messages import TransferKey, encode_notification
from kvflow.runtime.integrity import Integrity
from kvflow.transports.nixl import NixlTransport
from kvflow_tools.gpu.plan import SPEC_B, SPEC_D, STALE, TRANSFER_S, block_len
from kvflow_tools.gpu.raw_nixl import RawNixl
from kvflow_tools.gpu.vmm import ExportableMemory

__all__ = ("EngineChild", "answer", "cuda_event", "event_done", "serve", "sleep_kernel")


def sleep_kernel(cycles: int) -> None:
    """Enqueue on the current CUDA stream a kernel that spins for `cycles` GPU clock cycles:
    a wait of a known length on the device, with nothing else touched.  Never raises."""
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]  # torch has no public one


# torch's CUDA events are untyped: these two give them types


def cuda_event(*, enable_timing: bool = False, blocking: bool = False) -> torch.cuda.Event:
    """A CUDA event on the current device.  :raises RuntimeError: no CUDA (torch's)."""
    return torch.cuda.Event(enable_timing=enable_timing, blocking=blocking)  # type: ignore[no-untyped-call]


def event_done(event: torch.cuda.Event) -> bool:
    """Whether the work before `event` has completed, without waiting.  :raises RuntimeError: CUDA's."""
    return bool(event.query())  # type: ignore[no-untyped-call]


class EngineChild:
    """One engine (P or D) in this process, its KV caches, and the commands it answers."""

    def __init__(self, args: argparse.Namespace, events: TextIO, *, engine: bool = True) -> None:
        """An engine named ``args.name`` on ``args.device``, its caches zeroed; not started
        (`engine` False: the caches only, for a subclass that runs its engine elsewhere).

        :raises kvflow.KVFlowError: the engine, its transport or its control channel cannot be made.
        :raises RuntimeError: CUDA cannot be used (torch's).
        """
        self.events = events
        self.cuda = args.device == "cuda"
        self.dev = "cuda:0" if self.cuda else "cpu"
        if self.cuda:
            torch.cuda.set_device(0)
            torch.zeros(1, device=self.dev)  # CUDA context (and libcudart, which UCX's CUDA modules need) first
        spec_args = SPEC_D if args.geometry == "bw" else SPEC_B
        self.spec = kvflow.KVSpec(**spec_args)
        self.nb: int = args.blocks
        self.blen = self.spec.block_len
        assert self.blen == block_len(spec_args)
        # per layer: K blocks then V blocks, as bytes (the quickstart's shape, as a torch tensor);
        # `--exported`: each layer one driver-mapped chunk, as vLLM 0.34's exportable cache holds it
        shape = (2, self.nb, self.blen)
        self.chunks = (
            [ExportableMemory(2 * self.nb * self.blen) for _ in range(self.spec.num_layers)] if args.exported else []
        )
        self.layers = (
            [chunk.as_tensor(2 * self.nb * self.blen).view(shape).zero_() for chunk in self.chunks]
            if self.chunks
            else [torch.zeros(shape, dtype=torch.uint8, device=self.dev) for _ in range(self.spec.num_layers)]
        )

        def bind_thread() -> None:
            torch.cuda.set_device(0)

        # a GPU host binds every kvflow/NIXL thread to its device: UCX disables CUDA IPC otherwise
        bind = bind_thread if self.cuda and not args.unbound else None
        self.regions = [kvflow.region_of(t) for t in self.layers]
        self.watchers: set[asyncio.Task[None]] = set()
        self.raw: RawNixl  # made by the raw_open command (the bandwidth baseline)
        self.stream = torch.cuda.Stream() if self.cuda else None  # type: ignore[no-untyped-call]
        if not engine:
            return
        layout = kvflow.KVLayout.per_layer_regions(self.spec, self.nb, self.regions)
        transport = NixlTransport(args.name, thread_setup=bind, cuda=self.cuda)
        control = kvflow.ZmqControl(args.name, "tcp://127.0.0.1:0", thread_setup=bind)
        config = kvflow.EngineConfig(transfer_timeout=TRANSFER_S, drain_timeout=2.0, thread_setup=bind)
        self.engine = kvflow.Engine(args.name, layout, transport, control, config=config)

    def emit(self, event: str, **fields: Any) -> None:
        """One JSON line to the parent.  :raises OSError: the parent is gone."""
        self.events.write(json.dumps({"event": event, **fields}) + "\n")
        self.events.flush()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def index(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.long, device=self.dev)

    def digest(self, blocks: list[int]) -> str:
        """sha256 of the blocks' bytes, layer by layer, K and V, in the order given (both sides alike)."""
        h = hashlib.sha256()
        idx = self.index(blocks)
        for layer in self.layers:
            h.update(layer.index_select(1, idx).cpu().numpy().data)
        return h.hexdigest()

    def pattern(self, seed: int, n: int) -> list[torch.Tensor]:
        """The seeded bytes for n blocks, one (2, n, block_len) tensor per layer, made on the device."""
        g = torch.Generator(device=self.dev)
        g.manual_seed(seed)
        shape = (2, n, self.blen)
        return [torch.randint(0, 256, shape, dtype=torch.uint8, device=self.dev, generator=g) for _ in self.layers]

    async def handle(self, cmd: dict[str, Any]) -> None:
        """Run command ``cmd["cmd"]`` (the method ``cmd_<name>``).

        :raises Exception: whatever the command raises; the caller reports it to the parent.
        """
        result = getattr(self, "cmd_" + cmd["cmd"])(cmd)
        if asyncio.iscoroutine(result):
            await result

    # ------------------------------------------------------------------ commands

    async def cmd_connect(self, cmd: dict[str, Any]) -> None:
        await self.engine.connect(cmd["peer"], cmd["address"], timeout=10.0)
        self.emit("connected", id=cmd["id"])

    def cmd_fill(self, cmd: dict[str, Any]) -> None:
        """P: the seeded pattern into `blocks`, finished on the device; reply with their digest."""
        blocks = cmd["blocks"]
        idx = self.index(blocks)
        for layer, src in zip(self.layers, self.pattern(cmd["seed"], len(blocks)), strict=True):
            layer.index_copy_(1, idx, src)
        self.sync()
        self.emit("filled", id=cmd["id"], digest=self.digest(blocks))

    async def cmd_expect(self, cmd: dict[str, Any]) -> None:
        """D: (optionally) zero the whole cache, expect the transfer, reply at once; the result
        (time, digest of the landed blocks, whether the other blocks stayed zero) comes later."""
        if cmd.get("zero"):
            for layer in self.layers:
                layer.zero_()
            self.sync()
        mode = kvflow.Mode(cmd["mode"])
        handle = await self.engine.expect(
            cmd["tid"], 1, peer=cmd["peer"], block_ids=cmd["blocks"], mode=mode, timeout=TRANSFER_S
        )
        task = asyncio.ensure_future(self.watch(cmd, handle))
        self.watchers.add(task)
        task.add_done_callback(self.watchers.discard)
        self.emit("expecting", id=cmd["id"])

    async def watch(self, cmd: dict[str, Any], handle: kvflow.TransferHandle) -> None:
        """D: once the transfer ends, its result with what landed; an "error" reply if that fails."""
        try:
            result = await handle.wait(TRANSFER_S + 5)
            t_done = time.monotonic()  # CLOCK_MONOTONIC: comparable with P's clock on this host
            self.sync()
            blocks = cmd["blocks"]
            idx = self.index(blocks)
            mask = torch.ones(self.nb, dtype=torch.bool, device=self.dev)
            mask[idx] = False
            outside = sum(int(layer[:, mask].count_nonzero()) for layer in self.layers)
            target = [layer.index_select(1, idx) for layer in self.layers]
            total = sum(t.numel() for t in target)
            stale = sum(int((t == STALE).sum()) for t in target)
            zero = sum(int((t == 0).sum()) for t in target)
            self.emit(
                "result",
                id=cmd["id"],
                tid=cmd["tid"],
                outcome=result.outcome.value,
                reason=result.reason,
                t_done=t_done,
                digest=self.digest(blocks),
                outside_nonzero_bytes=outside,
                target_bytes=total,
                target_stale_fraction=stale / total,
                target_zero_fraction=zero / total,
            )
        except Exception as exc:
            self.emit("error", id=cmd["id"], error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())

    async def cmd_send(self, cmd: dict[str, Any]) -> None:
        """P: kv_ready for blocks already filled; reply with the start time and P's own outcome."""
        mode = kvflow.Mode(cmd["mode"])
        t0 = time.monotonic()
        handle = await self.engine.kv_ready(cmd["tid"], 1, block_ids=cmd["blocks"], mode=mode, peer=cmd["peer"])
        result = await handle.wait(TRANSFER_S + 5)
        t1 = time.monotonic()
        self.emit("sent", id=cmd["id"], t0=t0, t_p_done=t1, outcome=result.outcome.value, reason=result.reason)

    def cmd_raw_open(self, cmd: dict[str, Any]) -> None:
        """A bare NIXL agent on this child's caches (the bandwidth baseline); its metadata."""
        layers = [(int(t.data_ptr()), t.numel()) for t in self.layers]
        self.raw = RawNixl(f"raw-{cmd['name']}", layers, self.nb, self.blen, self.cuda)
        self.emit("raw_opened", id=cmd["id"], metadata=base64.b64encode(self.raw.metadata()).decode(), layers=layers)

    def cmd_raw_peer(self, cmd: dict[str, Any]) -> None:
        self.raw.add_peer(base64.b64decode(cmd["metadata"]), [(int(a), int(n)) for a, n in cmd["layers"]])
        self.emit("raw_peered", id=cmd["id"])

    async def cmd_raw_write(self, cmd: dict[str, Any]) -> None:
        """P: the baseline WRITE of blocks [0, count), notification `tag`."""
        t0, t1 = await asyncio.to_thread(self.raw.write, int(cmd["count"]), cmd["tag"].encode(), TRANSFER_S)
        self.emit("raw_written", id=cmd["id"], t0=t0, t_p_done=t1)

    async def cmd_raw_expect(self, cmd: dict[str, Any]) -> None:
        """D: zero the cache, say so at once, then when notification `tag` came and the landed
        blocks' digest."""
        for layer in self.layers:
            layer.zero_()
        self.sync()
        task = asyncio.ensure_future(self._raw_watch(cmd))
        self.watchers.add(task)
        task.add_done_callback(self.watchers.discard)
        self.emit("raw_expecting", id=cmd["id"])

    async def _raw_watch(self, cmd: dict[str, Any]) -> None:
        try:
            t_done = await asyncio.to_thread(self.raw.notified, cmd["tag"].encode(), TRANSFER_S)
            self.sync()
            self.emit("raw_result", id=cmd["id"], t_done=t_done, digest=self.digest(list(range(int(cmd["count"])))))
        except Exception as exc:
            self.emit("error", id=cmd["id"], error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())

    def cmd_integrity(self, cmd: dict[str, Any]) -> None:
        """The integrity check on this child's caches (GPU memory read through the CUDA driver's
        copy): P's seal of `count` filled blocks, D's check of the same blocks (must pass), then
        one byte flipped in the last block (must fail, naming it); the seal's and check's rate."""
        blocks = list(range(int(cmd["count"])))
        idx = self.index(blocks)
        for layer, src in zip(self.layers, self.pattern(int(cmd["seed"]), len(blocks)), strict=True):
            layer.index_copy_(1, idx, src)
        self.sync()
        layout = self.engine.layout
        integrity = Integrity(self.engine.engine_id, layout)
        key = TransferKey("integrity", 1)
        op = SubmitOp(
            1, key, "self", OpKind.WRITE, tuple(blocks), tuple(blocks), None, encode_notification(key, 0, True)
        )
        t0 = time.perf_counter()
        sealed = integrity.seal(op, layout)
        t1 = time.perf_counter()
        clean = integrity.check("self", sealed, layout, lambda _: blocks)
        t2 = time.perf_counter()
        self.layers[0][0, blocks[-1], 7] ^= 1  # one bit of one byte of layer 0's K in the last block
        self.sync()
        flipped = integrity.check("self", sealed, layout, lambda _: blocks)
        size = len(blocks) * self.spec.num_layers * 2 * self.blen
        self.emit(
            "integrity",
            id=cmd["id"],
            bytes=size,
            clean=clean,
            flipped=flipped,
            seal_gib_per_s=size / (t1 - t0) / 2**30,
            check_gib_per_s=size / (t2 - t1) / 2**30,
        )

    def cmd_calibrate(self, cmd: dict[str, Any]) -> None:
        """cuda: GPU clock cycles per second of `sleep_kernel`, measured with CUDA events."""
        sleep_kernel(1_000_000)  # warm up (and let the clocks rise)
        rates = []
        for cycles in (50_000_000, 100_000_000):
            start, end = cuda_event(enable_timing=True), cuda_event(enable_timing=True)
            start.record()
            sleep_kernel(cycles)
            end.record()
            end.synchronize()
            rates.append(cycles / (start.elapsed_time(end) / 1e3))
        self.emit("calibrated", id=cmd["id"], cycles_per_s=rates[-1], rates=rates)

    async def cmd_gate(self, cmd: dict[str, Any]) -> None:
        """cuda: old bytes (STALE) in P's blocks; on one stream a long kernel, then the pattern's
        copy, then kvflow's gate (`CudaDevice.record`, on the stream current there, as in a
        forward).  wait=True: kv_ready once kvflow's `GateWaiter` says the gate opened;
        wait=False (the negative control): kv_ready at once, while the kernel still runs."""
        blocks = cmd["blocks"]
        idx = self.index(blocks)  # made (an H2D copy) before the stream gets its long kernel
        for layer in self.layers:
            layer.index_fill_(1, idx, STALE)
        src = self.pattern(cmd["seed"], len(blocks))
        torch.cuda.synchronize()
        h = hashlib.sha256()
        for s in src:
            h.update(s.cpu().numpy().data)
        expected = h.hexdigest()
        assert self.stream is not None
        device = CudaDevice(0)
        with torch.cuda.stream(self.stream):
            sleep_kernel(int(cmd["cycles"]))
            for layer, s in zip(self.layers, src, strict=True):
                for i, b in enumerate(blocks):
                    layer[:, b].copy_(s[:, i])  # plain strided copies: no host synchronisation
            gate = device.record()  # what a hook does after enqueueing a layer group's kernels
        assert gate is not None
        t_enqueued = time.monotonic()
        waited = 0.0
        if cmd["wait"]:
            waiter = GateWaiter(device, "gpu-check-gates")
            try:
                await waiter.wait(gate, TRANSFER_S)
            finally:
                waiter.close()
            waited = time.monotonic() - t_enqueued
        pending_at_kv_ready = not gate.done()  # True: the copy had not run when the WRITE was posted
        t0 = time.monotonic()
        handle = await self.engine.kv_ready(cmd["tid"], 1, block_ids=blocks, mode=kvflow.Mode.PUSH, peer=cmd["peer"])
        result = await handle.wait(TRANSFER_S + 5)
        t1 = time.monotonic()
        await asyncio.to_thread(gate.wait)
        self.emit(
            "gated",
            id=cmd["id"],
            expected=expected,
            p_digest_after=self.digest(blocks),  # P's blocks once the stream finished: must be `expected`
            pending_at_kv_ready=pending_at_kv_ready,
            waited_s=waited,
            t0=t0,
            t_p_done=t1,
            outcome=result.outcome.value,
            reason=result.reason,
        )

    async def cmd_cpu_wait(self, cmd: dict[str, Any]) -> None:
        """cuda: CPU time of one thread waiting for a ~1 s kernel: event.synchronize() on a default
        event (may spin), on Event(blocking=True) (should sleep), a query() poll every 1 ms, and
        kvflow's own gate (`CudaDevice.record`, waited as its `GateWaiter` does)."""
        cycles = int(cmd["cycles"])
        stream = self.stream
        assert stream is not None

        def measure(kind: str) -> dict[str, Any]:
            torch.cuda.set_device(0)
            ev = cuda_event(blocking=(kind == "blocking_event_synchronize"))
            k0, k1 = cuda_event(enable_timing=True), cuda_event(enable_timing=True)
            with torch.cuda.stream(stream):
                k0.record(stream)
                sleep_kernel(cycles)
                k1.record(stream)
                ev.record(stream)
                gate = CudaDevice(0).record() if kind == "kvflow_gate_wait" else None  # kvflow's own
            out: dict[str, Any] = {}

            def waiter() -> None:
                c0, w0 = time.thread_time(), time.perf_counter()
                if kind == "query_poll_1ms":
                    while not event_done(ev):
                        time.sleep(0.001)
                elif gate is not None:
                    gate.wait()
                else:
                    ev.synchronize()
                out["cpu_s"], out["wall_s"] = time.thread_time() - c0, time.perf_counter() - w0

            thread = threading.Thread(target=waiter)
            thread.start()
            thread.join()
            k1.synchronize()
            out["kernel_s"] = k0.elapsed_time(k1) / 1e3
            out["cpu_per_wall"] = out["cpu_s"] / out["wall_s"] if out["wall_s"] > 0 else None
            return {"kind": kind, **out}

        kinds = ("default_event_synchronize", "blocking_event_synchronize", "query_poll_1ms", "kvflow_gate_wait")
        rows = [await asyncio.to_thread(measure, kind) for kind in kinds]
        self.emit("cpu_waited", id=cmd["id"], rows=rows)

    async def cmd_copy_bw(self, cmd: dict[str, Any]) -> None:
        """The baseline: a torch copy of `size` bytes on this device (D2D on cuda, memcpy on cpu)."""
        n = int(cmd["size"])
        a = torch.randint(0, 256, (n,), dtype=torch.uint8, device=self.dev)
        b = torch.empty_like(a)
        times = []
        for _ in range(cmd["warmup"] + cmd["iters"]):
            b.zero_()
            self.sync()
            if self.cuda:
                e0, e1 = cuda_event(enable_timing=True), cuda_event(enable_timing=True)
                e0.record()
                b.copy_(a)
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1) / 1e3)
            else:
                t = time.perf_counter()
                b.copy_(a)
                times.append(time.perf_counter() - t)
        equal = bool(torch.equal(a, b))
        del a, b
        if self.cuda:
            torch.cuda.empty_cache()
        self.emit("copied", id=cmd["id"], times=times[cmd["warmup"] :], equal=equal)


async def serve(args: argparse.Namespace, events: TextIO) -> None:
    """Start the engine, say "ready" (its address, pid, memory types, its regions' kinds),
    answer commands from stdin until "close" or its end, then say "closed" with the engine's
    counters.  A command that fails is answered with an "error" line and the next one is read.

    :raises kvflow.KVFlowError: the engine cannot be made or started.
    :raises OSError: the parent is gone.
    """
    child = EngineChild(args, events)
    async with child.engine:
        caps = child.engine.transport.capabilities
        child.emit(
            "ready",
            address=child.engine.control.address,
            pid=os.getpid(),
            memory_types=sorted(m.value for m in caps.memory_types),
            regions=[r.memory.value for r in child.regions],
        )
        await answer(child)
    child.emit("closed", stats={k: v for k, v in child.engine.stats().items() if isinstance(v, int)})


async def answer(child: EngineChild) -> None:
    """Commands from stdin until "close" or its end; a command that fails is answered with an
    "error" line.  :raises OSError: the parent is gone."""
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = json.loads(line)
        if cmd["cmd"] == "close":
            break
        try:
            await child.handle(cmd)
        except Exception as exc:
            child.emit("error", id=cmd.get("id"), error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
