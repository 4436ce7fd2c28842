"""The `kvflow` command.

`kvflow doctor`, `kvflow bench nixl`, `kvflow bench vllm`, `kvflow bench pd`, `kvflow bench
serve`, `kvflow bench host`, `kvflow bench engine`, `kvflow bench frames`, `kvflow bench
floods`, `kvflow bench router`, `kvflow bench hma`, `kvflow diagrams`, `kvflow soak`,
`kvflow serve`, `kvflow demo`.

Why one entry point: operators ask "does NIXL work here, with which backends and memory?" and
"how fast is it here?" before anything else; both answers are one command away.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from kvflow.integrations.vllm.settings import setting_arg

__all__ = ("main",)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvflow", description="kvflow KV-cache transfer engine")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("doctor", help="which NIXL backends and memory types work on this machine")
    diagrams = commands.add_parser("diagrams", help="draw the transfer state diagrams from the transition tables")
    diagrams.add_argument("--check", action="store_true", help="fail if docs/state-diagrams.md is out of date")
    bench = commands.add_parser("bench", help="benchmarks")
    targets = bench.add_subparsers(dest="target", required=True)
    nixl = targets.add_parser("nixl", help="NIXL WRITE bandwidth and latency: raw agent, kvflow, memcpy")
    nixl.add_argument("--quick", action="store_true", help="stop at 16 MiB")
    nixl.add_argument("--repeats", type=int, default=None, help="samples per cell (default: by size)")
    nixl.add_argument("--json", default=None, help="also write the rows to this JSON file")
    pd_report = targets.add_parser("pd-report", help="re-render `kvflow bench pd`'s tables and plots from its results")
    pd_report.add_argument("results", help="the folder holding results.json (plots are written there), or the file")
    pd_report.add_argument("--markdown", action="store_true", help="also print the Markdown table")
    vllm = targets.add_parser(
        "vllm",
        help="P->D latency inside vLLM's Scheduler: kvflow vs vLLM 0.34's push and pull NixlConnector and 0.33's "
        "NixlPushConnector",
    )
    vllm.add_argument("--connectors", type=_names, default=["kvflow", "vllm-push", "vllm-push-0.33", "vllm-pull"])
    vllm.add_argument("--tokens", type=_ints, default=[512, 4096], help="prompt lengths (comma-separated)")
    vllm.add_argument("--concurrency", type=_ints, default=[1, 4], help="requests in flight (comma-separated)")
    vllm.add_argument("--step-ms", type=_floats, default=[0.0, 5.0], help="step pacing, 0 = as fast as possible")
    vllm.add_argument("--long-tokens", type=int, default=2048, help="a long prompt P prefills in chunks (0: none)")
    vllm.add_argument("--long-chunks", type=int, default=4, help="the long prompt's chunks (P's budget: its share)")
    vllm.add_argument("--requests", type=int, default=20, help="measured requests per cell")
    vllm.add_argument("--repeats", type=int, default=2, help="runs of the whole matrix; medians are reported")
    vllm.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each cell")
    vllm.add_argument("--keep-vllm-affinity", action="store_true", help="keep the CPU pin vLLM's NIXL worker sets")
    vllm.add_argument(
        "--nixl-progress-delay-us", type=int, default=None, help="NIXL progress-thread delay (stock: busy poll)"
    )
    vllm.add_argument(
        "--kvflow-setting",
        dest="kvflow_settings",
        type=setting_arg,
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a kv_connector_extra_config entry for kvflow's connector, e.g. push_layer_groups=8",
    )
    vllm.add_argument("--json", default=None, help="also write every sample to this JSON file")
    vllm.add_argument(
        "--prefix-hit",
        type=int,
        default=0,
        metavar="TOKENS",
        help="instead: bytes kvflow moves per request when D's prefix cache holds a shared prefix of TOKENS",
    )
    host = targets.add_parser("host", help="what a KV connector costs the engine it runs in: steps/s, step time, CPU")
    host.add_argument("--systems", type=_names, default=["alone", "kvflow", "vllm-pull"])
    host.add_argument("--rates", type=_floats, default=[10.0, 100.0, 1000.0], help="transfers/s (comma-separated)")
    host.add_argument("--duration", type=float, default=2.0, help="seconds of arrivals per turn")
    host.add_argument("--turns", type=int, default=3, help="turns of each system per rate, interleaved")
    host.add_argument("--python-ms", type=float, default=3.0, help="the host's Python work per step")
    host.add_argument("--wait-ms", type=float, default=7.0, help="the rest of each step, interpreter released")
    host.add_argument(
        "--iterations", type=int, default=0, help="the Python work as a count (0: calibrated to --python-ms)"
    )
    host.add_argument("--tokens", type=int, default=64, help="prompt length (32-token blocks, 8 layers)")
    host.add_argument("--layer-groups", type=int, default=4, help="kvflow: WRITEs per request")
    host.add_argument("--idle", type=float, default=3.0, help="seconds each system sits idle for its idle CPU")
    host.add_argument("--warmup", type=float, default=1.0, help="seconds of steps before each window")
    host.add_argument(
        "--nixl-progress-delay-us", type=int, default=None, help="NIXL progress-thread delay (stock: busy poll)"
    )
    host.add_argument("--host-cpus", type=_ints, default=[], help="CPUs of the engines' processes (comma-separated)")
    host.add_argument(
        "--engine-cpus", type=_ints, default=[], help="CPUs of kvflow's engine processes and of this driver"
    )
    host.add_argument("--json", default=None, help="also write the results to this JSON file")
    pd = targets.add_parser("pd", help="open-loop P/D under load, GPU step times modelled: TTFT/TPOT per system")
    from kvflow_tools.pd.cli import add_arguments as pd_arguments

    pd_arguments(pd)
    from kvflow_tools.serve.bench_serve import add_arguments as serve_bench_arguments

    serve_bench_arguments(
        targets.add_parser("serve", help="real vLLM servers 1P1D under open-loop streaming load: kvflow vs vLLM's NIXL")
    )
    from kvflow_tools.bench.bench_engine import add_arguments as engine_arguments

    engine_arguments(targets.add_parser("engine", help="control-plane transfers/s, latency and memory per transfer"))
    from kvflow_tools.bench.bench_integrity import add_arguments as integrity_arguments

    integrity_arguments(
        targets.add_parser("integrity", help="what the end-to-end integrity check costs: digests, P->D latency")
    )
    from kvflow_tools.bench.bench_frames import add_arguments as frames_arguments

    frames_arguments(targets.add_parser("frames", help="what the costliest control frames cost to decode"))
    from kvflow_tools.bench.bench_floods import add_arguments as floods_arguments

    floods_arguments(
        targets.add_parser("floods", help="a stranger's connection flood: CPU per engine thread, a genuine connect")
    )
    from kvflow_tools.bench.bench_router import add_arguments as router_arguments

    router_arguments(targets.add_parser("router", help="what hostile HTTP clients can make the P/D router hold"))
    from kvflow_tools.bench.bench_hma import add_arguments as hma_arguments

    hma_arguments(
        targets.add_parser("hma", help="KV bytes P moves per request for hybrid models, vLLM's hybrid manager on/off")
    )
    _add_soak(commands)
    from kvflow_tools.serve.cli import add_arguments as serve_arguments

    serve_arguments(commands.add_parser("serve", help="real vLLM servers in P/D with kvflow, the router in front"))
    commands.add_parser(
        "demo", help="real vLLM 1P1D with kvflow: a batch through the router, checked against one engine"
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        from kvflow_tools.serve.demo import main as demo_main

        return demo_main()
    if args.command == "serve":
        from kvflow_tools.serve.cli import main as serve_main

        return serve_main(args)
    if args.command in ("bench", "soak"):
        # a benchmark stops the engine processes of systems not being measured (SIGSTOP): a
        # SIGTERM must unwind it like Ctrl-C, so that they are resumed and closed, not left stopped
        signal.signal(signal.SIGTERM, _interrupted)
    if args.command == "soak":
        return _soak(args)
    if args.command == "diagrams":
        from kvflow_tools.diagrams import main as diagrams_main

        return diagrams_main(["--check"] if args.check else [])
    if args.command == "bench" and args.target == "frames":
        from kvflow_tools.bench.bench_frames import main as bench_frames

        return bench_frames(args.repeats, args.json)
    if args.command == "bench" and args.target == "integrity":
        from kvflow_tools.bench.bench_integrity import main as bench_integrity

        return bench_integrity(args)
    if args.command == "bench" and args.target == "floods":
        from kvflow_tools.bench.bench_floods import main as bench_floods

        return bench_floods(args)
    if args.command == "bench" and args.target == "router":
        from kvflow_tools.bench.bench_router import config_from as router_config
        from kvflow_tools.bench.bench_router import main as bench_router

        return bench_router(router_config(args), args.json)
    if args.command == "bench" and args.target == "hma":
        from kvflow_tools.bench.bench_hma import main as bench_hma

        return bench_hma(_names(args.models), _ints(args.tokens), args.chunk, args.json, args.moved)
    if args.command == "bench" and args.target == "pd-report":
        from kvflow_tools.pd.report import rerender

        return rerender(args.results, markdown=args.markdown)
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    if args.command == "doctor":
        from kvflow_tools.doctor import diagnose, render

        sys.stdout.write(render(diagnose()) + "\n")
        return 0
    if args.target == "pd":
        from kvflow_tools.pd.cli import main as bench_pd

        return bench_pd(args)
    if args.target == "serve":
        from kvflow_tools.serve.bench_serve import main as bench_serve

        return bench_serve(args)
    if args.target == "host":
        from kvflow_tools.bench.bench_host import main as bench_host

        return bench_host(args)
    if args.target == "engine":
        from kvflow_tools.bench.bench_engine import config_from
        from kvflow_tools.bench.bench_engine import main as bench_engine

        return bench_engine(config_from(args), args.json)
    if args.target == "vllm":
        options = {k: v for k, v in vars(args).items() if k not in ("command", "target")}
        if args.prefix_hit:
            from kvflow_tools.bench.bench_prefix import main as bench_prefix

            return bench_prefix(options)
        from kvflow_tools.bench.bench_vllm import main as bench_vllm

        return bench_vllm(options)
    from kvflow_tools.bench.bench_nixl import main as bench_main

    bench_main(quick=args.quick, json_path=args.json, repeats=args.repeats)
    return 0


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _add_soak(commands: Any) -> None:
    soak = commands.add_parser(
        "soak", help="many transfers between two engine processes under random faults; exit 1 on a leak or stale read"
    )
    soak.add_argument("--transfers", type=int, default=10_000)
    soak.add_argument("--concurrency", type=int, default=8, help="transfers in flight")
    soak.add_argument(
        "--faults", type=_names, default=["kill", "stop", "drop", "flap"], help="comma-separated, or 'none'"
    )
    soak.add_argument("--fault-interval", type=float, default=2.0, help="mean seconds between faults")
    soak.add_argument("--lease", type=float, default=1.0)
    soak.add_argument("--ttl", type=float, default=5.0, help="each transfer's deadline")
    soak.add_argument("--fence", type=float, default=2.0)
    soak.add_argument("--drop-rate", type=float, default=0.002, help="fraction of D's notifications lost (shm)")
    soak.add_argument("--transport", choices=["nixl", "shm"], default="nixl")
    soak.add_argument(
        "--netns", action=argparse.BooleanOptionalAction, default=None, help="P and D in two network namespaces"
    )
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--json", default=None, help="also write the report to this JSON file")
    soak.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    soak.add_argument(
        "--fuzz",
        action="store_true",
        help="also run kvflow_tools.testing.fuzz's control-port attacks on P, then hostile kv_transfer_params "
        "through the connector on vLLM's scheduler (kvflow_tools.testing.params_soak) and through the "
        "router's process in each of its modes (kvflow_tools.testing.router_fuzz)",
    )
    soak.add_argument(
        "--fuzz-scale", type=int, default=1000, help="attacks, random kv_transfer_params per side, and per router mode"
    )


def _soak(args: argparse.Namespace) -> int:
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    from kvflow_tools.bench.soak import SoakConfig
    from kvflow_tools.bench.soak import main as soak_main

    faults = tuple(f for f in args.faults if f != "none")
    config = SoakConfig(
        transfers=args.transfers,
        concurrency=args.concurrency,
        faults=faults,
        fault_interval=args.fault_interval,
        lease=args.lease,
        ttl=args.ttl,
        fence=args.fence,
        drop_rate=args.drop_rate,
        transport=args.transport,
        netns=args.netns,
        seed=args.seed,
        fuzz=args.fuzz,
        fuzz_scale=args.fuzz_scale,
    )
    status = soak_main(config, json_path=args.json, quiet=args.quiet)
    if args.fuzz:  # and hostile kv_transfer_params through the connector, on vLLM's scheduler
        from kvflow_tools.testing.params_soak import run_params_soak

        params = run_params_soak(args.fuzz_scale, seed=args.seed, transfer_timeout=args.ttl)
        sys.stdout.write("kv_transfer_params fuzz: " + json.dumps(params.as_dict()) + "\n")
        if args.json:
            path = Path(args.json)
            path.with_name(path.stem + "-params" + path.suffix).write_text(json.dumps(params.as_dict(), indent=2))
        status = status or (0 if params.ok else 1)
        from kvflow_tools.testing.router_fuzz import run_router_fuzz

        routers = [report.as_dict() for report in run_router_fuzz(args.fuzz_scale, seed=args.seed)]
        for report in routers:
            sys.stdout.write("kv_transfer_params through the router: " + json.dumps(report) + "\n")
        if args.json:
            path = Path(args.json)
            path.with_name(path.stem + "-router" + path.suffix).write_text(json.dumps(routers, indent=2))
        status = status or (0 if all(report["ok"] for report in routers) else 1)
    return status


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _ints(text: str) -> list[int]:
    return [int(part) for part in _names(text)]


def _floats(text: str) -> list[float]:
    return [float(part) for part in _names(text)]


if __name__ == "__main__":
    sys.exit(main())
