"""P and D for `kvflow bench vllm`: two `runner` processes on one connector, and the router between them.

Why a module of its own: starting P and D (a `runner` process each, vLLM's real Scheduler and
worker hooks, over NIXL with UCX and DRAM KV caches), routing each request between them and
following it (`Flight`) until both are done with it is what every benchmark of vLLM's connectors
shares: `kvflow bench vllm`, `kvflow bench host` and `kvflow bench pd` drive it through
`start_pair`, `Pair` and `Flight`, each with its own load and its own figures.

Routing: for the push connectors the pair dispatches P and D at once, as their proxies do; for
vLLM's pull connector it hands P's returned ``kv_transfer_params`` to D, as vLLM's pull proxy
does.  `Pair.run_cell` runs one cell of `kvflow bench vllm` and records its flights in the `Cell`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.params import SEQUENTIAL_PREFILL_PARAMS
from kvflow_tools.bench.bench_report import Cell
from kvflow_tools.bench.runner import EngineSpec, spec_line
from kvflow_tools.bench.systems import CONNECTORS, python_for
from kvflow_tools.errors import BenchError
from kvflow_tools.standin.model import EngineOptions, ModelShape
from kvflow_tools.standin.platform import platform_env

__all__ = ("BENCH_MODEL", "DECODE_TOKENS", "EngineProcess", "Flight", "Pair", "start_pair")

DECODE_TOKENS = 4
# 8 layers of 4 KV heads x 64, fp16, 32-token blocks: 32 KiB per layer and block, 8 KiB per token
BENCH_MODEL = ModelShape(family="opt", layers=8, kv_heads=4, head_dim=64, dtype="float16")
START_TIMEOUT = 120.0  # per attempt; a pair that does not start in time is started again once
START_ATTEMPTS = 2
log = logging.getLogger(__name__)
FLIGHT_TIMEOUT = 120.0


@dataclass
class Flight:
    """One request's journey through P and D."""

    request_id: str
    dispatched: float
    finished: float | None = None  # P: request_finished
    computed: float | None = None  # P: the forward that completed the prompt ended
    computed_step: float | None = None  # P: that step started
    recving: float | None = None  # D: finished_recving
    recv_failed: bool = False
    d_steps: int = 0
    sent: float | None = None  # P: finished_sending
    p_steps: int = 0  # P's steps from request_finished to finished_sending
    pages: int = 0
    bad_pages: int = 0
    page_bytes: int = 0
    p_gone: bool = False
    d_gone: bool = False
    d_dispatched: bool = False
    decode_tokens: int = DECODE_TOKENS  # D's max_tokens

    @property
    def done(self) -> bool:
        return self.p_gone and self.d_gone


