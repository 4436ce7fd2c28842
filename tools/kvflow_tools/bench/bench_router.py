"""`kvflow bench router`: what hostile HTTP clients can make kvflow's P/D router hold, measured.

Why: docs/security.md says what the router's client limits (`kvflow_tools.routing.http_limits`)
and its bound on P's answer leave a client able to hold; these are the measurements behind it,
reproducible from the tree.  The real router runs as its own process in front of a fake P (it
answers with ``kv_transfer_params``, or endlessly) and a fake D (it streams) served by aiohttp in
this process (`kvflow_tools.bench.router_stand`); the router's descriptors, memory and CPU are read
from /proc.  A fresh router for each scenario:

* ``slowloris``: `trickling` connections sending their request head a byte every
  `trickle_interval` s and `idle` keep-alive connections silent after one answer; the router's
  descriptors sampled for `duration` s, a genuine request sent once all are open, the refusals
  counted at ``GET /limits``;
* ``bodies``: `bodies` requests of `body_mib` MiB at once: their statuses, the router's VmRSS
  before, once every body taken is at P and D (P holding its answer), and while D's answers
  stream, and its VmHWM;
* ``endless``: P answers without end: the status the client gets and the router's memory;
* ``latency``: `requests` small requests one after another: median and p90 latency, the
  router's CPU (utime + stime) per request;
* ``lockout``: `lockout_idle` keep-alive connections from `lockout_addresses` loopback
  addresses (127.0.0.2 on), each answered once and then idle, against a router at
  ``--max-connections`` `lockout_cap` (unless the options give one); then `genuine` requests
  from 127.0.0.1, each on a new connection: how many were served, how many idle connections
  were closed to make room, how many hostile ones are still open.

Each run of a scenario records the load average at its start and end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvflow.runtime.meter import quantile
from kvflow_tools.bench.router_stand import (
    MIB,
    WAIT,
    Backends,
    Post,
    Stand,
    get_request,
    padded,
    read_answer,
    stand,
    until,
    until_closed,
)
from kvflow_tools.errors import BenchError
from kvflow_tools.routing import legs

__all__ = ("SCENARIOS", "RouterBenchConfig", "add_arguments", "config_from", "main", "run_bench")

SCENARIOS = ("slowloris", "bodies", "endless", "latency", "lockout")
SAMPLE_EVERY = 0.25  # seconds between samples of the router's descriptors


@dataclass(frozen=True)
class RouterBenchConfig:
    scenarios: tuple[str, ...] = SCENARIOS
    runs: int = 1
    trickling: int = 200  # slowloris: connections trickling their head
    idle: int = 20  # slowloris: idle keep-alive connections
    duration: float = 15.0  # slowloris: seconds the descriptors are sampled, from when all are open
    grace: float = 0.0  # slowloris: seconds more, past `duration`, for the router to close them all
    trickle_interval: float = 1.0  # slowloris: seconds between two bytes of a trickling head
    bodies: int = 6  # bodies: requests at once
    body_mib: float = 60.0  # bodies: each one's size
    endless_mib: float = 2048.0  # endless: P stops here if the router never stops reading
    requests: int = 2000  # latency: measured requests
    warmup: int = 50  # latency: unmeasured requests first
    lockout_idle: int = 320  # lockout: idle keep-alive connections
    lockout_addresses: int = 4  # lockout: loopback addresses they come from
    lockout_cap: int = 320  # lockout: the router's --max-connections, unless router_options give one
    genuine: int = 20  # lockout: genuine requests once the idle ones are open
    router_options: tuple[str, ...] = ()  # passed to the router (its limits)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.scenarios) - set(SCENARIOS))
        if unknown:
            raise BenchError(f"unknown scenarios {unknown}: choose from {', '.join(SCENARIOS)}")
        if not 1 <= self.lockout_addresses <= 250:
            raise BenchError("--lockout-addresses must be within 1..250 (127.0.0.2 on)")
        if self.lockout_cap < 1:
            raise BenchError("--lockout-cap must be >= 1")
        for name in ("runs", "trickling", "bodies", "requests", "lockout_idle", "genuine"):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("duration", "trickle_interval", "body_mib", "endless_mib"):
            if not getattr(self, name) > 0:
                raise BenchError(f"--{name.replace('_', '-')} must be positive")


# ---------------------------------------------------------------- the scenarios


async def slowloris(config: RouterBenchConfig, live: Stand) -> dict[str, Any]:
    fds_before = live.router.fds()
    address = live.address
    idle, trickling = [], []
    for _ in range(config.idle):
        reader, writer = await asyncio.open_connection(*address)
        writer.write(get_request("/health"))
        if await read_answer(reader) != 200:
            raise BenchError("GET /health on an idle connection was not answered 200")
        idle.append((reader, writer))
    for _ in range(config.trickling):
        reader, writer = await asyncio.open_connection(*address)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nX-Slow: ")
        trickling.append((reader, writer))
    start = time.monotonic()
    connections = idle + trickling
    open_now = [True] * len(connections)
    closed_after: list[float] = []
    all_closed = asyncio.Event()

    async def watch(index: int, reader: asyncio.StreamReader) -> None:
        await until_closed(reader)
        open_now[index] = False
        closed_after.append(time.monotonic() - start)
        if not any(open_now):
            all_closed.set()

    async def trickle() -> None:
        while True:
            for index, (_, writer) in enumerate(trickling, start=len(idle)):
                if open_now[index] and not writer.is_closing():
                    writer.write(b"x")
            await asyncio.sleep(config.trickle_interval)

    samples: list[tuple[float, int, int]] = []

    async def sample() -> None:
        while True:
            samples.append((round(time.monotonic() - start, 3), live.router.fds(), sum(open_now)))
            await asyncio.sleep(SAMPLE_EVERY)

    tasks = [asyncio.create_task(watch(i, reader)) for i, (reader, _) in enumerate(connections)]
    tasks += [asyncio.create_task(trickle()), asyncio.create_task(sample())]
    try:
        open_for_genuine = sum(open_now)
        genuine = (await live.complete())[0]
        await asyncio.sleep(max(0.0, config.duration - (time.monotonic() - start)))
        fds_at_duration, open_at_duration = live.router.fds(), sum(open_now)
        grace_left = max(0.0, start + config.duration + config.grace - time.monotonic())
        with suppress(TimeoutError):  # the router closes them all, or the grace is over
            await asyncio.wait_for(all_closed.wait(), grace_left)
        fds_end, open_end, end = live.router.fds(), sum(open_now), time.monotonic() - start
        refused = (await live.limits())["refused"]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, writer in connections:
            writer.close()
    return {
        "trickling": config.trickling,
        "idle": config.idle,
        "duration_s": config.duration,
        "fds_before": fds_before,
        "fds_max": max(fds for _, fds, _ in samples),
        "fds_at_duration": fds_at_duration,
        "open_at_duration": open_at_duration,
        "fds_end": fds_end,
        "open_end": open_end,
        "end_s": round(end, 3),
        "last_closed_s": round(max(closed_after), 3) if closed_after else None,
        "genuine_status": genuine,
        "open_when_genuine_sent": open_for_genuine,
        "refused": refused,
        "samples": samples,  # (seconds since all were open, descriptors, hostile connections open)
    }


async def bodies(config: RouterBenchConfig, live: Stand) -> dict[str, Any]:
    backends = live.backends
    backends.hold_p, backends.hold_d = asyncio.Event(), asyncio.Event()
    body = padded(int(config.body_mib * MIB))
    before = live.router.memory()
    posts = [Post() for _ in range(config.bodies)]
    tasks = [asyncio.create_task(post.run(live.address, body)) for post in posts]
    try:

        def answered() -> int:  # before P is released, an answer is a refusal
            return sum(post.status is not None or post.reset for post in posts)

        def all_dispatched() -> bool:
            return all(backends.arrived[leg] + answered() >= config.bodies for leg in "PD")

        await until(all_dispatched, "every body taken at P and D, the others answered")
        taken = backends.arrived["P"]
        dispatched = live.router.memory()
        backends.hold_p.set()
        await until(lambda: sum(post.streaming for post in posts) >= taken, "D's answers streaming")
        streaming = live.router.memory()
        backends.hold_d.set()
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    limits = await live.limits()
    held = taken * len(body)
    peak = max(streaming["VmHWM"], dispatched["VmRSS"])  # the kernel's counts of RSS lag a little
    return {
        "bodies": config.bodies,
        "body_bytes": len(body),
        "taken": taken,
        "statuses": {str(k): v for k, v in sorted(Counter(post.status for post in posts).items(), key=str)},
        "reset": sum(post.reset for post in posts),
        "rss_before": before["VmRSS"],
        "rss_dispatched": dispatched["VmRSS"],
        "rss_streaming": streaming["VmRSS"],
        "rss_peak": peak,
        "growth_dispatched": dispatched["VmRSS"] - before["VmRSS"],
        "growth_peak": peak - before["VmRSS"],
        "growth_streaming": streaming["VmRSS"] - before["VmRSS"],
        "dispatched_per_body_held": (dispatched["VmRSS"] - before["VmRSS"]) / held if held else None,
        "peak_per_body_held": (peak - before["VmRSS"]) / held if held else None,
        "refused": limits["refused"],
        "body_bytes_in_flight_after": limits["body_bytes_in_flight"],
    }


async def endless(config: RouterBenchConfig, live: Stand) -> dict[str, Any]:
    live.backends.endless = True
    live.backends.endless_cap = int(config.endless_mib * MIB)
    before = live.router.memory()
    status, answer = await live.complete()
    after = live.router.memory()
    try:
        message = json.loads(answer)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = answer[:200].decode(errors="replace")
    return {
        "status": status,
        "message": message,
        "bound": legs.MAX_PREFILL_ANSWER,
        "p_sent": live.backends.p_sent,
        "rss_before": before["VmRSS"],
        "rss_after": after["VmRSS"],
        "rss_peak": after["VmHWM"],
        "growth_peak": after["VmHWM"] - before["VmRSS"],
    }


async def latency(config: RouterBenchConfig, live: Stand) -> dict[str, Any]:
    body = {"prompt": "hello", "max_tokens": 4, "stream": True}
    statuses: Counter[int] = Counter()
    times: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as http:  # kept alive

        async def one() -> float:
            began = time.perf_counter()
            async with http.post(live.url + "/v1/completions", json=body) as response:
                await response.read()
                statuses[response.status] += 1
            return time.perf_counter() - began

        for _ in range(config.warmup):
            await one()
        statuses.clear()
        cpu = live.router.cpu_seconds()
        for _ in range(config.requests):
            times.append(await one())
        cpu = live.router.cpu_seconds() - cpu
    ordered = sorted(times)
    return {
        "requests": config.requests,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "median_ms": quantile(ordered, 0.5) * 1e3,
        "p90_ms": quantile(ordered, 0.9) * 1e3,
        "router_cpu_ms_per_request": cpu * 1e3 / config.requests,
    }


async def lockout(config: RouterBenchConfig, live: Stand) -> dict[str, Any]:
    hostile: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    refused_while_opening = 0
    try:
        for index in range(config.lockout_idle):
            source = f"127.0.0.{2 + index % config.lockout_addresses}"
            reader, writer = await asyncio.open_connection(*live.address, local_addr=(source, 0))
            writer.write(get_request("/health"))
            try:
                if await asyncio.wait_for(read_answer(reader), WAIT) != 200:
                    raise BenchError("GET /health on a hostile connection was not answered 200")
            except (ConnectionError, asyncio.IncompleteReadError):
                refused_while_opening += 1  # closed by the router: refused, or evicted already
            hostile.append((reader, writer))
        served, failed = 0, Counter[str]()
        started = time.monotonic()
        for _ in range(config.genuine):
            try:
                status, _ = await live.complete()
            except aiohttp.ClientError as error:
                failed[type(error).__name__] += 1
                continue
            served += status == 200
            if status != 200:
                failed[str(status)] += 1
        genuine_s = time.monotonic() - started
        still_open = sum(not reader.at_eof() and not writer.is_closing() for reader, writer in hostile)
        try:
            limits = await live.limits()
        except aiohttp.ClientError:  # a router that keeps the idle ones refuses this one too
            limits = {"limits": {"max_connections": None}, "refused": {}}
    finally:
        for _, writer in hostile:
            writer.close()
    return {
        "hostile": config.lockout_idle,
        "addresses": config.lockout_addresses,
        "max_connections": limits["limits"]["max_connections"],
        "max_connections_per_client": limits["limits"].get("max_connections_per_client"),  # None: no share
        "refused_while_opening": refused_while_opening,
        "genuine": config.genuine,
        "genuine_served": served,
        "genuine_failed": dict(failed),
        "genuine_s": round(genuine_s, 3),
        "hostile_still_open": still_open,
        "refused": limits["refused"],
    }


def _options(config: RouterBenchConfig, scenario: str) -> tuple[str, ...]:
    """The router's options for `scenario`: the config's, and lockout's cap unless they give one."""
    if scenario == "lockout" and "--max-connections" not in config.router_options:
        return (*config.router_options, "--max-connections", str(config.lockout_cap))
    return config.router_options


