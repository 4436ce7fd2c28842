"""`kvflow soak`: thousands of transfers between two engine processes under random faults.

Why: the failures that lose KV or memory (a block never returned, a page D reads that P did not
write for that transfer, a transfer nobody ever decides, a process that grows) show up after
hours of ordinary traffic mixed with rare faults, not in a unit test.  This command runs P and D
as real processes (`python -m kvflow_tools.testing.peer_process`) and drives `--transfers` push
transfers, `--concurrency` at a time, while it injects faults at random: SIGKILL of a peer and a
restart under the same name, SIGSTOP stalls of up to one and a half leases, lost notifications
(fault injection in the shared-memory transport), and, as root, link flaps between two network
namespaces.  Every transfer's pages carry a per-transfer pattern that D checks.

Counts that must be zero (the exit status is 1 otherwise): leaked blocks (held or quarantined
once everything has settled), stale reads (D's transfer succeeded but its blocks do not hold the
bytes P stamped for it), stuck transfers (a live side gives no outcome within ttl, two leases,
the fence and the longest fault), engine crashes and processes that died unasked.  Also
reported: outcomes per side, verdicts P and D disagree on, RSS / fd / thread drift of both
processes, throughput.  With `--fuzz`, the attacks of `kvflow_tools.testing.fuzz` run against P's
control port meanwhile, and the transfers go on until they are over (`kvflow_tools.bench.soak_fuzz`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvflow.errors import KVFlowError
from kvflow_tools.bench.peer_driver import Side
from kvflow_tools.bench.soak_fuzz import Fuzzer, render_fuzz
from kvflow_tools.children import import_path
from kvflow_tools.errors import BenchError
from kvflow_tools.netns import TwoHosts, unavailable

__all__ = ("FAULTS", "SoakConfig", "main", "render", "run_soak")

FAULTS = ("kill", "stop", "drop", "flap")
MUST_BE_ZERO = ("leaked_blocks", "stale_reads", "stuck_transfers", "engine_crashes", "unexpected_exits")
BLOCK_BYTES = 2 * 2 * 16 * 2 * 32 * 2  # K and V, layers, block_size, heads, head_dim, float16 (peer_process)


@dataclass(frozen=True)
class SoakConfig:
    transfers: int = 10_000
    concurrency: int = 8
    faults: tuple[str, ...] = FAULTS
    fault_interval: float = 2.0  # mean seconds between faults
    lease: float = 1.0
    ttl: float = 5.0
    fence: float = 2.0
    drop_rate: float = 0.002  # fraction of D's notifications lost ("drop")
    transport: str = "nixl"  # "shm" cannot cross network namespaces; see docs/benchmarks.md
    netns: bool | None = None  # None: two namespaces when they can be made here
    seed: int = 0
    max_blocks: int = 4
    fuzz: bool = False
    fuzz_scale: int = 1000
    p_options: tuple[str, ...] = ()  # more `peer_process` options for P (tests inject faults with them)
    peer_options: tuple[str, ...] = ()  # more `peer_process` options for both sides

    def check(self) -> None:
        """:raises BenchError: a value is out of range or a fault is unknown."""
        unknown = sorted(set(self.faults) - set(FAULTS))
        if unknown or self.transfers < 1 or self.concurrency < 1 or not 0 <= self.drop_rate < 1:
            raise BenchError(f"soak: bad settings (unknown faults {unknown}, or a count out of range)")
        if self.transport not in ("shm", "nixl") or min(self.lease, self.ttl, self.fence) <= 0:
            raise BenchError("soak: transport must be shm or nixl, and lease, ttl and fence positive")


class Soak:
    def __init__(self, config: SoakConfig, hosts: TwoHosts | None, log: Any) -> None:
        self.config, self.hosts, self.log = config, hosts, log
        self.rng = random.Random(config.seed)
        self.counts: Counter[str] = Counter()
        self.outcomes: dict[str, Counter[str]] = {"P": Counter(), "D": Counter()}
        self.examples: dict[str, list[str]] = {}
        self.up = asyncio.Event()
        self.stopping = asyncio.Event()
        # timed faults: the first comes by the time a tenth of the transfers have started, whatever
        # the clock (transfers from there wait for it), so a short run is never fault-free by chance
        self.timed_faults = [f for f in config.faults if f in ("kill", "stop") or (f == "flap" and hosts is not None)]
        self.first_fault_by = config.transfers // 10 if self.timed_faults else config.transfers
        self.fault_due, self.first_fault = asyncio.Event(), asyncio.Event()
        self.last_fault = ("none", time.monotonic())
        self.next_id = 0
        self.finished = 0
        self.moved_bytes = 0
        self.notes: list[str] = []
        if "drop" in config.faults and config.transport != "shm":
            self.notes.append("lost notifications are injected by the shm transport only: not run")
        prefix = f"kvflow-soak-{secrets.token_hex(4)}"
        secret = secrets.token_hex(32)
        self.secret = secret
        self.timeline: list[tuple[float, float, str]] = []  # (start, end, D's outcome) of each transfer
        self.fuzzer: Fuzzer | None = None
        self.fuzz_task: asyncio.Future[None] | None = None
        self.prefix = prefix
        self.p = self._side("P", "p", prefix, secret)
        self.d = self._side("D", "d", prefix, secret)
        # the longest any live side may take to decide a transfer, faults included
        self.patience = config.ttl + 2 * config.lease + config.fence + 2 * config.lease + 10

    def _side(self, name: str, side: str, prefix: str, secret: str) -> Side:
        c = self.config
        env = dict(os.environ, KVFLOW_SECRET=secret, PYTHONPATH=import_path(), NIXL_LOG_LEVEL="ERROR")
        options = ["--lease", str(c.lease), "--ttl", str(c.ttl), "--fence", str(c.fence), "--transport", c.transport]
        options += ["--blocks", str(c.concurrency * c.max_blocks), "--prefix", f"{prefix}-{side}"]
        if name == "D" and "drop" in c.faults and c.transport == "shm":
            options += ["--drop-notifications", str(c.drop_rate), "--fault-seed", str(c.seed)]
        launcher: list[str] = []
        if self.hosts is not None:
            launcher = self.hosts.command(side)
            options += ["--bind", f"tcp://{self.hosts.address(side)}:0"]
            env.update(UCX_TLS="tcp", UCX_NET_DEVICES=self.hosts.device(side))
        else:
            env.setdefault("UCX_NET_DEVICES", "lo")
        options += [*c.peer_options, *c.p_options] if name == "P" else list(c.peer_options)
        argv = [*launcher, sys.executable, "-m", "kvflow_tools.testing.peer_process", "--name", name, *options]
        return Side(name, argv, env, f"/tmp/{prefix}-{side}.stderr")

    def note(self, kind: str, text: str) -> None:
        self.counts[kind] += 1
        examples = self.examples.setdefault(kind, [])
        if len(examples) < 5:
            examples.append(text)

    async def connect(self) -> None:
        """D associates with P, retrying while P's grace after a teardown refuses it.

        :raises BenchError: no association within half a minute, or P is gone.
        """
        last: dict[str, Any] = {}
        for _ in range(120):
            if not self.p.alive:
                raise BenchError("D cannot associate with P: P is not running")
            last = await self.d.ask(cmd="connect", peer="P", address=self.p.address, timeout=2.0)
            if last["event"] == "connected":
                return
            await asyncio.sleep(0.25)
        raise BenchError(f"D could not associate with P: {last}")

    async def connected(self) -> bool:
        stats = await self.d.ask(cmd="stats")
        return "P" in stats.get("peers", [])

    # ------------------------------------------------------------------ transfers

    async def worker(self, slot: int) -> None:
        c, k = self.config, self.config.max_blocks
        while self.next_id < c.transfers or self.fuzzing():
            i, self.next_id = self.next_id, self.next_id + 1
            if i >= self.first_fault_by and not self.first_fault.is_set():
                self.fault_due.set()
                await self.first_fault.wait()
            await self.up.wait()
            n = self.rng.randint(1, k)
            blocks = [slot * k + j for j in range(n)]
            await self.transfer(f"t{i}", blocks, seed=c.seed * 1_000_003 + i)
            self.finished += 1
            if self.finished % max(c.transfers // 20, 50) == 0:
                self.p.sample()
                self.d.sample()
                self.log(f"{self.finished}/{c.transfers} transfers, {dict(self.counts)}")

    async def workers(self) -> None:
        await asyncio.gather(*(self.worker(slot) for slot in range(self.config.concurrency)))

    def fuzzing(self) -> bool:
        """Whether attacks still run: transfers go on until they are over (and `transfers` ran)."""
        return self.fuzz_task is not None and not self.fuzz_task.done() and not self.stopping.is_set()

    def attacker(self) -> Fuzzer:
        """The attacker process against P, reachable the way D reaches P."""
        launcher = self.hosts.command("d") if self.hosts is not None else []
        argv = [*launcher, sys.executable, "-m", "kvflow_tools.testing.fuzz_process", "--address", self.p.address]
        argv += ["--scale", str(self.config.fuzz_scale)]
        argv += ["--no-curve"] if "--no-curve" in self.config.p_options else []
        env = dict(os.environ, KVFLOW_SECRET=self.secret, PYTHONPATH=import_path())
        return Fuzzer(argv, env, lambda: self.p.ask(cmd="stats"))

    async def transfer(self, tid: str, blocks: list[int], seed: int) -> None:
        began = time.monotonic()
        started: list[tuple[Side, int, asyncio.Future[dict[str, Any]]]] = []
        common = {"tid": tid, "epoch": 1, "blocks": blocks, "mode": "push", "ttl": self.config.ttl}
        try:
            for side, cmd in (
                (self.d, {"cmd": "expect", "peer": "P", "verify": seed}),
                (self.p, {"cmd": "kv_ready", "peer": "D", "seed": seed}),
            ):
                reply = await side.ask(**common, **cmd)
                if reply["event"] != "started":
                    self.note(f"refused_by_{side.name}", f"{tid}: {reply.get('error')}")
                    break
                # the outcome's future exists from now on, so that the process's end fails it
                started.append((side, side.incarnations, side.result_future(tid)))
        except BenchError as exc:
            self.note("interrupted", f"{tid}: {exc}")
        verdicts: dict[str, dict[str, Any]] = {}
        for side, incarnation, outcome in started:
            try:
                verdicts[side.name] = await asyncio.wait_for(asyncio.shield(outcome), self.patience)
            except TimeoutError:
                if side.alive and side.incarnations == incarnation:
                    self.note("stuck_transfers", f"{tid}: no outcome from {side.name} in {self.patience}s")
                continue
            except BenchError:
                self.note("ended_with_process", f"{tid}: {side.name} was killed before deciding")
                continue
            finally:
                side.forget(tid)
            self.outcomes[side.name][verdicts[side.name]["outcome"]] += 1
        d, p = verdicts.get("D"), verdicts.get("P")
        self.timeline.append((began, time.monotonic(), d["outcome"] if d is not None else "none"))
        if d is not None and d["outcome"] == "succeeded":
            if d.get("verified") is not True:
                self.note("stale_reads", f"{tid}: D succeeded but its blocks hold other bytes ({self.since_fault()})")
            else:
                self.moved_bytes += len(blocks) * BLOCK_BYTES
        if d is not None and p is not None and (d["outcome"] == "succeeded") != (p["outcome"] == "succeeded"):
            self.note("disagreements", f"{tid}: P {p['outcome']} ({p['reason']}), D {d['outcome']} ({d['reason']})")
        for side, incarnation, _ in started:
            if not await side.released(tid, blocks, self.patience, incarnation):
                self.note("slow_releases", f"{tid}: {side.name} kept blocks {blocks} for {self.patience}s")

    # ------------------------------------------------------------------ faults

    async def faults(self) -> None:
        c, timed = self.config, self.timed_faults
        try:
            while timed and not await self.stopping_within(self.rng.expovariate(1 / c.fault_interval), self.fault_due):
                fault, side = self.rng.choice(timed), self.rng.choice([self.p, self.d])
                self.counts[f"fault_{fault}"] += 1
                self.last_fault = (f"{fault} of {side.name}" if fault != "flap" else "flap", time.monotonic())
                self.first_fault.set()
                if fault == "kill":
                    await self.restart(side)
                elif fault == "stop":
                    side.signal(signal.SIGSTOP)
                    await asyncio.sleep(self.rng.uniform(0.2, 1.5) * c.lease)
                    side.signal(signal.SIGCONT)
                elif self.hosts is not None:
                    self.hosts.cut()
                    await asyncio.sleep(self.rng.uniform(0.2, 1.5) * c.lease)
                    self.hosts.restore()
        finally:
            self.first_fault.set()  # no worker waits for a fault that will not come

    async def keep_connected(self) -> None:
        """Associate D with P again whenever a stall or a flap made either tear the other down."""
        while not await self.stopping_within(self.config.lease / 2):
            await self.up.wait()
            with contextlib.suppress(BenchError):
                if not await self.connected():
                    self.counts["reconnects"] += 1
                    await self.connect()

    def since_fault(self) -> str:
        kind, at = self.last_fault
        return f"last fault: {kind}, began {time.monotonic() - at:.1f} s ago"

    async def stopping_within(self, delay: float, early: asyncio.Event | None = None) -> bool:
        """Sleep `delay`, or less if the run ends (or, before the first fault, `early` is set):
        whether it ended.  Faults and reconnections are never cancelled half-way (a cancelled
        command would leave its reply to the next one)."""
        waits = [asyncio.ensure_future(self.stopping.wait())]
        if early is not None and not self.first_fault.is_set():
            waits.append(asyncio.ensure_future(early.wait()))
        _, pending = await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        for waiting in pending:
            waiting.cancel()
        return self.stopping.is_set()

    async def restart(self, side: Side) -> None:
        """SIGKILL `side` and start it again under the same name and shared-memory prefix.

        :raises BenchError: the new process did not start or associate (noted with its reason).
        """
        self.up.clear()
        try:
            await side.kill()
            try:
                await side.start()
            except BenchError as exc:
                self.notes.append(f"restart of {side.name} under the same name failed: {exc}")
                raise
            await self.connect()
        finally:
            self.up.set()

    # ------------------------------------------------------------------ the run

    async def run(self) -> dict[str, Any]:
        c = self.config
        await self.p.start()
        await self.d.start()
        await self.connect()
        self.up.set()
        if c.fuzz:
            self.fuzzer = self.attacker()
            self.fuzz_task = asyncio.ensure_future(self.fuzzer.run())
        began = time.monotonic()
        faults = asyncio.ensure_future(self.faults())
        keeper = asyncio.ensure_future(self.keep_connected())
        workers = asyncio.ensure_future(self.workers())
        aborted = ""
        try:
            done, _ = await asyncio.wait([workers, faults], return_when=asyncio.FIRST_COMPLETED)
            if faults in done and faults.exception() is not None:
                aborted = f"{type(faults.exception()).__name__}: {faults.exception()}"
                self.next_id = c.transfers
                self.stopping.set()
            await workers
        finally:
            self.stopping.set()
            for task in (faults, keeper):
                with contextlib.suppress(KVFlowError):  # a fault's failure is in `aborted`
                    await task
            for side in (self.p, self.d):
                side.signal(signal.SIGCONT)
            if self.hosts is not None:
                with contextlib.suppress(BenchError):
                    self.hosts.restore()
        elapsed = time.monotonic() - began
        report = await self.settle() if not aborted else {}
        for side in (self.p, self.d):
            side.sample()
        if self.fuzzer is not None and self.fuzz_task is not None:
            await self.fuzz_task
            report["fuzz"] = self.fuzzer.report(self.timeline, self.p.drift()["last"])
        for side in (self.p, self.d):
            await side.close()
        self.counts["unexpected_exits"] = self.p.unexpected_exits + self.d.unexpected_exits
        if exits := [*self.p.exits, *self.d.exits]:
            self.examples["unexpected_exits"] = exits[:5]
        self.notes += [f"{side.name} printed: {line}" for side in (self.p, self.d) for line in side.stray]
        report.update(self.summary(elapsed, aborted))
        if report.get("fuzz", {}).get("failure"):  # a phase that did not do what it claims fails the run
            report["ok"] = False
        return report

    async def settle(self) -> dict[str, Any]:
        """Wait for both sides to hold no block and run no transfer; what stays is leaked."""
        leaked, crashes, last = 0, 0, dict[str, dict[str, Any]]()
        for side in (self.p, self.d):
            end = time.monotonic() + self.patience
            while True:
                stats = await side.ask(cmd="stats")
                held = stats["held_blocks"] + stats["quarantined_blocks"]
                if (held == 0 and stats["live_transfers"] == 0) or time.monotonic() > end:
                    break
                await asyncio.sleep(0.1)
            leaked += held
            crashes += stats["crashed"]
            keep = ("held_blocks", "quarantined_blocks", "live_transfers", "crashed", "dropped_notifications")
            last[side.name] = {k: stats.get(k) for k in keep}
        self.counts["dropped_notifications"] = sum(s.get("dropped_notifications") or 0 for s in last.values())
        self.counts["leaked_blocks"] += leaked
        self.counts["engine_crashes"] += crashes
        return {"final_stats": last}

    def summary(self, elapsed: float, aborted: str) -> dict[str, Any]:
        c = self.config
        done = sum(self.outcomes["D"].values())
        must = {k: self.counts[k] for k in MUST_BE_ZERO}
        return {
            "must_be_zero": must,
            "ok": not aborted and not any(must.values()),
            "aborted": aborted,
            "transfers": self.finished,
            "outcomes": {side: dict(counts) for side, counts in self.outcomes.items()},
            "counts": {k: v for k, v in sorted(self.counts.items()) if k not in must},
            "examples": self.examples,
            "drift": {"P": self.p.drift(), "D": self.d.drift()},
            "elapsed_s": round(elapsed, 2),
            "transfers_per_s": round(self.finished / elapsed, 1) if elapsed else 0.0,
            "succeeded_per_s": round(self.outcomes["D"]["succeeded"] / elapsed, 1) if elapsed else 0.0,
            "verified_mb_per_s": round(self.moved_bytes / elapsed / 1e6, 3) if elapsed else 0.0,
            "decided_by_d": done,
            "notes": self.notes,
            "config": {**asdict(c), "netns": self.hosts is not None},
        }


@contextlib.contextmanager
def _hosts(config: SoakConfig) -> Iterator[TwoHosts | None]:
    wanted = config.netns if config.netns is not None else ("flap" in config.faults and unavailable() is None)
    if not wanted or config.transport == "shm":  # shm notifies over abstract sockets, one per namespace
        yield None
        return
    with TwoHosts() as hosts:
        yield hosts


def run_soak(config: SoakConfig, log: Any = None) -> dict[str, Any]:
    """Run the soak and return its report (see the module docstring).

    :raises BenchError: bad settings, or a peer could not be started at the beginning.
    :raises ConfigError: the network namespaces could not be made.
    """
    config.check()
    say = log or (lambda text: None)
    with _hosts(config) as hosts:
        soak = Soak(config, hosts, say)
        try:
            return asyncio.run(soak.run())
        finally:
            for leftover in sorted(Path("/dev/shm").glob(f"{soak.prefix}*"), reverse=True):  # files, then dirs
                soak.notes.append(f"left in /dev/shm (now removed): {leftover.name}")
                for item in leftover.iterdir() if leftover.is_dir() else ():
                    item.unlink()
                leftover.rmdir() if leftover.is_dir() else leftover.unlink()
            for log_file in (soak.p.log_path, soak.d.log_path):
                Path(log_file).unlink(missing_ok=True)


def render(report: dict[str, Any]) -> str:
    lines = [f"kvflow soak: {report['transfers']} transfers in {report['elapsed_s']} s"]
    for key, value in report["must_be_zero"].items():
        lines.append(f"  {key:<18} {value}{'' if value == 0 else '   <-- must be 0'}")
    lines.append(f"  outcomes           P {report['outcomes']['P']}  D {report['outcomes']['D']}")
    lines.append(f"  other counts       {report['counts']}")
    for side, drift in report["drift"].items():
        shown = {key: value for key, value in drift.items() if key != "samples"}
        lines.append(f"  {side} drift            {shown}")
    lines.append(
        f"  throughput         {report['transfers_per_s']} transfers/s, {report['succeeded_per_s']} succeeded/s, "
        f"{report['verified_mb_per_s']} MB/s verified"
    )
    for key, value in report["must_be_zero"].items():
        lines += [f"  {key}: {example}" for example in report["examples"].get(key, [])[:3] if value]
    for note in report["notes"]:
        lines.append(f"  note: {note}")
    if report["aborted"]:
        lines.append(f"  ABORTED: {report['aborted']}")
    if "fuzz" in report:
        lines += render_fuzz(report["fuzz"])
    lines.append("OK" if report["ok"] else "FAILED")
    return "\n".join(lines)


def main(config: SoakConfig, json_path: str | None = None, quiet: bool = False) -> int:
    """:raises BenchError, ConfigError: see `run_soak`."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # so namespaces are removed
    try:
        report = run_soak(config, log=None if quiet else lambda text: sys.stderr.write(text + "\n"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    sys.stdout.write(render(report) + "\n")
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0 if report["ok"] else 1
