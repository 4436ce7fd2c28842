"""kvflow's connector inside vLLM's real Scheduler: a P engine and a D engine in this process.

The engines are the stand-in (`kvflow_tools.standin`): vLLM's scheduler, KV cache
planning and allocation, and connector hooks in vLLM's order; the scheduler-role connector is
created by vLLM itself from ``kv_connector_module_path``.  Real bytes move over the loopback
transport (or NIXL-UCX) and a real ZeroMQ control plane on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from vllm.v1.request import RequestStatus

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.request_book import Stage
from kvflow.transports.loopback import FaultPlan, LoopbackFabric
from kvflow_tools.standin import StandInEngine
from kvflow_tools.standin.fabrics import install_fabric
from tests.vllm_pairs import (
    BLOCK_SIZE,
    crash,
    dispatch,
    fabric,
    kvflow_engine,
    make_pair,
    move_and_check,
    params,
    run,
    settle,
)


@pytest.fixture(params=["sync", "async"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[StandInEngine, StandInEngine]]:
    """P and D, stepping as vLLM does without and with async scheduling (vLLM 0.33's default)."""
    p, d = make_pair(async_scheduling=request.param == "async")
    yield p, d
    d.close()
    p.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_kv_moves_from_prefill_to_decode_and_both_schedulers_end_empty(
    engines: tuple[StandInEngine, StandInEngine], mode: str
) -> None:
    p, d = engines
    move_and_check(p, d, "t1", 3 * BLOCK_SIZE + 5, mode)
    for engine in (p, d):
        assert engine.most_in_flight == (2 if engine.options.async_scheduling else 0)


def test_connector_loaded_by_module_path(engines: tuple[StandInEngine, StandInEngine]) -> None:
    p, _ = engines
    assert type(p.connector).__name__ == "KVFlowConnector"
    assert type(p.connector).__module__ == "kvflow.integrations.vllm.connector"


def test_decode_abort_while_waiting_frees_its_blocks_after_the_fence(
    engines: tuple[StandInEngine, StandInEngine],
) -> None:
    p, d = engines
    kv = params(p, d, "t2")
    d_req = d.add("d-t2", 2 * BLOCK_SIZE, 4, {"do_remote_prefill": True, "kvflow": kv})
    run((d,), lambda: d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and d.steps >= 3)
    d.scheduler.finish_requests(d_req.request_id, RequestStatus.FINISHED_ABORTED)
    assert d.connector.has_pending_push_work()  # its blocks wait for kvflow's release
    settle((p, d), [d_req])
    # the prefill engine learns of it: a late prefill for that transfer is refused at once
    p_req = p.add("p-t2", 2 * BLOCK_SIZE, 1, {"do_remote_decode": True, "kvflow": kv}, tag="t2")
    settle((p, d), [p_req])


def test_decode_abort_during_the_handshake_still_reaches_prefill() -> None:
    """D's registration waits for its handshake with P; an abort ordered meanwhile must wait for
    it too, or it finds no transfer and the registration then holds the blocks until its deadline."""
    p, d = make_pair(extra={"transfer_timeout": 600.0})
    aborted = threading.Event()
    try:
        engine = kvflow_engine(d)
        handshake = engine.connect

        async def slow_handshake(peer: str, address: str = "", timeout: float | None = None) -> None:
            await asyncio.get_running_loop().run_in_executor(None, aborted.wait, 30.0)  # until the abort
            await handshake(peer, address, timeout)

        engine.connect = slow_handshake
        kv = params(p, d, "t13")
        d_req = d.add("d-t13", 2 * BLOCK_SIZE, 4, {"do_remote_prefill": True, "kvflow": kv})
        run((d,), lambda: d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        assert engine.peers() == []  # the handshake is still on
        d.scheduler.finish_requests(d_req.request_id, RequestStatus.FINISHED_ABORTED)
        worker = d.ranks[0].worker._worker
        run((d,), lambda: worker.book.stage("d-t13") is Stage.ABORTING)  # the worker ordered the abort
        assert engine.peers() == []  # the handshake is still held back
        aborted.set()
        settle((p, d), [d_req], limit=30.0)  # long before the 600 s transfer deadline
    finally:
        aborted.set()
        d.close()
        p.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_abort_fails_the_decode_request_by_its_policy(policy: str) -> None:
    p, d = make_pair(failure_policy=policy)
    try:
        kv = params(p, d, "t3")
        d_req = d.add("d-t3", 2 * BLOCK_SIZE, 4, {"do_remote_prefill": True, "kvflow": kv})
        p_req = p.add("p-t3", 2 * BLOCK_SIZE, 1, {"do_remote_decode": True, "kvflow": kv})
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
    p, d = make_pair(extra={"lease": 1.0, "fence_timeout": 1.0})
    try:
        kv = params(p, d, "t4")
        d_req = d.add("d-t4", 2 * BLOCK_SIZE, 4, {"do_remote_prefill": True, "kvflow": kv})
        run((d,), lambda: d.steps >= 5)
        crash(p)
        settle((d,), [d_req], limit=30.0)  # a few 1 s leases, not a 480 s watchdog
        assert d_req.status == RequestStatus.FINISHED_ERROR
    finally:
        d.close()


def test_decode_death_lets_prefill_free_its_blocks() -> None:
    p, d = make_pair(extra={"lease": 1.0, "fence_timeout": 1.0})
    try:
        kv = params(p, d, "t5")
        d.add("d-t5", 2 * BLOCK_SIZE, 4, {"do_remote_prefill": True, "kvflow": kv})
        run((d,), lambda: bool(kvflow_engine(d).core.live()))  # D's registration is on its way
        crash(d)
        p_req = p.add("p-t5", 2 * BLOCK_SIZE, 1, {"do_remote_decode": True, "kvflow": kv}, tag="t5")
        settle((p,), [p_req])
    finally:
        p.close()


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_write_reaches_decode_at_once(policy: str, scheduling: str) -> None:
    """vLLM's own push connector only logs a failed WRITE and leaves D waiting for its 480 s
    watchdog; here D learns of it from P's failure notice and applies its load-failure policy."""
    name = fabric()
    install_fabric(name, LoopbackFabric(faults=FaultPlan(fail_ops={1})))
    extra = {"fabric": name, "transfer_timeout": 600.0}
    p, d = make_pair(extra=extra, failure_policy=policy, async_scheduling=scheduling == "async")
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
    """A model runner that never calls save_kv_layer (a full CUDA graph replays the forward)
    still pushes: wait_for_save posts all groups."""
    p, d = make_pair(full_cudagraph=True)
    try:
        move_and_check(p, d, "t8", 2 * BLOCK_SIZE + 3)
    finally:
        d.close()
        p.close()


def decode_fails_long_before_its_deadline(p: StandInEngine, d: StandInEngine, tid: str) -> None:
    """One request whose transfer (with a 600 s deadline) must fail at once; then both close."""
    try:
        p_req, d_req = dispatch(p, d, tid, 2 * BLOCK_SIZE)
        settle((p, d), [p_req, d_req], limit=30.0)
        assert d_req.status == RequestStatus.FINISHED_ERROR
    finally:
        d.close()
        p.close()


def test_prefill_and_decode_with_different_layer_groups_still_move() -> None:
    """How many WRITEs P makes is P's business (its layer groups, its chunks): D leaves the
    count open, and P's batches must still cover D's blocks x layers exactly."""
    p, d = make_pair(p_extra={"push_layer_groups": 1}, d_extra={"push_layer_groups": 2})
    try:
        move_and_check(p, d, "t9", 2 * BLOCK_SIZE)
    finally:
        d.close()
        p.close()


def test_push_over_nixl_moves_the_bytes() -> None:
    p, d = make_pair(transport="nixl")
    try:
        move_and_check(p, d, "t6", 2 * BLOCK_SIZE + 1)
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_tensor_parallel_ranks_each_move_their_shard_to_the_same_rank(mode: str) -> None:
    """The router names only rank 0; rank r of D finds rank r of P, and vLLM's aggregator hears
    of the request once every rank has reported it."""
    p, d = make_pair(tensor_parallel=2)
    try:
        move_and_check(p, d, "t10", 3 * BLOCK_SIZE + 2, mode)  # checks both ranks' shards
    finally:
        d.close()
        p.close()


def test_a_write_failing_on_one_rank_fails_the_request_on_every_rank() -> None:
    """One WRITE per rank: the first fails, the other lands half a second later.  vLLM fails
    the request on the failing rank's report, the other rank aborts its transfer, and the blocks
    come back once both ranks have reported."""
    name = fabric()
    faults = FaultPlan(fail_ops={1}, stall_ops={2}, stall_for=0.5)
    install_fabric(name, LoopbackFabric(faults=faults))
    extra = {"fabric": name, "transfer_timeout": 600.0, "push_layer_groups": 1}
    p, d = make_pair(extra=extra, tensor_parallel=2)
    decode_fails_long_before_its_deadline(p, d, "t11")


def test_a_connector_vllm_bound_no_kv_cache_manager_to_says_so_instead_of_failing_every_transfer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the manager P cannot read a request's blocks: every transfer would end as
    "prefill request ended early", naming the wrong cause.  The step names the missing binding."""
    p, d = make_pair()
    try:
        assert p.connector._manager is p.scheduler.kv_cache_manager  # bound by vLLM's own scheduler
        monkeypatch.setattr(p.connector, "_manager", None)  # a vLLM that never binds it
        dispatch(p, d, "unbound", 2 * BLOCK_SIZE)
        with pytest.raises(ConfigError, match="bound no KV cache manager.*bind_kv_cache_manager"):
            run((p,), lambda: False, limit=10.0)
    finally:
        d.close()
        p.close()