RUNNERS: dict[str, Callable[[RouterBenchConfig, Stand], Awaitable[dict[str, Any]]]] = {
    "slowloris": slowloris,
    "bodies": bodies,
    "endless": endless,
    "latency": latency,
    "lockout": lockout,
}


async def run_bench(config: RouterBenchConfig, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every scenario, run after run (scenarios in turns within each run), a fresh router each."""
    records = []
    for run in range(1, config.runs + 1):
        for scenario in config.scenarios:
            load_start = os.getloadavg()
            async with stand(Backends(), _options(config, scenario)) as live:
                figures = await RUNNERS[scenario](config, live)
            record = {"scenario": scenario, "run": run, "load_start": load_start, "load_end": os.getloadavg()}
            records.append(record | figures)
            if progress is not None:
                progress(row(records[-1]))
    return records


# ---------------------------------------------------------------- output


def _mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


def summary(record: dict[str, Any]) -> str:
    """One line of what the run of a scenario found."""
    scenario, refused = record["scenario"], record.get("refused", {})
    if scenario == "slowloris":
        return (
            f"{record['trickling']} trickling + {record['idle']} idle: descriptors {record['fds_before']}, at most "
            f"{record['fds_max']}, {record['fds_at_duration']} after {record['duration_s']:g} s "
            f"({record['open_at_duration']} still open); genuine request {record['genuine_status']}; refused "
            f"header_timeout {refused['header_timeout']}, idle {refused['idle']}"
        )
    if scenario == "bodies":
        statuses = ", ".join(f"{n} x {status}" for status, n in record["statuses"].items())
        return (
            f"{record['bodies']} x {_mib(record['body_bytes'])}: {statuses}; router RSS "
            f"{_mib(record['rss_before'])}, +{_mib(record['growth_dispatched'])} dispatched, peak "
            f"+{_mib(record['growth_peak'])}, +{_mib(record['growth_streaming'])} while D streams; "
            f"refused body_budget {refused['body_budget']}"
        )
    if scenario == "endless":
        return (
            f"{record['status']} once P had sent {_mib(record['p_sent'])}; router RSS {_mib(record['rss_before'])}, "
            f"peak +{_mib(record['growth_peak'])}"
        )
    if scenario == "lockout":
        failed = ", ".join(f"{n} x {why}" for why, n in record["genuine_failed"].items()) or "none failed"
        return (
            f"{record['hostile']} idle from {record['addresses']} addresses at --max-connections "
            f"{record['max_connections']} (per client {record['max_connections_per_client']}): genuine "
            f"{record['genuine_served']} of {record['genuine']} served in {record['genuine_s']:.2f} s ({failed}); "
            f"idle ones closed for room {refused.get('evicted', '?')}, refused client_share "
            f"{refused.get('client_share', '?')}, "
            f"connections {refused.get('connections', '?')}; hostile still open {record['hostile_still_open']}"
        )
    statuses = ", ".join(f"{n} x {status}" for status, n in record["statuses"].items())
    return (
        f"{statuses}: median {record['median_ms']:.2f} ms, p90 {record['p90_ms']:.2f} ms; router CPU "
        f"{record['router_cpu_ms_per_request']:.2f} ms a request"
    )


def row(record: dict[str, Any]) -> str:
    load = f"{record['load_start'][0]:.2f}-{record['load_end'][0]:.2f}"
    return f"{record['run']:>3}  {record['scenario']:9}  {load:>9}  {summary(record)}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", default=",".join(SCENARIOS), help="comma-separated (default: all)")
    parser.add_argument("--runs", type=int, default=1, help="runs of every scenario, in turns (default 1)")
    parser.add_argument("--trickling", type=int, default=200, help="slowloris: connections trickling a head")
    parser.add_argument("--idle", type=int, default=20, help="slowloris: idle keep-alive connections")
    parser.add_argument("--duration", type=float, default=15.0, help="slowloris: seconds sampled once all are open")
    parser.add_argument("--grace", type=float, default=0.0, help="slowloris: seconds more for the router to close all")
    parser.add_argument("--trickle-interval", type=float, default=1.0, help="slowloris: seconds between head bytes")
    parser.add_argument("--bodies", type=int, default=6, help="bodies: requests at once")
    parser.add_argument("--body-mib", type=float, default=60.0, help="bodies: MiB each")
    parser.add_argument("--endless-mib", type=float, default=2048.0, help="endless: where P stops if never stopped")
    parser.add_argument("--requests", type=int, default=2000, help="latency: measured requests")
    parser.add_argument("--warmup", type=int, default=50, help="latency: unmeasured requests first")
    parser.add_argument("--lockout-idle", type=int, default=320, help="lockout: idle keep-alive connections")
    parser.add_argument("--lockout-addresses", type=int, default=4, help="lockout: loopback addresses they use")
    parser.add_argument("--lockout-cap", type=int, default=320, help="lockout: the router's --max-connections")
    parser.add_argument("--genuine", type=int, default=20, help="lockout: genuine requests after them")
    limits = (
        "--header-timeout",
        "--idle-timeout",
        "--body-timeout",
        "--body-budget",
        "--max-body",
        "--max-connections",
        "--max-connections-per-client",
    )
    for option in limits:
        parser.add_argument(option, default=None, help=f"the router's {option} (default: its own)")
    parser.add_argument("--json", default=None, help="also write every run's figures to this JSON file")


def config_from(args: argparse.Namespace) -> RouterBenchConfig:
    options: list[str] = []
    limits = ("header_timeout", "idle_timeout", "body_timeout", "body_budget", "max_body", "max_connections")
    for name in (*limits, "max_connections_per_client"):
        if getattr(args, name) is not None:
            options += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return RouterBenchConfig(
        scenarios=tuple(part.strip() for part in args.scenario.split(",") if part.strip()),
        runs=args.runs,
        trickling=args.trickling,
        idle=args.idle,
        duration=args.duration,
        grace=args.grace,
        trickle_interval=args.trickle_interval,
        bodies=args.bodies,
        body_mib=args.body_mib,
        endless_mib=args.endless_mib,
        requests=args.requests,
        warmup=args.warmup,
        lockout_idle=args.lockout_idle,
        lockout_addresses=args.lockout_addresses,
        lockout_cap=args.lockout_cap,
        genuine=args.genuine,
        router_options=tuple(options),
    )


def main(config: RouterBenchConfig, json_path: str | None = None) -> int:
    """Print a row per run of a scenario as it ends; write them all to `json_path`."""
    sys.stdout.write(f"{'run':>3}  {'scenario':9}  {'load':>9}  figures\n")

    def progress(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    records = asyncio.run(run_bench(config, progress))
    if json_path:
        Path(json_path).write_text(json.dumps({"config": asdict(config), "runs": records}, indent=1))
    return 0