class EngineProcess:
    """A runner process: commands in on stdin, events out on stdout, logs in a file."""

    def __init__(
        self,
        spec: EngineSpec,
        env: dict[str, str],
        events: queue.Queue[tuple[str, dict[str, Any]]],
        python: str = sys.executable,
    ):
        self.name = spec.options.name
        self.log_path = Path(tempfile.mkstemp(prefix=f"kvflow-bench-{spec.options.name}-", suffix=".log")[1])
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [python, "-m", "kvflow_tools.bench.runner"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
                start_new_session=True,  # its own process group: `pause` stops its children too
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin = self.proc.stdin
        self._send_line(spec_line(spec))
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout, events), daemon=True)
        self._reader.start()

    def _read(self, stdout: Any, events: queue.Queue[tuple[str, dict[str, Any]]]) -> None:
        with stdout:
            for line in stdout:
                events.put((self.name, json.loads(line)))
        events.put((self.name, {"ev": "exit"}))

    def _send_line(self, line: str) -> None:
        self._stdin.write(line + "\n")
        self._stdin.flush()

    def send(self, **command: Any) -> None:
        self._send_line(json.dumps(command))

    def pause(self) -> None:
        """Stop the process and its children (SIGSTOP to its group): it takes no CPU until
        `resume`, so that it does not disturb another system measured meanwhile."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self, keep_log: bool = False) -> None:
        self.resume()  # a paused process cannot obey `stop`
        with contextlib.suppress(OSError, ValueError):
            self.send(op="stop")
            self._stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._reader.join(timeout=10)
        if not keep_log:
            self.log_path.unlink(missing_ok=True)


def _free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports: every socket is held until all are chosen, so the
    kernel cannot hand the same port out twice."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


class Pair:
    """P and D engine processes running one connector, and the router between them."""

    def __init__(self, connector: str, tokens: int, concurrency: int, options: dict[str, Any], budget: int = 0) -> None:
        """`budget`: P's token budget per step (``max_num_batched_tokens``); 0: a whole prompt."""
        if connector not in CONNECTORS:
            raise ConfigError(f"unknown connector {connector!r}; choose from {sorted(CONNECTORS)}")
        self.connector = connector
        system = CONNECTORS[connector]
        python = python_for(system)
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        secret = secrets.token_hex(32)
        max_model_len = max(8192, tokens + 64)
        # enough for the requests in flight, and (vLLM checks it) for one request of max_model_len
        blocks = max(concurrency * (-(-tokens // 32) + 2) + 64, -(-max_model_len // 32) + 1)
        p_side, d_side = _free_ports(2)
        self.side_ports = {"P": p_side, "D": d_side}
        extra: dict[str, Any] = dict(system.extra)
        if connector.startswith("kvflow"):
            extra = {"transport": "nixl", "port": 0, "host": "127.0.0.1", **options.get("kvflow_settings", {})}
            if connector == "kvflow-thread":
                extra["engine_process"] = "thread"
            if connector == "kvflow-integrity":
                extra["integrity"] = True
        self.engines: dict[str, EngineProcess] = {}
        self.hooks: dict[str, list[float]] = {"P": [], "D": []}  # µs per step inside connector hooks
        self.hooks_cpu: dict[str, list[float]] = {"P": [], "D": []}  # ... of it, the stepping thread's CPU
        self.prefill: list[tuple[float, float, float]] = []  # P's prefill steps: hooks, their CPU, the step (s)
        self.hook_names: dict[str, dict[str, list[float]]] = {"P": {}, "D": {}}  # the same, per hook
        self.failed = False
        try:
            for name, role in (("P", "kv_producer"), ("D", "kv_consumer")):
                engine_options = EngineOptions(
                    name=name,
                    role=role,
                    connector=system.vllm_class,
                    module_path=system.module_path,
                    engine_id="prefill" if name == "P" else "decode",
                    # sequential: P names its control address in its answer, so it needs a fixed port
                    extra={**extra, "port": self.side_ports["P"]}
                    if connector == "kvflow-sequential" and name == "P"
                    else extra,
                    model=BENCH_MODEL,
                    num_blocks=blocks,
                    max_model_len=max_model_len,
                    max_num_batched_tokens=budget if budget and name == "P" else max_model_len,
                    # its one-rank gloo group binds a port of the kernel's choosing (0): one picked
                    # here could be taken before the engine binds it
                    distributed=True,
                    dist_port=0,
                    keep_vllm_affinity=options.get("keep_vllm_affinity", False),
                    kv_buffer_device="cpu",
                )
                # a caller's fields for this engine (`kvflow bench pd`: model, blocks, block size)
                engine_options = replace(engine_options, **options.get("engines", {}).get(name, {}))
                spec = EngineSpec(engine_options, options.get("nixl_progress_delay_us"), options.get("cpus", ()))
                env = platform_env(os.environ)  # vLLM's CPU platform: its NIXL connectors read the device type
                env.update(
                    KVFLOW_SECRET=secret,
                    HF_HUB_OFFLINE="1",
                    VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                    VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_ports[name]),
                    VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"),
                    NIXL_LOG_LEVEL=env.get("NIXL_LOG_LEVEL", "WARN"),
                    UCX_NET_DEVICES=env.get("UCX_NET_DEVICES", "lo"),
                )
                self.engines[name] = EngineProcess(spec, env, self.events, python)
            self.ready: dict[str, dict[str, Any]] = {}
            deadline = time.monotonic() + START_TIMEOUT
            while len(self.ready) < 2:
                name, event = self.next_event(deadline, "engines to start")
                if event["ev"] == "ready":
                    self.ready[name] = event
            self.vllm = self.ready["P"].get("vllm", "")
            if system.release is not None and not self.vllm.startswith(system.release + "."):
                raise BenchError(f"{connector} needs vLLM {system.release}, and its engines run vLLM {self.vllm}")
        except BaseException:
            self.close()
            raise

    def next_event(self, deadline: float, waiting_for: str) -> tuple[str, dict[str, Any]]:
        try:
            name, event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            self.failed = True
            logs = "\n".join(self.describe())
            logs += "\n" + "\n".join(f"--- {e.name} ({e.log_path}):\n{e.log_tail()}" for e in self.engines.values())
            raise BenchError(f"{self.connector}: timed out waiting for {waiting_for}\n{logs}") from None
        if event["ev"] == "exit":
            self.failed = True
            engine = self.engines[name]
            raise BenchError(
                f"{self.connector}: engine {name} exited while waiting for {waiting_for} "
                f"(log: {engine.log_path}):\n{engine.log_tail()}"
            )
        return name, event

    def describe(self) -> list[str]:
        """What each engine still waits on, asked of the engines themselves (a second at most)."""
        for engine in self.engines.values():
            with contextlib.suppress(OSError, ValueError):
                engine.send(op="describe")
        said: list[str] = []
        deadline = time.monotonic() + 1.0
        while len(said) < len(self.engines):
            try:
                _, event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if event["ev"] == "describe":
                said.append(event["text"])
        return said

    def pause(self) -> None:
        """Stop both engines (and their children) until `resume`: an idle pair takes no CPU."""
        for engine in self.engines.values():
            engine.pause()

    def resume(self) -> None:
        for engine in self.engines.values():
            engine.resume()

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close(keep_log=self.failed)

    # ---------------------------------------------------------------- routing

    def dispatch(self, flight: Flight, tokens: int) -> None:
        rid, p, d = flight.request_id, self.engines["P"], self.engines["D"]
        tag = rid
        if self.connector == "alone":  # no KV moves: each engine computes the prompt
            p.send(op="add", id=rid, prompt_len=tokens, max_tokens=1, tag=tag, params={})
            d.send(op="add", id=rid, prompt_len=tokens, max_tokens=flight.decode_tokens, tag=tag, params={})
            flight.d_dispatched = True
            return
        if self.connector in ("kvflow", "kvflow-thread", "kvflow-integrity", "kvflow-pull"):
            kv = {
                "transfer_id": rid,
                "epoch": 1,
                "mode": "pull" if self.connector == "kvflow-pull" else "push",
                "prefill": {"engine": "prefill", "address": self.ready["P"]["control_address"]},
                "decode": {"engine": "decode", "address": self.ready["D"]["control_address"]},
            }
            p.send(
                op="add",
                id=rid,
                prompt_len=tokens,
                max_tokens=1,
                tag=tag,
                params={"do_remote_decode": True, "kvflow": kv},
            )
            d_kv = {"do_remote_prefill": True, "kvflow": kv}
            d.send(op="add", id=rid, prompt_len=tokens, max_tokens=flight.decode_tokens, tag=tag, params=d_kv)
            flight.d_dispatched = True
            return
        p_params: dict[str, Any] = dict(SEQUENTIAL_PREFILL_PARAMS)
        if CONNECTORS[self.connector].push_proxy:  # as vLLM's push proxy: D learns P's coordinates up front
            p_params["transfer_id"] = rid
            d_params = {
                "do_remote_decode": False,
                "do_remote_prefill": True,
                "remote_engine_id": "prefill",
                "remote_host": "127.0.0.1",
                "remote_port": self.side_ports["P"],
                "tp_size": 1,
                "pp_size": 1,
                "remote_request_id": rid,
                "transfer_id": rid,
            }
            p.send(op="add", id=rid, prompt_len=tokens, max_tokens=1, tag=tag, params=p_params)
            d.send(op="add", id=rid, prompt_len=tokens, max_tokens=flight.decode_tokens, tag=tag, params=d_params)
            flight.d_dispatched = True
        else:  # pull: D gets the request once P answers with its kv_transfer_params
            p.send(op="add", id=rid, prompt_len=tokens, max_tokens=1, tag=tag, params=p_params)

    def on_event(self, name: str, event: dict[str, Any], flight: Flight, tokens: int) -> None:
        kind = event["ev"]
        if name == "P":
            if kind == "request_finished" and flight.finished is None:
                flight.finished = event["t"]
            elif kind == "computed":
                flight.computed, flight.computed_step = event["t"], event.get("started")
            elif kind == "sending":
                flight.sent = event["t"]
                if flight.finished is not None:
                    flight.p_steps = sum(1 for s in event.get("step_starts", ()) if s >= flight.finished)
            elif kind == "gone":
                flight.p_gone = True
            elif kind == "params" and not flight.d_dispatched and event.get("params"):
                flight.d_dispatched = True
                self.engines["D"].send(
                    op="add", id=flight.request_id, prompt_len=tokens, max_tokens=flight.decode_tokens,
                    tag=flight.request_id, params=event["params"],
                )  # fmt: skip
            elif kind == "params" and not flight.d_dispatched:  # P ended without handing over KV
                flight.d_dispatched = flight.d_gone = True
        elif kind == "recving":
            flight.recving = event["t"]
            flight.recv_failed = bool(event["failed"])
            if flight.finished is not None:
                flight.d_steps = sum(1 for s in event["step_starts"] if s >= flight.finished)
        elif kind == "checked":
            flight.pages, flight.bad_pages, flight.page_bytes = event["pages"], event["bad"], event["page_bytes"]
        elif kind == "gone":
            flight.d_gone = True

    def run_cell(self, cell: Cell, warmup: int) -> None:
        """`warmup` requests one by one, then `cell.requests` with `cell.concurrency` in flight."""
        for engine in self.engines.values():
            engine.send(op="pace", step_ms=cell.step_ms)
        self._run_flights(warmup, 1, cell.tokens)
        self.hooks, self.hook_names = {"P": [], "D": []}, {"P": {}, "D": {}}
        self.hooks_cpu = {"P": [], "D": []}
        self.prefill = []
        for flight in self._run_flights(cell.requests, cell.concurrency, cell.tokens):
            _record(cell, flight)
        cell.p_hooks_us, cell.d_hooks_us = self.hooks["P"], self.hooks["D"]
        cell.p_hooks_cpu_us, cell.d_hooks_cpu_us = self.hooks_cpu["P"], self.hooks_cpu["D"]
        cell.p_hook_us, cell.d_hook_us = self.hook_names["P"], self.hook_names["D"]
        cell.p_prefill_hooks_us = [spent * 1e6 for spent, _, _ in self.prefill]
        cell.p_prefill_hooks_cpu_us = [cpu * 1e6 for _, cpu, _ in self.prefill]
        cell.p_prefill_step_ms = [step * 1e3 for _, _, step in self.prefill]

    def _run_flights(self, count: int, concurrency: int, tokens: int) -> list[Flight]:
        flights: dict[str, Flight] = {}
        finished: list[Flight] = []
        started = 0
        while len(finished) < count:
            while started < count and len(flights) < concurrency:
                flight = Flight(f"r{uuid.uuid4().hex[:12]}", time.perf_counter())
                flights[flight.request_id] = flight
                self.dispatch(flight, tokens)
                started += 1
            oldest = min(f.dispatched for f in flights.values())
            deadline = time.monotonic() + max(0.0, oldest + FLIGHT_TIMEOUT - time.perf_counter())
            name, event = self.next_event(deadline, f"{len(flights)} requests in flight to complete")
            if event["ev"] == "hooks":
                self.hooks[name].append(event["s"] * 1e6)
                self.hooks_cpu[name].append(event.get("cpu", 0.0) * 1e6)
                for hook, seconds in event.get("by", {}).items():
                    self.hook_names[name].setdefault(hook, []).append(seconds * 1e6)
                if name == "P" and event.get("tokens"):
                    self.prefill.append((event["s"], event.get("cpu", 0.0), event.get("dur", 0.0)))
            flight_for = flights.get(event.get("id", ""))
            if flight_for is None:
                continue
            self.on_event(name, event, flight_for, tokens)
            if flight_for.done:
                finished.append(flights.pop(flight_for.request_id))
        return finished


def _record(cell: Cell, flight: Flight) -> None:
    landed = flight.recving is not None and not flight.recv_failed
    if not landed or flight.bad_pages or not flight.pages:
        cell.failed += 1
    if flight.recving is not None and flight.finished is not None:
        cell.fin_to_recv_ms.append((flight.recving - flight.finished) * 1e3)
        cell.d_steps.append(flight.d_steps)
    if flight.recving is not None and flight.computed is not None:
        cell.kv_to_recv_ms.append((flight.recving - flight.computed) * 1e3)
    if flight.recving is not None and flight.computed_step is not None:
        cell.start_to_recv_ms.append((flight.recving - flight.computed_step) * 1e3)
    if flight.sent is not None and flight.finished is not None:
        cell.fin_to_sent_ms.append((flight.sent - flight.finished) * 1e3)
        cell.p_free_steps.append(flight.p_steps)
    cell.bad_pages += flight.bad_pages
    if landed and not flight.bad_pages:
        cell.bytes_verified += flight.pages * flight.page_bytes


def start_pair(connector: str, tokens: int, concurrency: int, options: dict[str, Any], budget: int = 0) -> Pair:
    """A started `Pair`; one that does not come up in `START_TIMEOUT` (its logs are printed) is
    started again with fresh ports, once.

    :raises ConfigError: an unknown connector.
    :raises BenchError: the engines did not start.
    """
    attempt = 1
    while True:
        try:
            return Pair(connector, tokens, concurrency, options, budget)
        except BenchError as error:
            if attempt >= START_ATTEMPTS or "timed out" not in str(error):
                raise
            log.warning("%s\nstarting %s again", error, connector)
            attempt += 1
