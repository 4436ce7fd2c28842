"""`kvflow bench floods`: what a stranger's connection flood costs an engine process.

Thread by thread, and how long a genuine peer then takes to connect.

Why: docs/security.md promises that a flood of raw TCP connections costs the event loop next to
nothing (the socket monitor is read on a thread of its own, `kvflow.control.connections`), that
the descriptors a stranger holds are its rate times about twice `handshake_timeout`, and that a
genuine peer still associates and moves KV meanwhile, also at a descriptor limit of 1,024.
Those figures are this command's.  Each run starts P and D (`python -m
kvflow_tools.testing.peer_process`, P optionally with `--nofile`, soft and hard), then one flooding
process (`python -m kvflow_tools.testing.fuzz_process --attack connection_flood`: raw TCP connects
as fast as it can or at `--rate`, each held until P closes it or 5 s pass); once P holds a fifth of the flood
(or 90 % of its limit), D connects (again, as a deployment's next request would, while P
refuses it for want of descriptors or cannot answer) and moves one transfer, whose bytes D checks.  Over the
flood's window it reads CPU per thread of P from /proc/<pid>/task/<tid>/stat (the names of
Python's threads from P itself, libzmq's from /proc), samples P's descriptors, and reports P's
control counters and the machine's load average at the start and the end.

``--attack idle_insiders`` floods with an insider's connections instead: DEALERs holding the
secret's CURVE keys, each completing its handshake and then sending nothing, held until D's
transfer is decided (libzmq reconnects each one P closes); the connections P closed to keep
descriptors free are its ``connections_closed_short`` counter.

``--attack many_names`` is an insider speaking as many engines (`kvflow_tools.testing.many_names`:
one real engine per name, all in one process): every name associates with P, or is refused, before
D connects; the associations are held until D's transfer is decided.  Then D moves a second
transfer, with the names gone.  ``--allowed-peers D`` gives P an allow-list of engine ids, the
bound docs/security.md names for this attacker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from kvflow_tools.bench.peer_driver import ROOT, Side
from kvflow_tools.children import Child, import_path, spawn
from kvflow_tools.errors import BenchError

__all__ = ("add_arguments", "cpu_ticks", "main", "process_ticks", "render", "run_floods")

TICK = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.01  # how often P's descriptors are counted
CONNECT_AT = 0.2  # D connects once P holds this fraction of the flood's connections ...
LIMIT_AT = 0.9  # ... or this fraction of its descriptor limit, whichever comes first
PATIENCE = 30.0  # default seconds D may take to associate, and each side to decide the transfer
ATTEMPT_S = 10.0  # the longest one connect of D's may wait for P's answer
RETRY_S = 0.1  # D's wait before it connects again after P failed it for want of descriptors
SHORT_OF_DESCRIPTORS = ("file descriptors left", "Too many open files", "HandshakeTimeout:")  # how that reads
COUNTERS = (
    "connections_accepted",
    "accept_failed",
    "rejected_handshake",
    "rejected_handshake_protocol",
    "rejected_handshake_auth",
    "connections_closed_short",
)
ATTACKS = ("connection_flood", "idle_insiders", "many_names")


def cpu_ticks(pid: int) -> dict[int, tuple[str, int]]:
    """(comm, utime + stime in clock ticks) of every thread of `pid`, by thread id."""
    found: dict[int, tuple[str, int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            found[int(tid)] = (comm, int(rest[11]) + int(rest[12]))  # fields 14 and 15 of stat(5)
    return found


def process_ticks(pid: int) -> int:
    """utime + stime of the whole process `pid`, threads that ended included, in clock ticks."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    rest = stat[stat.rindex(")") + 2 :].split()
    return int(rest[11]) + int(rest[12])


