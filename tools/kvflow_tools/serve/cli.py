"""`kvflow serve`: the command line of the launcher (launcher.py).

Why its own module: the launcher is a library the tests and benchmarks drive; this module adds
only what a person at a terminal needs: options, the lines saying where to send requests, and
staying up until Ctrl-C (or until one of the servers dies, which stops the rest).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.settings import setting_arg
from kvflow_tools.errors import ServerFailed
from kvflow_tools.serve.launcher import CONNECTORS, ROUTER_MODES, Deployment, ServeOptions

__all__ = ("add_arguments", "main", "options_from")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServeOptions()
    parser.add_argument("--prefill", type=int, default=1, help="P servers (default 1)")
    parser.add_argument("--decode", type=int, default=1, help="D servers (default 1)")
    parser.add_argument("--connector", choices=CONNECTORS, default="kvflow", help="kvflow, or vLLM's NixlConnector")
    parser.add_argument(
        "--mode",
        choices=ROUTER_MODES,
        default=None,
        help="router dispatch (default push; sequential for nixl, nixl-push for nixl-push)",
    )
    parser.add_argument("--model", type=Path, default=None, help="a model directory (default: a tiny local one)")
    parser.add_argument("--served-model-name", default=defaults.served_model_name, help="the name clients send")
    parser.add_argument("--reference", action="store_true", help="also one plain engine, to compare tokens with")
    parser.add_argument("--host", default=defaults.host, help="address every process listens on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=defaults.port, help="the router's port (0: a free one)")
    parser.add_argument("--dtype", default=defaults.dtype, help="vLLM's --dtype (default float32)")
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument(
        "--prefill-batched-tokens", type=int, default=defaults.prefill_batched_tokens, help="P's token budget per step"
    )
    parser.add_argument("--kv-cache-gib", type=int, default=defaults.kv_cache_gib, help="KV cache of each engine")
    parser.add_argument("--vllm-python", type=Path, default=defaults.python, help="the interpreter with vLLM")
    parser.add_argument(
        "--run-dir", type=Path, default=None, help="logs and the model (default ./results/serve-<time>)"
    )
    parser.add_argument("--startup-timeout", type=float, default=defaults.startup_timeout, help="seconds to be healthy")
    parser.add_argument(
        "--kvflow-setting",
        dest="kvflow_settings",
        type=setting_arg,
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a kv_connector_extra_config entry for kvflow's connector, e.g. transfer_timeout=30",
    )
    parser.add_argument(
        "--first-token",
        choices=("decode", "prefill"),
        default=None,
        help="prefill: the router sends a streamed request's first token from P's answer the moment P has it, "
        "then D's stream, checked against it (D continues from P's token with kvflow's connector); decode: "
        "D's stream alone (default: prefill with kvflow's connector, decode with vLLM's, whose D draws the "
        "first token again)",
    )
    parser.add_argument("--vllm-arg", dest="vllm_args", action="append", default=[], help="passed to every server")
    parser.add_argument(
        "--nixl-progress-delay-us",
        type=int,
        default=None,
        help="with vLLM's connectors: µs their NIXL agents' progress threads sleep between polls (default: "
        "stock NIXL, a core per agent polling without pause, which starves a host with fewer cores than engines)",
    )


def options_from(args: argparse.Namespace) -> ServeOptions:
    """:raises ConfigError: see `ServeOptions.check`."""
    settings: dict[str, Any] = dict(args.kvflow_settings)
    mode = args.mode or {"nixl": "sequential", "nixl-push": "nixl-push"}.get(args.connector, "push")
    changes: dict[str, Any] = {"run_dir": args.run_dir} if args.run_dir is not None else {}
    options = ServeOptions(
        prefill=args.prefill,
        decode=args.decode,
        connector=args.connector,
        mode=mode,
        model=args.model,
        served_model_name=args.served_model_name,
        reference=args.reference,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        prefill_batched_tokens=args.prefill_batched_tokens,
        kv_cache_gib=args.kv_cache_gib,
        kvflow_settings=settings,
        vllm_args=tuple(args.vllm_args),
        python=args.vllm_python,
        startup_timeout=args.startup_timeout,
        nixl_progress_delay_us=args.nixl_progress_delay_us,
        first_token=(args.first_token or ("prefill" if args.connector == "kvflow" else "decode")) == "prefill",
        **changes,
    )
    options.check()
    return options


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(args: argparse.Namespace) -> int:
    """Start the deployment, say where it listens, stay up until a signal or a server's death;
    every process started is stopped before returning."""
    try:
        deployment = Deployment(options_from(args))
    except ConfigError as exc:
        _say(f"kvflow serve: {exc}", err=True)
        return 2
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    _say(f"kvflow serve: starting {_describe(deployment)}; logs in {deployment.run_dir}")
    status = 0
    try:
        deployment.start()
        _announce(deployment)
        while True:
            for group in [s.group for s in deployment.servers] + [r for r, _ in deployment.routers.values()]:
                code = group.exited()
                if code is not None:
                    raise ServerFailed(f"{group.name} exited with status {code}:\n{group.tail()}")
            time.sleep(1.0)
    except KeyboardInterrupt as stop:
        _say(f"kvflow serve: {stop or 'SIGINT'}, stopping")
    except ServerFailed as exc:
        _say(f"kvflow serve: {exc}", err=True)
        status = 1
    finally:
        left = deployment.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if left:
            _say(f"kvflow serve: processes left running in groups {left}", err=True)
            status = 1
        else:
            _say("kvflow serve: every process stopped")
    return status


def _say(line: str, err: bool = False) -> None:
    stream = sys.stderr if err else sys.stdout
    stream.write(line + "\n")
    stream.flush()


def _describe(deployment: Deployment) -> str:
    o = deployment.options
    return f"{o.prefill}P{o.decode}D with {o.connector} ({o.mode})" + (" and a reference engine" if o.reference else "")


def _announce(deployment: Deployment) -> None:
    for server in deployment.servers:
        kvflow = f", kvflow {server.kvflow}" if server.kvflow else ""
        _say(f"  {server.name:<10} {server.url}{kvflow} (CPU {server.cpu}, pid {server.group.pid})")
    name = deployment.options.served_model_name
    _say(f"send requests to {deployment.router_url}/v1/completions, e.g.")
    body = json.dumps({"model": name, "prompt": "<1> <2> <3> <4>", "max_tokens": 8, "temperature": 0})
    _say(f"  curl -s {deployment.router_url}/v1/completions -H 'Content-Type: application/json' -d '{body}'")
    _say("Ctrl-C stops every process")
