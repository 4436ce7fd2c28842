"""`kvflow bench engine`: the control plane's throughput, latency and memory per transfer.

Why its own benchmark: the data-plane benchmarks measure bytes; at small transfers what limits
an engine is its per-transfer bookkeeping (the core's actions, messages, wakeups), and whether
that cost stays flat as transfers pile up, in flight or finished (kept `retention` seconds).
Two engines move zero-byte and small push transfers, D keeping `window` of them in flight:

* ``loopback``: both engines in this process, an in-process control hub and loopback fabric;
* ``zmq-shm``: P in a child process (``python -m kvflow_tools.bench.bench_engine --child``), ZeroMQ
  control and shared-memory WRITEs between the two processes.

Each cell reports transfers/s and D's per-transfer latency (expect to its result); `aging`
compares the rate of the first transfers with the rate once many have finished; `memory` is
what each in-flight transfer holds (tracemalloc, both engines of the loopback pair).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import tracemalloc
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TextIO

import numpy as np

from kvflow.control.channel import LocalControlHub
from kvflow.control.zeromq import ZmqControl
from kvflow.layout import KVLayout, KVSpec
from kvflow.layout.buffers import region_of
from kvflow.protocol.core import CoreConfig
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.runtime.loop import run
from kvflow.runtime.meter import quantile
from kvflow.runtime.results import TransferHandle
from kvflow.transports.loopback import LoopbackFabric
from kvflow.transports.shm import ShmTransport
from kvflow_tools.children import spawn
from kvflow_tools.errors import BenchError

__all__ = ("BenchConfig", "Cell", "main", "run_bench")

BIG = 1 << 22  # quotas the benchmark must not hit (it keeps up to `window` transfers open per peer)


@dataclass(frozen=True)
class BenchConfig:
    modes: tuple[str, ...] = ("loopback", "zmq-shm")
    sizes: tuple[int, ...] = (0, 64, 4096)  # bytes per transfer (K and V of one block); 0: D needs none
    windows: tuple[int, ...] = (1, 100, 1000, 10_000)  # transfers in flight (zmq-shm: up to 1000)
    transfers: int = 2000  # per cell (at least twice the window)
    aging: int = 12_000  # loopback, 64 B, window 100: first 1k vs after 10k finished (0: skip)
    memory: tuple[int, ...] = (100, 1000, 10_000)  # in-flight counts whose memory is measured

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls(windows=(1, 10), transfers=40, aging=300, memory=(10, 50))


@dataclass
class Cell:
    mode: str
    size: int
    window: int
    transfers: int
    rate: float  # transfers/s, first start to last finish
    p50_ms: float
    p90_ms: float
    p99_ms: float
    failed: int = 0


@dataclass
class Report:
    cells: list[Cell] = field(default_factory=list)
    aging: dict[str, float] = field(default_factory=dict)
    memory: list[dict[str, float]] = field(default_factory=list)


def spec_for(size: int) -> KVSpec:
    """One layer whose block holds `size` bytes of K and V together (32 bytes a token)."""
    return KVSpec(num_layers=1, block_size=max(size // 32, 1), num_kv_heads=1, head_dim=8, dtype="float16")


def engine_config() -> EngineConfig:
    quota = CoreConfig(max_unstarted=BIG, max_peer_transfers=BIG, max_peer_blocks=BIG, max_peer_early=BIG)
    return EngineConfig(core=quota, transfer_timeout=300.0, lease=60.0, drain_timeout=5.0)


def buffers(spec: KVSpec, blocks: int, allocate: Callable[[int], np.ndarray]) -> KVLayout:
    """The layout of one layer's K and V in memory from `allocate`, which must keep it alive."""
    return KVLayout.per_layer_regions(spec, blocks, [region_of(allocate(2 * blocks * spec.block_len))])


# ---------------------------------------------------------------------------- driving


Outcome = tuple[dict[int, float], dict[int, float], int]  # start and finish times by transfer, failures