def _descriptors(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


class _Peak:
    """P's descriptors, counted every `SAMPLE_S` until stopped: the highest and the latest;
    `reached` is set once they were `target` or more."""

    def __init__(self, pid: int, target: int) -> None:
        self.pid, self.target, self.peak, self.now = pid, target, 0, 0
        self.reached = asyncio.Event()
        self._task = asyncio.ensure_future(self._sample())

    async def _sample(self) -> None:
        while True:
            self.now = _descriptors(self.pid)
            self.peak = max(self.peak, self.now)
            if self.now >= self.target:
                self.reached.set()
            await asyncio.sleep(SAMPLE_S)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def _threads(
    before: dict[int, tuple[str, int]],
    after: dict[int, tuple[str, int]],
    names: dict[str, str],
    pid: int,
    seconds: float,
) -> list[dict[str, Any]]:
    rows = []
    for tid, (comm, ticks) in sorted(after.items()):
        name = "loop (MainThread)" if tid == pid else names.get(str(tid), comm)
        used = (ticks - before.get(tid, (comm, 0))[1]) / TICK
        rows.append({"tid": tid, "name": name, "comm": comm, "cpu_pct": round(100 * used / seconds, 2)})
    return rows


async def _settled(p: Side) -> dict[str, Any]:
    """P's control counters once they stopped changing (the monitor thread counts in batches)."""
    last: dict[str, Any] = {}
    for _ in range(20):
        now = (await p.ask(cmd="stats"))["control"]
        if now == last:
            break
        last = now
        await asyncio.sleep(0.25)
    return last


async def _connect(p: Side, d: Side, patience: float) -> tuple[dict[str, Any], list[str]]:
    """D's connect to P, and why its earlier attempts failed.

    P short of descriptors refuses a Hello (`kvflow.runtime.descriptors`), or fails to open what
    the association needs, or cannot even open the socket its answer goes out on (D then hears
    nothing), until the flood's connections time out.  D, like a deployment's next request,
    tries again after such a failure, each attempt within `ATTEMPT_S`, all within `patience`
    seconds; any other failure ends it."""
    deadline, failures = time.monotonic() + patience, list[str]()
    while True:
        left = min(deadline - time.monotonic(), ATTEMPT_S)
        connected = await d.ask(cmd="connect", peer="P", address=p.address, timeout=max(left, 0.1))
        error = str(connected.get("error", ""))
        if connected["event"] == "connected" or not any(why in error for why in SHORT_OF_DESCRIPTORS):
            return connected, failures
        failures.append(error)
        if time.monotonic() + RETRY_S >= deadline:
            return connected, failures
        await asyncio.sleep(RETRY_S)


async def _genuine(p: Side, d: Side, patience: float, tid: str = "genuine") -> dict[str, Any]:
    """D connects to P and moves one transfer (`tid`) of two blocks, whose bytes it checks."""
    start = time.monotonic()
    connected, failures = await _connect(p, d, patience)
    result: dict[str, Any] = {
        "connect_s": round(time.monotonic() - start, 4),
        "connected": connected["event"],
        "attempts": len(failures) + 1,
        "failed_attempts": failures,
    }
    if connected["event"] != "connected":
        return {**result, "completed": False, "error": connected.get("error")}
    common = {"tid": tid, "epoch": 1, "mode": "push"}
    start = time.monotonic()
    await d.ask(cmd="expect", peer="P", blocks=[1, 2], verify=7, **common)
    await p.ask(cmd="kv_ready", peer="D", blocks=[5, 6], seed=7, **common)
    try:
        done = await asyncio.wait_for(d.result_future(tid), patience)
        sent = await asyncio.wait_for(p.result_future(tid), patience)
    except TimeoutError:
        return {**result, "completed": False, "error": "no outcome"}
    ok = done["outcome"] == "succeeded" and sent["outcome"] == "succeeded" and done.get("verified") is True
    return {**result, "transfer_s": round(time.monotonic() - start, 4), "completed": ok, "outcome": done["outcome"]}


def _flooder(attack: str, address: str, connections: int, rate: float, patience: float, prefix: str) -> list[str]:
    """The command line of the process that runs `attack` against P at `address`."""
    if attack == "many_names":  # held until stdin closes
        names = ["--names", str(connections), "--prefix", f"{prefix}-i"]
        return [sys.executable, "-m", "kvflow_tools.testing.many_names", "--address", address, *names]
    argv = [sys.executable, "-m", "kvflow_tools.testing.fuzz_process", "--address", address]
    argv += ["--scale", str(connections), "--attack", attack, "--per-second", str(rate)]
    if attack == "idle_insiders":  # held until D's transfer is decided
        argv += ["--until-stdin-closes", "--hold", str(3 * patience)]
    return argv


async def _flood_run(
    connections: int, nofile: int, rate: float, patience: float, logs: str, attack: str, allowed: str = ""
) -> dict[str, Any]:
    prefix, secret = f"kvflow-floods-{secrets.token_hex(4)}", secrets.token_hex(32)
    env = dict(os.environ, KVFLOW_SECRET=secret, PYTHONPATH=import_path())
    peer = [sys.executable, "-m", "kvflow_tools.testing.peer_process", "--transport", "shm"]
    limit = ["--nofile", str(nofile)] if nofile else []
    limit += ["--allowed-peers", allowed] if allowed else []
    p = Side("P", [*peer, "--name", "P", "--prefix", f"{prefix}-p", *limit], env, f"{logs}/{prefix}-p.stderr")
    d = Side("D", [*peer, "--name", "D", "--prefix", f"{prefix}-d"], env, f"{logs}/{prefix}-d.stderr")
    load_start = os.getloadavg()
    flood: Child | None = None
    try:
        await p.start()
        await d.start()
        names = (await p.ask(cmd="threads"))["names"]
        base = _descriptors(p.pid)
        argv = _flooder(attack, p.address, connections, rate, patience, prefix)
        flood = await spawn(argv, stdin=True, stdout=True, env=env, cwd=ROOT)
        assert flood.stdout is not None
        begin = json.loads(await flood.stdout.readline())
        before, total, began = cpu_ticks(p.pid), process_ticks(p.pid), time.monotonic()
        target = base + max(int(connections * CONNECT_AT), 1)
        peak = _Peak(p.pid, min(target, int(nofile * LIMIT_AT)) if nofile else target)
        ending = asyncio.ensure_future(flood.stdout.readline())
        if attack != "many_names":  # (whose first line comes once every name is decided)
            reached = asyncio.ensure_future(peak.reached.wait())
            await asyncio.wait([ending, reached], return_when=asyncio.FIRST_COMPLETED)
            reached.cancel()
        held, peers = peak.now, len((await p.ask(cmd="stats"))["peers"])
        genuine = {**await _genuine(p, d, patience), "during_flood": not ending.done(), "p_descriptors_then": held}
        flood.close_stdin()  # an insider's connections are held until now
        end = json.loads(await ending)
        after = await _genuine(p, d, patience, "after") if attack == "many_names" else None
        ticks, total, seconds = cpu_ticks(p.pid), process_ticks(p.pid) - total, time.monotonic() - began
        await peak.stop()
        await flood.wait()
        if begin.get("event") != "begin" or "error" in end:
            raise BenchError(f"the flooding process failed: {begin} {end}")
        control = await _settled(p)
        threads = _threads(before, ticks, names, p.pid, seconds)
    finally:
        if flood is not None:
            flood.kill()  # (nothing, when it has exited)
            await flood.wait()
        await d.close()
        await p.close()
    return {
        "attack": attack,
        "nofile": nofile or resource.getrlimit(resource.RLIMIT_NOFILE)[1],
        "connections": end["sent"],
        "refused": end["refused"],
        "opened_s": round(end["opened"], 3),
        "flood_s": round(end["duration"], 3),
        "per_second": round(end["sent"] / end["opened"], 1) if end["opened"] > 0 else 0.0,
        "window_s": round(seconds, 3),
        "threads": threads,
        "process_cpu_pct": round(100 * total / TICK / seconds, 2),
        "p_descriptors": {"before": base, "peak": peak.peak},
        "control": {k: control.get(k, 0) for k in COUNTERS} | {k: v for k, v in control.items() if k not in COUNTERS},
        "genuine": genuine,
        "p_peers_then": peers,
        **(
            {"insider": {k: begin.get(k) for k in ("associated", "refused", "reasons")}}
            if attack == "many_names"
            else {}
        ),
        **({"genuine_after": after} if after is not None else {}),
        "load": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
    }


def _cpu(run: dict[str, Any], prefix: str) -> float:
    named = (t for t in run["threads"] if t["name"].startswith(prefix) or t["comm"].startswith(prefix))
    return sum(float(t["cpu_pct"]) for t in named)


def render(runs: list[dict[str, Any]]) -> str:
    head = (
        f"{'run':>3} {'nofile':>7} {'conns':>6} {'conn/s':>7} {'loop %':>7} {'monitor %':>9} {'ZMQ IO %':>8} "
        f"{'process %':>9} {'peak fds':>8} {'accept_failed':>13} {'rej_handshake':>13} {'connect s':>9} "
        f"{'tries':>5} {'moved':>5} {'load 1m start-end':>17}"
    )
    lines = [head]
    for i, run in enumerate(runs, 1):
        c, g, load = run["control"], run["genuine"], run["load"]
        lines.append(
            f"{i:>3} {run['nofile']:>7} {run['connections']:>6} {run['per_second']:>7.0f} "
            f"{_cpu(run, 'loop'):>7.2f} {_cpu(run, 'kvflow-connections'):>9.2f} {_cpu(run, 'ZMQbg/IO'):>8.2f} "
            f"{run['process_cpu_pct']:>9.2f} {run['p_descriptors']['peak']:>8} {c['accept_failed']:>13} "
            f"{c['rejected_handshake']:>13} {g['connect_s']:>9.3f} "
            f"{g['attempts']:>5} {'yes' if g['completed'] else 'NO':>5} "
            f"{load['start'][0]:>8.2f}-{load['end'][0]:<8.2f}"
        )
        if "insider" in run:  # many_names: what the names got, and D once they left
            insider, after = run["insider"], run["genuine_after"]
            lines.append(
                f"    insider names: {insider['associated']} associated, {insider['refused']} refused "
                f"(P's peers then {run['p_peers_then']}); D during: {'moved' if g['completed'] else g.get('error')}; "
                f"D after the names left: {'moved' if after['completed'] else after.get('error')}"
            )
    return "\n".join(lines)


def run_floods(
    connections: int,
    nofile: int = 0,
    runs: int = 1,
    rate: float = 0.0,
    patience: float = PATIENCE,
    attack: str = "connection_flood",
    allowed: str = "",
) -> list[dict[str, Any]]:
    """`runs` floods of `connections` connections each against a fresh P (`nofile`: its limit;
    `rate`: connections a second, 0 as fast as one process can; `patience`: seconds the genuine
    peer may take to associate, and each side to decide its transfer; `attack`: one of `ATTACKS`;
    `allowed`: P's allow-list of engine ids, comma-separated patterns, empty for any).

    :raises BenchError: a setting is out of range, or a process did not start or failed.
    """
    if connections < 1 or runs < 1 or nofile < 0 or not 0 <= rate < float("inf"):
        raise BenchError("bench floods: --connections and --runs must be >= 1, --nofile and --rate >= 0")
    if attack not in ATTACKS:
        raise BenchError(f"bench floods: --attack must be one of {', '.join(ATTACKS)}, not {attack!r}")
    if not 0 < patience < float("inf"):
        raise BenchError(f"bench floods: --patience must be a positive number of seconds, not {patience}")
    logs = os.environ.get("TMPDIR", "/tmp")

    async def every() -> list[dict[str, Any]]:
        return [await _flood_run(connections, nofile, rate, patience, logs, attack, allowed) for _ in range(runs)]

    return asyncio.run(every())


def main(args: argparse.Namespace) -> int:
    """Print the table; also write the runs as JSON with `--json`.  0 when every genuine
    transfer completed, 1 otherwise."""
    runs = run_floods(
        args.connections, args.nofile, args.runs, args.rate, args.patience, args.attack, args.allowed_peers
    )
    sys.stdout.write(render(runs) + "\n")
    if args.json:
        config = {
            "connections": args.connections, "nofile": args.nofile, "rate": args.rate, "runs": args.runs,
            "attack": args.attack, "allowed_peers": args.allowed_peers,
            "patience": args.patience, "cpus": os.cpu_count(),
        }  # fmt: skip
        Path(args.json).write_text(json.dumps({"config": config, "runs": runs}, indent=1))
    return 0 if all(run["genuine"]["completed"] for run in runs) else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connections", type=int, default=5000, help="raw TCP connections per flood (default 5000)")
    parser.add_argument(
        "--nofile", type=int, default=0, help="the engine's open-files limit, soft and hard (default: inherited)"
    )
    parser.add_argument(
        "--rate", type=float, default=0.0, help="connections a second (default 0: as fast as one process can)"
    )
    parser.add_argument("--runs", type=int, default=1, help="floods, each against a fresh engine (default 1)")
    parser.add_argument(
        "--patience",
        type=float,
        default=PATIENCE,
        help=f"seconds the genuine peer may take to associate, and each side its transfer (default {PATIENCE:g})",
    )
    parser.add_argument(
        "--attack",
        choices=ATTACKS,
        default="connection_flood",
        help="a stranger's raw TCP connections (default), an insider's idle authenticated ones, or an insider's"
        " engines under --connections names",
    )
    parser.add_argument(
        "--allowed-peers", default="", help="P's allow-list of engine ids, comma-separated patterns (default: any)"
    )
    parser.add_argument("--json", help="also write the runs to this file")
