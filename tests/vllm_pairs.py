"""P and D stand-in vLLM engines in this process, and a router between them.

The engines are `kvflow_tools.standin.StandInEngine`: vLLM's Scheduler, KV cache
planning, allocation and connector hooks, the same stand-in `kvflow bench vllm` runs.  Real
bytes move over the loopback transport (or NIXL-UCX) and a real ZeroMQ control plane on
127.0.0.1.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from vllm.v1.request import Request, RequestStatus

from kvflow.integrations.vllm.connector import KVFlowConnector
from kvflow.integrations.vllm.links import ProcessLink
from kvflow.integrations.vllm.params import SEQUENTIAL_PREFILL_PARAMS
from kvflow.protocol.lifecycle import Life
from kvflow_tools.standin import EngineOptions, StandInEngine
from kvflow_tools.standin.fabrics import fabric_of, named_fabric

BLOCK_SIZE = 32
_fabrics = itertools.count()


def fabric() -> str:
    """A loopback fabric no other test uses."""
    return f"f{next(_fabrics)}"


def consecutive_free_ports(count: int) -> int:
    """A base port such that base .. base + count - 1 are free on 127.0.0.1 right now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + count > 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise AssertionError("no run of free ports")


def make_pair(
    transport: str = "loopback",
    *,
    extra: dict[str, Any] | None = None,
    p_extra: dict[str, Any] | None = None,
    d_extra: dict[str, Any] | None = None,
    p_options: dict[str, Any] | None = None,
    d_options: dict[str, Any] | None = None,
    failure_policy: str = "fail",
    **options: Any,
) -> tuple[StandInEngine, StandInEngine]:
    """P and D with the same options (`p_options`, `d_options`: one side's own); with tensor
    parallelism, rank r binds the base port + r, as in a deployment (the router names rank 0)."""
    p_ranks = {**options, **(p_options or {})}.get("tensor_parallel", 1)
    d_ranks = {**options, **(d_options or {})}.get("tensor_parallel", 1)
    # every layer group even for the small prompts of tests (the default merges small chunks' groups)
    common = {"transport": transport, "fabric": fabric(), "push_group_bytes": 0, **(extra or {})}
    p_port = consecutive_free_ports(p_ranks) if max(p_ranks, d_ranks) > 1 else 0
    d_port = consecutive_free_ports(d_ranks) if max(p_ranks, d_ranks) > 1 else 0
    p = StandInEngine(
        EngineOptions(
            "prefill", "kv_producer", {**common, "port": p_port, **(p_extra or {})}, **{**options, **(p_options or {})}
        )
    )
    try:
        d_all = {"failure_policy": failure_policy, **options, **(d_options or {})}
        d = StandInEngine(
            EngineOptions("decode", "kv_consumer", {**common, "port": d_port, **(d_extra or {})}, **d_all)
        )
    except BaseException:
        p.close()
        raise
    return p, d


def params(p: StandInEngine, d: StandInEngine, transfer_id: str, mode: str = "push") -> dict[str, Any]:
    assert isinstance(p.worker, KVFlowConnector) and isinstance(d.worker, KVFlowConnector)
    return {
        "transfer_id": transfer_id,
        "epoch": 1,
        "mode": mode,
        "prefill": {"engine": "prefill", "address": p.worker.control_address, "tp_size": p.options.tensor_parallel},
        "decode": {"engine": "decode", "address": d.worker.control_address, "tp_size": d.options.tensor_parallel},
    }


def is_finished(request: Request) -> bool:
    return bool(request.status >= RequestStatus.FINISHED_STOPPED)


def run(engines: tuple[StandInEngine, ...], until: Callable[[], bool], limit: float = 20.0) -> None:
    """Step every engine (as its engine core would while it has work) until `until()` holds."""
    deadline = time.monotonic() + limit
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError("the engines did not get there in time\n" + "\n".join(e.describe() for e in engines))
        for engine in engines:
            if engine.busy():
                engine.step()
        time.sleep(0.001)


def stepping(engines: tuple[StandInEngine, ...], condition: Callable[[], bool], limit: float = 10.0) -> None:
    """Step every engine, busy or idle (later requests would make them step), until
    `condition()` holds; fails past `limit` seconds."""

    def stepped() -> bool:
        for engine in engines:
            engine.step()
        return condition()

    run((), stepped, limit)