async def drive(n: int, window: int, start: Callable[[int, int], Awaitable[list[TransferHandle]]]) -> Outcome:
    """Run `n` transfers, `window` at a time; `start(i, slot)` opens transfer i on block `slot`
    and returns the handles that end it.  Times are `time.monotonic` (one clock for every
    process of the machine)."""
    free = list(range(window))
    room = asyncio.Semaphore(window)
    began: dict[int, float] = {}
    finished: dict[int, float] = {}
    failed = 0
    tasks: set[asyncio.Task[None]] = set()

    async def one(i: int, slot: int) -> None:
        nonlocal failed
        began[i] = time.monotonic()
        try:
            for handle in await start(i, slot):
                result = await handle
                if not result.ok:
                    failed += 1
                    say(sys.stderr, f"transfer {i} {result.role.value}: {result.reason}")
            finished[i] = time.monotonic()
        finally:
            free.append(slot)
            room.release()

    for i in range(n):
        await room.acquire()
        task = asyncio.ensure_future(one(i, free.pop()))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    while tasks:
        await asyncio.gather(*list(tasks))
    return began, finished, failed


def cell(mode: str, size: int, window: int, outcome: Outcome, other: dict[int, float] | None = None) -> Cell:
    """`other`: when the other process's side of each transfer ended (a transfer ends with both)."""
    began, finished, failed = outcome
    ends = {i: max(t, (other or {}).get(i, t)) for i, t in finished.items()}
    latencies = [(ends[i] - began[i]) * 1e3 for i in ends]
    ms = [quantile(latencies, q) if latencies else 0.0 for q in (0.5, 0.9, 0.99)]
    span = max(ends.values()) - min(began.values()) if ends else 0.0
    rate = len(ends) / span if span > 0 else 0.0
    return Cell(mode, size, window, len(ends), rate, float(ms[0]), float(ms[1]), float(ms[2]), failed)


async def one(handle: Awaitable[TransferHandle]) -> list[TransferHandle]:
    return [await handle]


def tid(i: int) -> str:
    return f"t{i}"


async def expect_on(engine: Engine, size: int, i: int, slot: int) -> TransferHandle:
    blocks, batches = ([slot], 1) if size else ([], 0)
    return await engine.expect(tid(i), 1, peer="P", block_ids=blocks, expected_batches=batches)


async def ready_on(engine: Engine, i: int) -> TransferHandle:
    return await engine.kv_ready(tid(i), 1, block_ids=[0], peer="D")


class LoopbackPair:
    """P and D in this process."""

    def __init__(self, size: int, window: int) -> None:
        spec, hub, self.fabric = spec_for(size), LocalControlHub(), LoopbackFabric()
        config = engine_config()
        self.memory: list[np.ndarray] = []  # what the regions point into, alive while the pair is
        p_kv, d_kv = buffers(spec, 1, self.allocate), buffers(spec, window, self.allocate)
        self.p = Engine("P", p_kv, self.fabric.endpoint("P"), hub.channel("P"), config=config)
        self.d = Engine("D", d_kv, self.fabric.endpoint("D"), hub.channel("D"), config=config)
        self.size = size

    def allocate(self, size: int) -> np.ndarray:
        self.memory.append(np.zeros(size, np.uint8))
        return self.memory[-1]

    async def __aenter__(self) -> LoopbackPair:
        await self.p.start()
        await self.d.start()
        await self.d.connect("P")
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.p.aclose(drain_timeout=1.0)
        finally:
            await self.d.aclose(drain_timeout=1.0)
            self.fabric.close()

    async def start(self, i: int, slot: int) -> list[TransferHandle]:
        return [await expect_on(self.d, self.size, i, slot), await ready_on(self.p, i)]


async def loopback_cell(size: int, window: int, n: int) -> tuple[Cell, list[float]]:
    async with LoopbackPair(size, window) as pair:
        outcome = await drive(n, window, pair.start)
    return cell("loopback", size, window, outcome), sorted(outcome[1].values())


