"""`kvflow bench serve`: real vLLM OpenAI servers in 1P1D, open-loop streaming load, per system.

Why on real servers: `kvflow bench pd` models GPU step times on a stand-in; this one runs
vLLM's own engines, API servers and connectors (the CPU build) behind kvflow's router, and a
real HTTP client, so that what it reports (TTFT at the first streamed token, TPOT, end to end,
failures, KV moved, the engines' CPU) is what a user of `kvflow serve` would see here.

Systems: ``kvflow`` (push) and ``kvflow-pull`` share one pair (kvflow's connector, one router
per dispatch mode); ``kvflow-spin`` is kvflow's push on a pair of its own whose engine core
steps without pause while requests wait for KV, as vLLM's does (``idle_sleep`` 0: what the
sleep costs or saves); ``vllm-pull`` is vLLM's NixlConnector (router mode sequential, as vLLM's
proxy), ``vllm-push`` its NixlPushConnector (router mode nixl-push).  The systems are
interleaved: at each rate they take turns, the first rotating from rate to rate, and every pair
not taking its turn is stopped (SIGSTOP), so that the machine's drift falls on all alike and an
idle pair takes no CPU from the measured one.  An engine costs gigabytes: when the pairs do not
all fit in ``--max-engines``, the run goes in phases, kvflow's pair in every phase and vLLM's
pairs in turn beside it, so that each vLLM connector is compared with kvflow measured in the
same stretch of time (and kvflow's figures from two phases show the drift between them).

Fair to vLLM by default: its NIXL agents' progress threads sleep 1 ms between polls (stock NIXL
polls without pause, a core per agent, which on a small host measures the host; ``-1`` asks for
it, and the header says which ran), and its workers stay on the cores they were bound to (vLLM's
NIXL worker would pin P's and D's model runners to the host's last core; the launcher).
Each phase runs ``--repeats`` times, the first system of a
rate rotating from repetition to repetition, and the report gives the spread between them.
Every finished phase is written out before the next starts, and a phase that fails (a server
that does not start, a warm-up that does not answer) is recorded with its cause while the run
goes on to the next: one system cannot lose the others' figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvflow.errors import ConfigError
from kvflow_tools.errors import BenchError
from kvflow_tools.pd.workload import Arrival, LengthDist, arrivals
from kvflow_tools.serve.client import Result, deltas, group_usage, metric_sum, run_requests
from kvflow_tools.serve.launcher import Deployment, ServeOptions, Server, check_progress_delay
from kvflow_tools.serve.processes import ServerFailed, http_ok
from kvflow_tools.serve.tiny_model import TinyModel, write_model

__all__ = ("MODEL", "SYSTEMS", "add_arguments", "main", "plan_phases")

# system -> (its pair of servers, the router's mode)
SYSTEMS = {
    "kvflow": ("kvflow", "push"),
    "kvflow-pull": ("kvflow", "pull"),
    "kvflow-first": ("kvflow", "push+first"),  # the first token from P's answer (the router's --first-token)
    "kvflow-spin": ("kvflow-spin", "push"),  # vLLM's engine core stepping without pause while requests wait
    "vllm-pull": ("nixl", "sequential"),
    "vllm-push": ("nixl-push", "nixl-push"),
}
# pair -> (its servers' connector, the kvflow settings that differ from the connector's own)
PAIRS: dict[str, tuple[str, dict[str, Any]]] = {
    "kvflow": ("kvflow", {}),
    "kvflow-spin": ("kvflow", {"idle_sleep": 0.0}),
    "nixl": ("nixl", {}),
    "nixl-push": ("nixl-push", {}),
}
# Many KV heads and layers, a small hidden size: 32 KiB of float32 KV a token (1 MiB a 32-token
# prompt), little compute a token, so that moving the KV is a real share of a request's time.
MODEL = TinyModel(num_layers=32, hidden_size=128, num_heads=4, num_kv_heads=4, intermediate_size=256)
DTYPE_BYTES = 4  # float32
QUICK = {"qps": [1.0, 2.0], "requests": 24, "prompt": "uniform:256:1024", "output": "uniform:8:24", "idle": 2.0}
FULL = {"qps": [0.5, 1.0, 2.0], "requests": 24, "prompt": "uniform:512:2048", "output": "uniform:16:48", "idle": 4.0}
ENGINE_GIB = 3.0  # what one engine may take (measured RSS is reported), for the memory check
MARGIN_GIB = 2.0  # left free for everything else on the machine
WARMUP = 2  # unmeasured requests per system after its pair starts: connections, NIXL handshakes
TRANSFER_METRICS = ("kvflow", "nixl")  # vllm:<name>_bytes_transferred_sum on P and D
DEFAULT_PROGRESS_DELAY_US = 1000  # vLLM's NIXL agents: what the anchor tests and bench pd use


def kv_bytes_per_token(model: TinyModel = MODEL) -> int:
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * DTYPE_BYTES


def plan_phases(connectors: list[str], max_pairs: int) -> list[list[str]]:
    """Which deployments are alive together: all at once if they fit in `max_pairs`, else the
    first (kvflow's) in every phase with the others in turn, `max_pairs - 1` at a time.

    :raises ConfigError: not even two pairs fit while more than one is needed.
    """
    if len(connectors) <= max_pairs:
        return [list(connectors)]
    if max_pairs < 2:
        raise ConfigError(f"{len(connectors)} pairs to compare, room for {max_pairs}: allow at least 4 engines")
    first, rest = connectors[0], connectors[1:]
    return [[first, *rest[i : i + max_pairs - 1]] for i in range(0, len(rest), max_pairs - 1)]


def rotated(names: list[str], turn: int) -> list[str]:
    """`names` starting from the `turn`-th (modulo their number)."""
    k = turn % len(names) if names else 0
    return names[k:] + names[:k]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of " + ", ".join(SYSTEMS))
    parser.add_argument("--qps", default="", help=f"request rates, comma-separated (default {FULL['qps']})")
    parser.add_argument("--requests", type=int, default=0, help=f"requests per rate (default {FULL['requests']})")
    parser.add_argument("--prompt-dist", default="", help=f"prompt tokens (default {FULL['prompt']})")
    parser.add_argument("--output-dist", default="", help=f"output tokens (default {FULL['output']})")
    parser.add_argument("--idle", type=float, default=0.0, help="seconds of idle CPU sampled before each turn")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-engines", type=int, default=4, help="vLLM engines alive at once (2 per pair)")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache of each engine (GiB)")
    parser.add_argument("--results", default="", help="folder for results (default ./results/serve-bench-<time>)")
    parser.add_argument(
        "--nixl-progress-delay-us",
        type=int,
        default=DEFAULT_PROGRESS_DELAY_US,
        help="µs vLLM's NIXL agents sleep between progress polls (default "
        f"{DEFAULT_PROGRESS_DELAY_US}, their best on a small host; -1: stock NIXL, a core per agent without pause)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs of every phase, the first system rotating")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK['qps']} req/s, {QUICK['requests']} requests, shorter prompts"
    )


def _workload(args: argparse.Namespace) -> tuple[list[float], int, LengthDist, LengthDist, float]:
    size = QUICK if args.quick else FULL
    rates = [float(q) for q in args.qps.split(",") if q.strip()] if args.qps else list(size["qps"])  # type: ignore[call-overload]
    count = args.requests or int(size["requests"])  # type: ignore[call-overload]
    prompt = LengthDist.parse(args.prompt_dist or str(size["prompt"]))
    output = LengthDist.parse(args.output_dist or str(size["output"]))
    return rates, count, prompt, output, args.idle or float(size["idle"])  # type: ignore[arg-type]


def _available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def _wait_for_memory(engines: int, say: Callable[[str], None], patience: float = 600.0) -> None:
    """:raises BenchError: the memory `engines` more engines need is not free within `patience` s."""
    need = engines * ENGINE_GIB + MARGIN_GIB
    deadline = time.monotonic() + patience
    while (free := _available_gib()) < need:
        if time.monotonic() > deadline:
            raise BenchError(f"{engines} engines need {need:g} GiB free with the margin; {free:.1f} GiB is")
        say(f"waiting for memory: {free:.1f} GiB free, {need:g} GiB wanted")
        time.sleep(10.0)


class Pairs:
    """The deployments alive now, by connector: started, warmed up, stopped and resumed."""

    def __init__(
        self, folder: Path, model: Path, max_model_len: int, kv_cache_gib: int, nixl_progress_delay_us: int | None
    ) -> None:
        self.folder, self.model, self.max_model_len, self.kv_cache_gib = folder, model, max_model_len, kv_cache_gib
        self.nixl_progress_delay_us = nixl_progress_delay_us  # for vLLM's connectors' pairs
        self.alive: dict[str, Deployment] = {}
        self.rss_gib: dict[str, float] = {}  # server name -> its group's RSS sum after warm-up

    def options(self, pair: str, mode: str) -> ServeOptions:
        connector, differ = PAIRS[pair]
        settings = {"lease": 3600.0, **differ} if connector == "kvflow" else {}  # a stopped pair keeps its peers
        delay = self.nixl_progress_delay_us if connector != "kvflow" else None
        return ServeOptions(connector=connector, mode=mode, model=self.model, port=0, run_dir=self.folder / pair,
                            max_model_len=self.max_model_len, kv_cache_gib=self.kv_cache_gib,
                            kvflow_settings=settings, startup_timeout=1200.0,
                            nixl_progress_delay_us=delay)  # fmt: skip

    def keep(self, connectors: list[str], systems: list[str], say: Callable[[str], None]) -> None:
        """Stop the deployments not in `connectors`, start the missing ones (at once), add a
        router per system's mode, warm each system up, and stop them all (SIGSTOP).

        :raises ServerFailed: a server did not start.  :raises BenchError: no memory, or a warm-up failed.
        """
        for connector in [c for c in self.alive if c not in connectors]:
            say(f"stopping the {connector} pair")
            self.alive.pop(connector).stop()
        new = [c for c in connectors if c not in self.alive]
        if not new:
            return
        _wait_for_memory(2 * len(new), say)
        modes = {c: [SYSTEMS[s][1] for s in systems if SYSTEMS[s][0] == c] for c in new}
        deployments = {c: Deployment(self.options(c, modes[c][0])) for c in new}
        say(f"starting the {', '.join(new)} pair(s): a few minutes")
        with concurrent.futures.ThreadPoolExecutor(len(new)) as pool:
            futures = [pool.submit(d.start) for d in deployments.values()]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                for d in deployments.values():
                    d.stop()
                raise
        self.alive.update(deployments)
        for connector, deployment in deployments.items():
            for mode in modes[connector]:
                url = deployment.add_router(mode)
                warm = [Arrival(f"warm-{mode}-{i}", 0.0, 64, 4) for i in range(WARMUP)]
                for arrival in warm:  # one at a time: the first pays for connections and handshakes
                    failed = [r.error for r in run_requests(url, "tiny", [arrival], "warmup", 300.0) if r.failed]
                    if failed:
                        raise BenchError(f"{connector} ({mode}): warm-up request failed: {failed[0]}")
            for server in deployment.servers:
                self.rss_gib[server.name + "@" + connector] = round(group_usage(server.group.pid or 0)[1] / 2**30, 2)
            self.pause(connector)

    def pause(self, connector: str) -> None:
        for server in self.alive[connector].servers:
            server.group.signal(signal.SIGSTOP)

    def resume(self, connector: str, mode: str, timeout: float = 120.0) -> str:
        """SIGCONT the pair, wait for its servers' health and for its `mode` router to see them
        healthy; the router's URL.  :raises ServerFailed: not healthy within `timeout` s."""
        deployment = self.alive[connector]
        for server in deployment.servers:
            server.group.signal(signal.SIGCONT)
        url = deployment.add_router(mode)
        deadline = time.monotonic() + timeout
        for server in deployment.servers:
            server.group.wait_until(_health(server.url), deadline, "health after SIGCONT")
        router = deployment.routers[mode][0]
        router.wait_until(lambda: _router_sees_all(url), deadline, "healthy backends after SIGCONT")
        return url

    def stop(self) -> None:
        for deployment in self.alive.values():
            deployment.stop()
        self.alive.clear()


def _health(url: str) -> Callable[[], bool]:
    return lambda: http_ok(f"{url}/health")


def _router_sees_all(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/backends", timeout=2.0) as answer:
            seen = json.loads(answer.read())
    except (OSError, ValueError):
        return False
    return all(b["healthy"] for role in ("prefill", "decode") for b in seen[role])


def _counters(servers: list[Server]) -> dict[str, float]:
    out: dict[str, float] = {}
    for server in servers:
        text = server.metrics()
        role = "p" if server.role == "prefill" else "d"
        if role == "d":
            name = "vllm:prompt_tokens_by_source_total"
            out["external_tokens"] = metric_sum(text, name, {"source": "external_kv_transfer"})
            out["local_tokens"] = metric_sum(text, name, {"source": "local_compute"})
        for metric in TRANSFER_METRICS:
            out[f"{role}_{metric}_bytes"] = metric_sum(text, f"vllm:{metric}_bytes_transferred_sum")
        if role == "p":  # P's own view of each request: arrival to its token, and its prefill alone
            for key, histogram in (("p_ttft", "time_to_first_token"), ("p_prefill", "request_prefill_time")):
                out[f"{key}_s_sum"] = metric_sum(text, f"vllm:{histogram}_seconds_sum")
                out[f"{key}_count"] = metric_sum(text, f"vllm:{histogram}_seconds_count")
    return out


def _cpu(servers: list[Server]) -> dict[str, float]:
    return {("p" if s.role == "prefill" else "d"): group_usage(s.group.pid or 0)[0] for s in servers}


def turn(pairs: Pairs, system: str, phase: int, qps: float, requests: list[Arrival], idle: float,
         progress: Callable[[int], None], run: int = 1) -> dict[str, Any]:  # fmt: skip
    """One system at one rate: resumed, `idle` seconds of idle CPU, the requests, stopped again.
    Prompts are salted with the run, so a second run misses the prefix caches the first one filled."""
    from kvflow_tools.serve.serve_report import summarise

    connector, mode = SYSTEMS[system]
    url = pairs.resume(connector, mode)
    servers = [s for s in pairs.alive[connector].servers if s.role in ("prefill", "decode")]
    try:
        cpu0 = _cpu(servers)
        time.sleep(idle)
        cpu1 = _cpu(servers)
        before = _counters(servers)
        start = time.perf_counter()
        results: list[Result] = run_requests(url, "tiny", requests, run_salt(system, phase, run), 300.0, progress)
        duration = time.perf_counter() - start
        cpu2 = _cpu(servers)
        time.sleep(1.0)  # the last steps' stats reach /metrics
        after = _counters(servers)
    finally:
        pairs.pause(connector)
    cpu = {r: {"idle_s": idle, "idle_cpu_s": cpu1[r] - cpu0[r], "load_s": duration, "load_cpu_s": cpu2[r] - cpu1[r]}
           for r in ("p", "d")}  # fmt: skip
    moved = deltas(before, after, after.keys())
    rows = [r.row() for r in results]
    return summarise(system, phase, qps, rows, duration, moved, cpu, kv_bytes_per_token())


def run_salt(system: str, phase: int, run: int) -> str:
    """What a run's prompts are drawn from: the same arrivals in another run get other tokens."""
    return f"{system}/{phase}/{run}"


def main(args: argparse.Namespace) -> int:
    """Every system at every rate, interleaved; results.json, plots and the table in the
    results folder (written again after each phase).  1 when a request failed, 2 when the run or
    one of its phases could not finish (said on stderr: a bad option, a server that died or did
    not start, a warm-up with no answer, no memory); every server is stopped."""
    try:
        return _main(args)
    except (ConfigError, ServerFailed, BenchError) as exc:
        sys.stderr.write(f"kvflow bench serve: {exc}\n")
        return 2


def _main(args: argparse.Namespace) -> int:
    from kvflow_tools.pd.cli import Progress
    from kvflow_tools.serve import serve_report

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems):
        raise ConfigError(f"--systems: choose from {list(SYSTEMS)}, not {systems}")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be 1 or more, not {args.repeats}")
    delay = None if args.nixl_progress_delay_us == -1 else args.nixl_progress_delay_us
    check_progress_delay(delay)
    rates, count, prompt, output, idle = _workload(args)
    connectors = list(dict.fromkeys(SYSTEMS[s][0] for s in systems))
    phases = plan_phases(connectors, max(1, args.max_engines // 2))
    # absolute: the servers run in folders of their own and load the model from here
    folder = Path(args.results or Path("results") / f"serve-bench-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    points = [(qps, arrivals(qps, count, prompt, output, args.seed)) for qps in rates]
    config = _describe(rates, count, prompt, output, args.seed, systems, phases, args.max_engines)
    config |= {"nixl_progress_delay_us": delay, "repeats": args.repeats}  # delay None: stock NIXL
    model = write_model(folder / "model", MODEL)
    pairs = Pairs(folder, model, prompt.high + output.high + 64, args.kv_cache_gib, delay)
    per_phase = [[s for s in systems if SYSTEMS[s][0] in p] for p in phases]
    total = sum(len(p) for p in per_phase) * len(rates) * count * args.repeats
    sys.stdout.write("\n".join(serve_report.header_lines({"config": config | {"load_after": "—"}})) + "\n")
    cells: list[dict[str, Any]] = []
    failed_phases: list[dict[str, Any]] = []

    def results(complete: bool) -> dict[str, Any]:
        done = serve_report.order(cells)
        return {"config": config | {"complete": complete, "failed_phases": failed_phases}, "cells": done}

    try:
        with Progress(total, "bench serve") as progress:
            for phase, (alive, measured) in enumerate(zip(phases, per_phase, strict=True), 1):
                try:
                    pairs.keep(alive, systems, progress.label)
                    for repeat in range(1, args.repeats + 1):
                        for index, (qps, requests) in enumerate(points):
                            for system in rotated(measured, index + repeat - 1):
                                progress.label(f"phase {phase}, run {repeat}: {system} at {qps:g} req/s")
                                cell = turn(pairs, system, phase, qps, requests, idle, progress.advance, repeat)
                                cells.append(cell | {"repeat": repeat})
                except (ServerFailed, BenchError) as error:
                    # the phase's figures so far stay; its pairs go (the next phase starts what it needs)
                    failed_phases.append({"phase": phase, "systems": measured, "error": str(error)})
                    sys.stderr.write(f"kvflow bench serve: phase {phase} ({', '.join(measured)}) failed: {error}\n")
                    pairs.stop()
                serve_report.write(results(complete=False), folder)  # what is done so far, before going on
    finally:
        pairs.stop()
    config |= {"load_after": _load(), "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "engine_rss_gib": pairs.rss_gib}
    final = results(complete=True)
    paths = serve_report.write(final, folder)
    sys.stdout.write(serve_report.render_table(final))
    sys.stdout.write(f"engine RSS (GiB, sum over each group): {pairs.rss_gib}\n")
    sys.stdout.write(f"results: {folder}/ ({', '.join(p.name for p in paths)})\n")
    if failed_phases:
        return 2
    return 1 if any(c["failed"] for c in cells) else 0


def _load() -> str:
    return ", ".join(f"{v:.2f}" for v in os.getloadavg())


def _describe(rates: list[float], count: int, prompt: LengthDist, output: LengthDist, seed: int,
              systems: list[str], phases: list[list[str]], max_engines: int) -> dict[str, Any]:  # fmt: skip
    per_token = kv_bytes_per_token()
    mean_prompt = float(prompt.describe()["mean"])  # type: ignore[arg-type]
    scheme = (
        "all pairs started first" if len(phases) == 1 else
        f"{len(phases)} phases of at most {max_engines} engines ({' | '.join('+'.join(p) for p in phases)})"
    )  # fmt: skip
    return {
        "model": {
            **asdict(MODEL),
            "head_dim": MODEL.head_dim,
            "dtype": "float32",
            "kv_bytes_per_token": per_token,
            "kv_mib_per_request": round(mean_prompt * per_token / 2**20, 1),
        },
        "workload": {
            "qps": rates,
            "requests_per_point": count,
            "prompt": prompt.describe(),
            "output": output.describe(),
            "seed": seed,
            "arrivals": "poisson (open loop)",
        },
        "systems": systems,
        "routes": {s: {"connector": PAIRS[SYSTEMS[s][0]][0], "router_mode": SYSTEMS[s][1]} for s in systems},
        "phases": phases,
        "order": f"{scheme}; at each rate the systems alive take turns (the first rotating from rate to rate), "
        "each pair SIGSTOPped outside its turns; streaming /v1/completions through kvflow's router",
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, vLLM CPU build, 1P1D, "
        "one CPU per engine",
        "load_before": _load(),
        "mem_available_gib": round(_available_gib(), 1),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
