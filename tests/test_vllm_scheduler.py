"""kvflow's connector inside vLLM's real Scheduler: a P engine and a D engine in this process.

The scheduler-role connector is created by vLLM itself from ``kv_connector_module_path``; the
worker-role connector registers CPU KV tensors; real bytes move over the loopback transport (or
NIXL-UCX) and a real ZeroMQ control plane on 127.0.0.1.  See `vllm_harness` for the stand-in
model runner.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvflow.errors import ConfigError
from kvflow.integrations.vllm import worker as worker_side
from kvflow.integrations.vllm.connector import KVFlowConnector
from kvflow.transports.loopback import FaultPlan, LoopbackFabric
from tests.vllm_harness import BLOCK_SIZE, VllmEngine, is_finished, make_engine

_fabrics = itertools.count()


def pair(
    transport: str = "loopback", failure_policy: str = "fail", async_scheduling: bool = False, **extra: Any
) -> tuple[VllmEngine, VllmEngine]:
    common = {"transport": transport, "port": 0, "fabric": f"f{next(_fabrics)}", **extra}
    p = make_engine("prefill", "kv_producer", common, async_scheduling=async_scheduling)
    d = make_engine("decode", "kv_consumer", common, failure_policy=failure_policy, async_scheduling=async_scheduling)
    return p, d


def params(p: VllmEngine, d: VllmEngine, transfer_id: str, mode: str = "push") -> dict[str, Any]:
    assert isinstance(p.worker, KVFlowConnector) and isinstance(d.worker, KVFlowConnector)
    return {
        "transfer_id": transfer_id,
        "epoch": 1,
        "mode": mode,
        "prefill": {"engine": "prefill", "address": p.worker.control_address},
        "decode": {"engine": "decode", "address": d.worker.control_address},
    }


def run(engines: tuple[VllmEngine, ...], until: Any, limit: float = 20.0) -> None:
    """Step every engine (as EngineCore would while it has work) until `until()` holds."""
    deadline = time.monotonic() + limit
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError("the engines did not get there in time\n" + "\n".join(e.describe() for e in engines))
        for engine in engines:
            if engine.busy():
                engine.step()
        time.sleep(0.001)


@pytest.fixture(params=["sync", "async"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[VllmEngine, VllmEngine]]:
    """P and D, stepping as vLLM does without and with async scheduling (vLLM 0.33's default)."""
    p, d = pair(async_scheduling=request.param == "async")
    yield p, d
    d.close()
    p.close()


def dispatch(p: VllmEngine, d: VllmEngine, tid: str, prompt_len: int, mode: str = "push") -> tuple[Any, Any]:
    """The router: both legs at once, the same transfer id, each told where the other is."""
    kv = params(p, d, tid, mode)
    d_req = d.add(f"d-{tid}", prompt_len, max_tokens=4, params={"do_remote_prefill": True, "kvflow": kv})
    p.transfers[f"p-{tid}"] = tid
    p_req = p.add(f"p-{tid}", prompt_len, max_tokens=1, params={"do_remote_decode": True, "kvflow": kv})
    return p_req, d_req


def run_and_check_landed(
    p: VllmEngine, d: VllmEngine, tid: str, prompt_len: int, mode: str = "push"
) -> tuple[Any, Any]:
    """Dispatch one request and run both engines until both end; D's blocks are checked when it starts decoding."""
    p_req, d_req = dispatch(p, d, tid, prompt_len, mode)
    blocks = -(-prompt_len // BLOCK_SIZE)
    checked: list[bool] = []

    def landed() -> bool:
        if d_req.status == RequestStatus.RUNNING and not checked:
            checked.append(d.blocks_hold(d_req.request_id, tid, blocks))
        return is_finished(d_req) and is_finished(p_req) and p.idle() and d.idle()

    run((p, d), landed)
    assert checked == [True], "D's blocks did not hold P's KV when decoding started"
    return p_req, d_req


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_kv_moves_from_prefill_to_decode_and_both_schedulers_end_empty(
    engines: tuple[VllmEngine, VllmEngine], mode: str
) -> None:
    p, d = engines
    prompt = 3 * BLOCK_SIZE + 5
    p_req, d_req = run_and_check_landed(p, d, "t1", prompt, mode)
    assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(d_req.output_token_ids) == 4
    for engine in (p, d):
        assert engine.most_in_flight == (2 if engine.async_scheduling else 0)
        assert not engine.connector.has_pending_push_work()
        assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63  # one null block


def test_connector_loaded_by_module_path(engines: tuple[VllmEngine, VllmEngine]) -> None:
    p, _ = engines
    assert type(p.connector).__name__ == "KVFlowConnector"
    assert type(p.connector).__module__ == "kvflow.integrations.vllm.connector"


def test_a_decode_engine_with_prefix_caching_refuses_to_start() -> None:
    """Received KV is written into the request's blocks; prefix caching would share them."""
    with pytest.raises(ConfigError, match="no-enable-prefix-caching"):
        make_engine("decode", "kv_consumer", {"transport": "loopback", "port": 0}, prefix_caching=True)


def test_a_prefill_engine_with_prefix_caching_computes_remote_prefill_requests_locally() -> None:
    """A producer may cache prefixes, but then it must not receive KV: such a request is refused
    (logged, computed locally), not written into blocks other requests share."""
    fabric = f"f{next(_fabrics)}"
    p = make_engine("prefill", "kv_producer", {"transport": "loopback", "port": 0, "fabric": fabric})
    d = make_engine(
        "decode", "kv_producer", {"transport": "loopback", "port": 0, "fabric": fabric}, prefix_caching=True
    )
    try:
        d_req = d.add(
            "d-t12", 2 * BLOCK_SIZE, max_tokens=4, params={"do_remote_prefill": True, "kvflow": params(p, d, "t12")}
        )
        d.step()
        assert "prefix caching" in d.connector._book.refused["d-t12"]
        assert d_req.status != RequestStatus.WAITING_FOR_REMOTE_KVS and d.connector._book.tracked() == 0
        settle((d,), [d_req])
        assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(d_req.output_token_ids) == 4
    finally:
        d.close()
        p.close()


def kvflow_engine(engine: VllmEngine) -> Any:
    """Rank 0's kvflow engine inside the worker connector."""
    assert isinstance(engine.worker, KVFlowConnector)
    side = engine.worker._worker
    assert side is not None and side.thread is not None
    return side.thread.engine


def crash(engine: VllmEngine) -> None:
    """The engine's process dies: no goodbye, its memory and control socket gone."""
    assert isinstance(engine.worker, KVFlowConnector)
    fabric = worker_side._LOOPBACK_FABRICS[engine.worker.settings.fabric]
    fabric.kill(kvflow_engine(engine).engine_id)
    side = engine.worker._worker
    assert side is not None and side.thread is not None
    side.thread.call(_silence).result(timeout=5)


async def _silence(engine: Any) -> None:
    engine.control.close()  # nothing more goes out or comes in
    engine._state = "closed"  # and the engine stops reacting, as a dead process would


def settle(engines: tuple[VllmEngine, ...], requests: list[Any], limit: float = 20.0) -> None:
    run(engines, lambda: all(is_finished(r) for r in requests) and all(e.idle() for e in engines), limit)
    for engine in engines:
        assert not engine.connector.has_pending_push_work(), engine.name
        assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63, engine.name


def test_decode_abort_while_waiting_frees_its_blocks_after_the_fence(engines: tuple[VllmEngine, VllmEngine]) -> None:
    p, d = engines
    kv = params(p, d, "t2")
    d_req = d.add("d-t2", 2 * BLOCK_SIZE, max_tokens=4, params={"do_remote_prefill": True, "kvflow": kv})
    run((d,), lambda: d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and d.steps >= 3)
    d.scheduler.finish_requests(d_req.request_id, RequestStatus.FINISHED_ABORTED)
    assert d.connector.has_pending_push_work()  # its blocks wait for kvflow's release
    settle((p, d), [d_req])
    # the prefill engine learns of it: a late prefill for that transfer is refused at once
    p.transfers["p-t2"] = "t2"
    p_req = p.add("p-t2", 2 * BLOCK_SIZE, max_tokens=1, params={"do_remote_decode": True, "kvflow": kv})
    settle((p, d), [p_req])


def test_decode_abort_during_the_handshake_still_reaches_prefill() -> None:
    """D's registration waits for its handshake with P; an abort ordered meanwhile must wait for
    it too, or it finds no transfer and the registration then holds the blocks until its deadline."""
    p, d = pair(transfer_timeout=600.0)
    try:
        engine = kvflow_engine(d)
        handshake = engine.connect

        async def slow_handshake(peer: str, address: str = "", timeout: float | None = None) -> None:
            await asyncio.sleep(0.5)
            await handshake(peer, address, timeout)

        engine.connect = slow_handshake
        kv = params(p, d, "t13")
        d_req = d.add("d-t13", 2 * BLOCK_SIZE, max_tokens=4, params={"do_remote_prefill": True, "kvflow": kv})
        run((d,), lambda: d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        assert engine.peers() == []  # the handshake is still on
        d.scheduler.finish_requests(d_req.request_id, RequestStatus.FINISHED_ABORTED)
        settle((p, d), [d_req], limit=30.0)  # long before the 600 s transfer deadline
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_abort_fails_the_decode_request_by_its_policy(policy: str) -> None:
    p, d = pair(failure_policy=policy)
    try:
        kv = params(p, d, "t3")
        d_req = d.add("d-t3", 2 * BLOCK_SIZE, max_tokens=4, params={"do_remote_prefill": True, "kvflow": kv})
        p_req = p.add("p-t3", 2 * BLOCK_SIZE, max_tokens=1, params={"do_remote_decode": True, "kvflow": kv})
        p.scheduler.finish_requests(p_req.request_id, RequestStatus.FINISHED_ABORTED)  # before its prefill
        settle((p, d), [p_req, d_req])
        if policy == "fail":
            assert d_req.status == RequestStatus.FINISHED_ERROR
        else:  # recomputed locally, then decoded
            assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(d_req.output_token_ids) == 4
    finally:
        d.close()
        p.close()


def test_prefill_death_fails_the_waiting_decode_request() -> None:
    p, d = pair(lease=1.0, fence_timeout=1.0)
    try:
        kv = params(p, d, "t4")
        d_req = d.add("d-t4", 2 * BLOCK_SIZE, max_tokens=4, params={"do_remote_prefill": True, "kvflow": kv})
        run((d,), lambda: d.steps >= 5)
        crash(p)
        settle((d,), [d_req], limit=30.0)  # a few 1 s leases, not a 480 s watchdog
        assert d_req.status == RequestStatus.FINISHED_ERROR
    finally:
        d.close()


def test_decode_death_lets_prefill_free_its_blocks() -> None:
    p, d = pair(lease=1.0, fence_timeout=1.0)
    try:
        kv = params(p, d, "t5")
        d.add("d-t5", 2 * BLOCK_SIZE, max_tokens=4, params={"do_remote_prefill": True, "kvflow": kv})
        run((d,), lambda: d.steps >= 3)  # D's registration is on its way
        crash(d)
        p.transfers["p-t5"] = "t5"
        p_req = p.add("p-t5", 2 * BLOCK_SIZE, max_tokens=1, params={"do_remote_decode": True, "kvflow": kv})
        settle((p,), [p_req])
    finally:
        p.close()


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_write_reaches_decode_at_once(policy: str, scheduling: str) -> None:
    """vLLM's own push connector only logs a failed WRITE and leaves D waiting for its 480 s
    watchdog; here D learns of it from P's failure notice and applies its load-failure policy."""
    fabric = f"f{next(_fabrics)}"
    worker_side._LOOPBACK_FABRICS[fabric] = LoopbackFabric(faults=FaultPlan(fail_ops={1}))
    p, d = pair(failure_policy=policy, fabric=fabric, transfer_timeout=600.0, async_scheduling=scheduling == "async")
    try:
        p_req, d_req = dispatch(p, d, "t7", 2 * BLOCK_SIZE)
        settle((p, d), [p_req, d_req], limit=30.0)  # long before the 600 s transfer deadline
        if policy == "fail":
            assert d_req.status == RequestStatus.FINISHED_ERROR
        else:  # the torn KV is recomputed locally, then decoded
            assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(d_req.output_token_ids) == 4
        assert p_req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    finally:
        d.close()
        p.close()


def test_push_without_layer_saves_posts_every_layer_group_after_the_forward() -> None:
    """A model runner that never calls save_kv_layer still pushes: wait_for_save posts all groups."""
    p, d = pair()
    p.layerwise = False
    try:
        run_and_check_landed(p, d, "t8", 2 * BLOCK_SIZE + 3)
    finally:
        d.close()
        p.close()


def decode_fails_long_before_its_deadline(p: VllmEngine, d: VllmEngine, tid: str) -> None:
    """One request whose transfer (with a 600 s deadline) must fail at once; then both close."""
    try:
        p_req, d_req = dispatch(p, d, tid, 2 * BLOCK_SIZE)
        settle((p, d), [p_req, d_req], limit=30.0)
        assert d_req.status == RequestStatus.FINISHED_ERROR
    finally:
        d.close()
        p.close()


def test_prefill_and_decode_disagreeing_on_layer_groups_fail_the_transfer_at_once() -> None:
    fabric = f"f{next(_fabrics)}"
    common = {"transport": "loopback", "port": 0, "fabric": fabric, "transfer_timeout": 600.0}
    p = make_engine("prefill", "kv_producer", {**common, "push_layer_groups": 1})
    d = make_engine("decode", "kv_consumer", {**common, "push_layer_groups": 2})
    decode_fails_long_before_its_deadline(p, d, "t9")


def test_push_over_nixl_moves_the_bytes() -> None:
    p, d = pair(transport="nixl")
    try:
        run_and_check_landed(p, d, "t6", 2 * BLOCK_SIZE + 1)
    finally:
        d.close()
        p.close()


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


def tensor_parallel_pair(ranks: int, **extra: Any) -> tuple[VllmEngine, VllmEngine]:
    """P and D with `ranks` workers each; rank r binds the base port + r, as in a deployment."""
    common = {"transport": "loopback", "fabric": f"f{next(_fabrics)}", **extra}
    p_port, d_port = consecutive_free_ports(ranks), consecutive_free_ports(ranks)
    p = make_engine("prefill", "kv_producer", {**common, "port": p_port}, tensor_parallel=ranks)
    d = make_engine("decode", "kv_consumer", {**common, "port": d_port}, tensor_parallel=ranks, failure_policy="fail")
    return p, d


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_tensor_parallel_ranks_each_move_their_shard_to_the_same_rank(mode: str) -> None:
    """The router names only rank 0; rank r of D finds rank r of P, and vLLM's aggregator hears
    of the request once every rank has reported it."""
    p, d = tensor_parallel_pair(2)
    try:
        run_and_check_landed(p, d, "t10", 3 * BLOCK_SIZE + 2, mode)  # checks both ranks' shards
        settle((p, d), [])
    finally:
        d.close()
        p.close()


def test_a_write_failing_on_one_rank_fails_the_request_on_every_rank() -> None:
    """One WRITE per rank: the first fails, the other lands half a second later.  vLLM fails
    the request on the failing rank's report, the other rank aborts its transfer, and the blocks
    come back once both ranks have reported."""
    fabric = f"f{next(_fabrics)}"
    faults = FaultPlan(fail_ops={1}, stall_ops={2}, stall_for=0.5)
    worker_side._LOOPBACK_FABRICS[fabric] = LoopbackFabric(faults=faults)
    p, d = tensor_parallel_pair(2, fabric=fabric, transfer_timeout=600.0, push_layer_groups=1)
    decode_fails_long_before_its_deadline(p, d, "t11")