async def memory_per_transfer(window: int) -> dict[str, float]:
    """Bytes each in-flight transfer holds (both engines): D registers, P never has the KV."""
    async with LoopbackPair(64, window) as pair:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            handles = [await expect_on(pair.d, 64, i, i) for i in range(window)]
            deadline = time.monotonic() + 60.0
            while pair.p.stats()["live_transfers"] < window:
                if time.monotonic() > deadline:
                    raise BenchError(f"P opened {pair.p.stats()['live_transfers']} of {window} transfers in 60 s")
                await asyncio.sleep(0.01)
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        del handles
    return {"in_flight": window, "bytes_per_transfer": held / window}


# ---------------------------------------------------------------------------- two processes


async def child_main(size: int, window: int, n: int, prefix: str) -> None:
    """P in its own process: announce the control address, then keep `window` transfers' KV
    ready until `n` have ended; report how many failed."""
    shm = ShmTransport("P", prefix=prefix)
    control = ZmqControl("P", curve=False)
    engine = Engine("P", buffers(spec_for(size), 1, shm.allocate), shm, control, config=engine_config())
    await engine.start()
    say(sys.stdout, json.dumps({"address": control.address}))
    _, finished, failed = await drive(n, window, lambda i, _slot: one(ready_on(engine, i)))
    say(sys.stdout, json.dumps({"failed": failed, "finished": finished}))
    await engine.aclose(drain_timeout=5.0)


async def process_cell(size: int, window: int, n: int) -> Cell:
    """D here, P in a child process, ZeroMQ control and shared memory between them.

    :raises BenchError: the child did not come up, or failed.
    """
    prefix = f"kvflow-bench-{uuid.uuid4().hex[:8]}"
    argv = [sys.executable, "-m", "kvflow_tools.bench.bench_engine", "--child", str(size), str(window), str(n), prefix]
    child = await spawn(argv, stdout=True)
    assert child.stdout is not None
    try:
        line = await asyncio.wait_for(child.stdout.readline(), 60.0)
        if not line:
            raise BenchError(f"the P process exited before it was ready (status {await child.wait()})")
        address = json.loads(line)["address"]
        shm = ShmTransport("D", prefix=prefix)
        control = ZmqControl("D", curve=False)
        d = Engine("D", buffers(spec_for(size), window, shm.allocate), shm, control, config=engine_config())
        await d.start()
        try:
            await d.connect("P", address, timeout=60.0)
            outcome = await drive(n, window, lambda i, slot: one(expect_on(d, size, i, slot)))
            last = await asyncio.wait_for(child.stdout.readline(), 300.0)  # before D closes
        finally:
            await d.aclose(drain_timeout=5.0)
        if not last:
            raise BenchError(f"the P process ended without a report (status {await child.wait()})")
        report = json.loads(last)
        result = cell("zmq-shm", size, window, outcome, {int(i): t for i, t in report["finished"].items()})
        result.failed += report["failed"]
        return result
    finally:
        child.kill()
        await child.wait()


# ---------------------------------------------------------------------------- the run


