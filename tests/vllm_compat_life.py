"""Compatibility-matrix scenarios for a request's life around the transfer: P's or D's queue is
long, D's request ends before it had blocks, vLLM preempts on D or on P.

Each runs vLLM's real Scheduler on both sides (the stand-in), moves real bytes over the loopback
transport and ZeroMQ, and checks D's pages byte for byte and that both engines end empty.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Outcome
from kvflow_tools.standin import StandInEngine
from tests.vllm_compat_registry import scenario
from tests.vllm_pairs import BLOCK_SIZE, crash, dispatch, is_finished, kvflow_engine, make_pair, run, settle

PROMPT = 3 * BLOCK_SIZE + 7


def hold(engines: tuple[StandInEngine, ...], seconds: float) -> None:
    """Step only `engines` for `seconds` of wall time: the others' queues stay where they are
    (their kvflow engines keep running: heartbeats go on)."""
    until = time.monotonic() + seconds
    run(engines, lambda: time.monotonic() >= until, limit=seconds + 30.0)


def queued_on_p(timeout: float, **extra: object) -> tuple[StandInEngine, StandInEngine, Any, Any]:
    """P and D, one request dispatched to both: D waits for its KV (registered), P took the
    request and prefilled one chunk of four, and is then held (its queue is long)."""
    settings = {"transfer_timeout": timeout, "lease": 1.2, **extra}
    p, d = make_pair(extra=settings, p_options={"max_num_batched_tokens": 2 * BLOCK_SIZE})
    try:
        p_req, d_req = dispatch(p, d, "queued", 4 * BLOCK_SIZE)
        run((d,), lambda: d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and bool(kvflow_engine(d).core.live()))
        run((p,), lambda: p.steps >= 1)
        assert p_req.num_computed_tokens == 2 * BLOCK_SIZE
    except BaseException:
        d.close()
        p.close()
        raise
    return p, d, p_req, d_req


@scenario("p-queue-long")
def _p_queue_long(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    # D waits 2 s for a transfer; P, alive and heartbeating, holds the request for three times
    # that.  P's promise renews D's wait, so the KV still arrives, byte for byte.
    timeout = 2.0
    p, d, p_req, d_req = queued_on_p(timeout)
    try:
        hold((d,), 3 * timeout)
        assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, "D gave up while P still held the request"
        settle((p, d), [p_req, d_req])
        assert d.checked == {d_req.request_id: 0}
        assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    finally:
        d.close()
        p.close()
    # A P that dies with the request queued renews nothing: D fails at the peer's loss (about a
    # lease), long before its 60 s transfer deadline.
    p, d, p_req, d_req = queued_on_p(60.0, fence_timeout=1.0)
    try:
        crash(p)
        settle((d,), [d_req], limit=20.0)
        assert d_req.status == RequestStatus.FINISHED_ERROR
    finally:
        d.close()


@scenario("d-queue-long")
def _d_queue_long(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    # D's queue holds the request (its KV cache is full with a local request) while P has
    # prefilled it and waits, KV ready, for D's registration: P would free the KV after its 2 s
    # transfer deadline, but D promised the request when it arrived, and D's heartbeats renew
    # P's hold for three times that; then D allocates and the KV arrives, byte for byte.
    timeout = 2.0
    p, d = make_pair(extra={"transfer_timeout": timeout, "lease": 1.2}, d_options={"num_blocks": 8}, max_model_len=224)
    try:
        local = d.add("local", 4 * BLOCK_SIZE, 3 * BLOCK_SIZE, {})  # holds 4-7 of D's 7 blocks
        run((d,), lambda: local.num_computed_tokens > 0)
        p_req, d_req = dispatch(p, d, "d-queued", PROMPT)  # needs 4 blocks: it waits in D's queue
        run((d,), lambda: kvflow_engine(d).core.store.promisee(TransferKey("d-queued", 1)) == "prefill-tp0")
        assert d_req.status == RequestStatus.WAITING and not kvflow_engine(d).core.live()
        run((p,), lambda: is_finished(p_req))  # prefilled; kvflow holds its blocks for D
        hold((p,), 3 * timeout)  # D's queue does not move; its kvflow engine beats on
        (waiting,) = kvflow_engine(p).core.live()
        assert waiting.key.transfer_id == "d-queued" and waiting.outcome is None
        settle((p, d), [p_req, d_req, local], limit=60.0)
        assert d.checked[d_req.request_id] == 0
        assert d_req.status == local.status == RequestStatus.FINISHED_LENGTH_CAPPED
    finally:
        d.close()
        p.close()


@scenario("d-abort-before-alloc")
def _d_abort_before_alloc(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    # D's request ends while still queued there (never allocated, so never registered).  P has
    # its KV ready and waits for D's registration: told, it frees its blocks at once, long
    # before its 600 s transfer deadline.
    p, d = make_pair(extra={"transfer_timeout": 600.0})
    try:
        p_req, d_req = dispatch(p, d, "gone", PROMPT)
        run((p,), lambda: is_finished(p_req))  # prefilled; kvflow holds its blocks for D
        assert p.connector.has_pending_push_work() and p.free_blocks() < p.options.num_blocks - 1
        d.scheduler.finish_requests(d_req.request_id, RequestStatus.FINISHED_ABORTED)
        settle((p, d), [p_req, d_req])
        (ended,) = [m for m in kvflow_engine(p).core.machines() if m.key.transfer_id == "gone"]
        assert ended.reason.startswith("peer aborted: decode request aborted before its blocks"), ended.reason
        # the other order: D gives up before P has even prefilled; P's KV comes back as soon as
        # its prefill ends
        p_req, d_req = dispatch(p, d, "gone-early", PROMPT)
        d.scheduler.finish_requests(d_req.request_id, RequestStatus.FINISHED_ABORTED)
        run((d,), lambda: kvflow_engine(p).stats()["early_messages"] == 1)  # D's notice is at P
        settle((p, d), [p_req, d_req])
        (ended,) = [m for m in kvflow_engine(p).core.machines() if m.key.transfer_id == "gone-early"]
        assert ended.outcome is Outcome.ABORTED and ended.reason.startswith("peer aborted"), ended.reason
    finally:
        d.close()
        p.close()


@scenario("preempt-d-waiting")
def _preempt_d_waiting(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    # D's request waits for its KV (WAITING_FOR_REMOTE_KVS) while D's own requests grow past
    # D's KV cache: vLLM preempts running requests only, so the blocks P writes into stay the
    # waiting request's; the KV lands byte for byte and the preempted requests finish too.
    p, d = make_pair(d_options={"num_blocks": 12}, max_model_len=320)
    try:
        p_req, d_req = dispatch(p, d, "waits", PROMPT)
        run((d,), lambda: d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        local = [d.add(f"local-{i}", 2 * BLOCK_SIZE - 4, 5 * BLOCK_SIZE, {}) for i in range(2)]
        run((d,), lambda: any(r.num_preemptions for r in local))  # P is held: D preempts meanwhile
        assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and d_req.num_preemptions == 0
        settle((p, d), [p_req, d_req, *local], limit=60.0)
        assert d.checked[d_req.request_id] == 0
        assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in local)
    finally:
        d.close()
        p.close()


def prefill_next_to_a_local_request(scheduling: str) -> tuple[StandInEngine, StandInEngine, Any, list[Any]]:
    """P serves a local request that keeps decoding (and so needs a block now and then) and
    three kvflow requests of five blocks, in chunks of two blocks, in a KV cache of six blocks;
    D is held, so kvflow keeps each finished prefill's blocks.  When the local request needs a
    block, vLLM preempts the last running request: a kvflow request mid-prefill (sync), or one
    whose last chunk was just scheduled (async)."""
    p, d = make_pair(
        p_options={
            "num_blocks": 7,
            "max_num_batched_tokens": 2 * BLOCK_SIZE,
            "async_scheduling": scheduling == "async",
        },
        d_options={"num_blocks": 40},
        max_model_len=5 * BLOCK_SIZE,
    )
    local = p.add("local", BLOCK_SIZE - 1 - (scheduling == "async"), 100, {})
    pairs = [dispatch(p, d, f"pre{i}", 5 * BLOCK_SIZE - 10 - i) for i in range(3)]
    return p, d, local, pairs


@scenario("preempt-p-prefill")
def _preempt_p_prefill(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    # Sync: a kvflow request is preempted mid-prefill (its blocks go back, its prefill starts
    # over) after its first chunk was pushed: never a WRITE from a freed block passes as KV.
    p, d, local, pairs = prefill_next_to_a_local_request("sync")
    try:
        run((p,), lambda: pairs[0][0].num_preemptions > 0)
        assert pairs[0][0].num_computed_tokens == 0 and local.num_preemptions == 0
        settle((p, d), [local, *(r for pair in pairs for r in pair)], limit=60.0)
        # its first chunk's blocks were pushed before vLLM freed them: its transfer is aborted
        # and D fails it (load-failure policy "fail"); the others move byte for byte
        assert pairs[0][1].status == RequestStatus.FINISHED_ERROR
        assert d.checked == {d_req.request_id: 0 for _, d_req in pairs[1:]}
    finally:
        d.close()
        p.close()
    # Async: the step after a request's last chunk is scheduled while that request still runs;
    # preempting it would hand the blocks kvflow sends from to another request.  kvflow has vLLM
    # wait a step instead (has_pending_block_frees): the request finishes, and the local
    # request is preempted.
    p, d, local, pairs = prefill_next_to_a_local_request("async")
    try:
        run((p,), lambda: local.num_preemptions > 0 or pairs[0][0].num_preemptions > 0)
        assert pairs[0][0].num_preemptions == 0, "a request was preempted while its KV was handed off"
        settle((p, d), [local, *(r for pair in pairs for r in pair)], limit=60.0)
        assert d.checked == {d_req.request_id: 0 for _, d_req in pairs}
    finally:
        d.close()
        p.close()