def dispatch(p: StandInEngine, d: StandInEngine, tid: str, prompt_len: int, mode: str = "push") -> tuple[Any, Any]:
    """The router: both legs at once, the same transfer id, each told where the other is."""
    kv = params(p, d, tid, mode)
    d_req = d.add(f"d-{tid}", prompt_len, 4, {"do_remote_prefill": True, "kvflow": kv}, tag=tid)
    p_req = p.add(f"p-{tid}", prompt_len, 1, {"do_remote_decode": True, "kvflow": kv}, tag=tid)
    return p_req, d_req


def settle(engines: tuple[StandInEngine, ...], requests: list[Any], limit: float = 20.0) -> None:
    """Run until these requests end and the engines idle; then nothing is pending and every
    block is free (one is vLLM's null block)."""
    run(engines, lambda: all(is_finished(r) for r in requests) and all(e.idle() for e in engines), limit)
    for engine in engines:
        assert not engine.connector.has_pending_push_work(), engine.options.name
        assert engine.free_blocks() == engine.options.num_blocks - 1, engine.options.name


def move_and_check(
    p: StandInEngine, d: StandInEngine, tid: str, prompt_len: int, mode: str = "push", limit: float = 20.0
) -> tuple[Any, Any]:
    """One request through P and D; D's pages, on every rank, are checked byte for byte when it
    starts decoding (by the stand-in), and both engines end empty."""
    p_req, d_req = dispatch(p, d, tid, prompt_len, mode)
    settle((p, d), [p_req, d_req], limit)
    assert d.checked == {d_req.request_id: 0}, f"D read pages that do not hold P's KV: {d.checked}"
    assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(d_req.output_token_ids) == 4
    return p_req, d_req


def kvflow_engine(engine: StandInEngine, rank: int = 0) -> Any:
    """The kvflow engine of one rank's worker connector."""
    return list(engine.kvflow_engines())[rank]


def crash(engine: StandInEngine) -> None:
    """The engine's process dies: no goodbye, its memory and control socket gone."""
    assert isinstance(engine.worker, KVFlowConnector)
    name = fabric_of(engine.options.extra)[1]
    assert name is not None, "crash() kills an engine on a loopback fabric"
    fabric_ = named_fabric(name)
    fabric_.kill(kvflow_engine(engine).engine_id)
    side = engine.worker._worker
    assert side is not None and side.thread is not None
    side.thread.call(_silence).result(timeout=5)


@contextlib.contextmanager
def stopped(engine: StandInEngine) -> Iterator[None]:
    """The engine's kvflow engine process stopped (SIGSTOP) for the block: silent, its sockets
    and memory left as they are; continued afterwards."""
    side = engine.worker._worker
    assert side is not None and isinstance(side.link, ProcessLink), "stopped() needs an engine process"
    pid = side.link.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def _silence(engine: Any) -> None:
    engine.control.close()  # nothing more goes out or comes in
    engine._life.state = Life.CLOSED  # and the engine stops reacting, as a dead process would


# vLLM's toy proxy sends P these params with max_tokens 1, then hands P's answer to D: no
# kvflow entry anywhere.
TOY_PROXY_P_PARAMS = SEQUENTIAL_PREFILL_PARAMS


def sequential_prefill(p: StandInEngine, rid: str, prompt_len: int, limit: float = 20.0) -> tuple[Any, Any]:
    """A sequential router's first leg: P runs the request (max_tokens 1) with the toy proxy's
    params; returns the request and the ``kv_transfer_params`` P's answer carries."""
    answers: dict[str, Any] = {}
    previous = p.emit

    def emit(**event: Any) -> None:
        if event.get("ev") == "params":
            answers[event["id"]] = event["params"]
        previous(**event)

    p.emit = emit
    try:
        p_req = p.add(f"p-{rid}", prompt_len, 1, dict(TOY_PROXY_P_PARAMS), tag=rid)
        run((p,), lambda: p_req.request_id in answers, limit)
    finally:
        p.emit = previous
    return p_req, answers[p_req.request_id]


def sequential_move(p: StandInEngine, d: StandInEngine, rid: str, prompt_len: int) -> tuple[Any, Any]:
    """P first, then D with exactly what P answered, as vLLM's toy proxy does; D's pages are
    checked byte for byte and both engines end empty."""
    p_req, answer = sequential_prefill(p, rid, prompt_len)
    d_req = d.add(f"d-{rid}", prompt_len, 4, answer, tag=rid)
    settle((p, d), [p_req, d_req])
    assert d.checked.get(d_req.request_id) == 0, f"D did not read P's KV: {d.checked} (P answered {answer})"
    assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(d_req.output_token_ids) == 4
    return p_req, d_req