async def run_bench(config: BenchConfig, progress: Callable[[str], None] | None = None) -> Report:
    """Failed transfers are counted per cell (and named on stderr), not raised.

    :raises BenchError: the P process did not come up or ended without its report.
    """
    report = Report()
    say = progress or (lambda _text: None)
    for mode in config.modes:
        for size in config.sizes:
            for window in config.windows:
                if mode == "zmq-shm" and window > 1000:
                    continue  # the ZeroMQ send queue holds 10k frames
                n = max(config.transfers, 2 * window)
                say(f"{mode} {size} B, {window} in flight, {n} transfers")
                if mode == "loopback":
                    result, _ = await loopback_cell(size, window, n)
                else:
                    result = await process_cell(size, window, n)
                report.cells.append(result)
                say(render(Report([result])).splitlines()[1])
    if config.aging:
        say(f"aging: {config.aging} transfers, 100 in flight")
        _, finished = await loopback_cell(64, 100, config.aging)
        first, later = max(config.aging // 12, 2), config.aging * 10 // 12
        report.aging = {
            "first": first,
            "first_rate": rate_of(finished[:first]),
            "after": later,
            "after_rate": rate_of(finished[later:]),
        }
    for window in config.memory:
        say(f"memory: {window} in flight")
        report.memory.append(await memory_per_transfer(window))
    return report


def say(stream: TextIO, text: str) -> None:
    stream.write(text + "\n")
    stream.flush()


def rate_of(times: Sequence[float]) -> float:
    span = max(times) - min(times) if len(times) > 1 else 0.0
    return (len(times) - 1) / span if span > 0 else 0.0


def render(report: Report) -> str:
    lines = [
        f"{'mode':<9} {'bytes':>6} {'in flight':>9} {'transfers':>9} {'/s':>9} "
        f"{'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'failed':>6}"
    ]
    for c in report.cells:
        lines.append(
            f"{c.mode:<9} {c.size:>6} {c.window:>9} {c.transfers:>9} {c.rate:>9.0f} "
            f"{c.p50_ms:>8.3f} {c.p90_ms:>8.3f} {c.p99_ms:>8.3f} {c.failed:>6}"
        )
    if report.aging:
        a = report.aging
        lines.append(
            f"aging (loopback, 64 B, 100 in flight): first {a['first']:.0f} finished {a['first_rate']:.0f}/s, "
            f"after {a['after']:.0f} finished {a['after_rate']:.0f}/s"
        )
    for m in report.memory:
        lines.append(f"memory: {m['in_flight']:.0f} in flight, {m['bytes_per_transfer']:.0f} B per transfer")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `kvflow bench engine` (defaults: `BenchConfig`)."""
    ints = lambda text: tuple(int(part) for part in text.split(",") if part.strip())  # noqa: E731
    parser.add_argument("--quick", action="store_true", help="a tiny run (CI smoke)")
    parser.add_argument("--modes", type=lambda t: tuple(t.split(",")), default=None, help="loopback,zmq-shm")
    parser.add_argument("--sizes", type=ints, default=None, help="bytes per transfer, e.g. 0,64,4096")
    parser.add_argument("--windows", type=ints, default=None, help="transfers in flight, e.g. 1,100,1000,10000")
    parser.add_argument("--transfers", type=int, default=None, help="transfers per cell (at least 2x in flight)")
    parser.add_argument("--aging", type=int, default=None, help="transfers of the aging run (0: none)")
    parser.add_argument("--memory", type=ints, default=None, help="in-flight counts to weigh (empty: none)")
    parser.add_argument("--json", default=None, help="also write the report to this JSON file")


def config_from(args: argparse.Namespace) -> BenchConfig:
    """:raises BenchError: an unknown mode, or a size or count that is not positive."""
    base = BenchConfig.quick() if args.quick else BenchConfig()
    given = {k: getattr(args, k) for k in ("modes", "sizes", "windows", "transfers", "aging", "memory")}
    config = replace(base, **{k: v for k, v in given.items() if v is not None})
    if set(config.modes) - {"loopback", "zmq-shm"}:
        raise BenchError(f"unknown modes {sorted(set(config.modes) - {'loopback', 'zmq-shm'})}")
    if min((*config.windows, *config.memory, config.transfers), default=1) < 1 or min(config.sizes, default=0) < 0:
        raise BenchError(f"in-flight counts and transfers must be >= 1 and sizes >= 0: {config}")
    return config


def main(config: BenchConfig, json_path: str | None = None) -> int:
    """Run the benchmark, print its table, write the report to `json_path` if given.

    :raises BenchError: the P process did not come up or ended without its report.
    """
    report = run(run_bench(config, lambda text: say(sys.stderr, text)))
    say(sys.stdout, render(report))
    if json_path:
        with open(json_path, "w") as out:
            json.dump(asdict(report), out, indent=1)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        size_, window_, n_ = (int(a) for a in sys.argv[2:5])
        run(child_main(size_, window_, n_, sys.argv[5]))
    else:
        parser = argparse.ArgumentParser(prog="python -m kvflow_tools.bench.bench_engine")
        add_arguments(parser)
        arguments = parser.parse_args()
        sys.exit(main(config_from(arguments), arguments.json))
