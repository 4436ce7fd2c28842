"""Compatibility-matrix scenarios for a request's life around the transfer: P's queue is long,
D's request ends before it had blocks, vLLM preempts on D or on P.

Each runs vLLM's real Scheduler on both sides (the stand-in), moves real bytes over the loopback
transport and ZeroMQ, and checks D's pages byte for byte and that both engines end empty.
"""

from __future__ import annotations

import time

import pytest
from vllm.v1.request import RequestStatus

from kvflow.integrations.vllm.standin import StandInEngine
from tests.vllm_compat_registry import scenario
from tests.vllm_pairs import BLOCK_SIZE, dispatch, is_finished, kvflow_engine, make_pair, run, settle

PROMPT = 3 * BLOCK_SIZE + 7


def hold(engines: tuple[StandInEngine, ...], seconds: float) -> None:
    """Step only `engines` for `seconds` of wall time: the others' queues stay where they are
    (their kvflow engines keep running: heartbeats go on)."""
    until = time.monotonic() + seconds
    run(engines, lambda: time.monotonic() >= until, limit=seconds + 30.0)


@scenario("p-queue-long")
def _p_queue_long(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    # D waits 2 s for a transfer; P takes its request, prefills one chunk and then is held
    # (its queue is long) for 3 transfer timeouts, alive and heartbeating.  P's claim renews
    # D's wait, so the KV still arrives, byte for byte.
    timeout = 2.0
    p, d = make_pair(
        extra={"transfer_timeout": timeout, "lease": 1.2}, p_options={"max_num_batched_tokens": BLOCK_SIZE}
    )
    try:
        p_req, d_req = dispatch(p, d, "queued", PROMPT)
        run((d,), lambda: d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and bool(kvflow_engine(d).core.live()))
        run((p,), lambda: p.steps >= 1)  # P took the request and began its prefill: one chunk of four
        assert p_req.num_computed_tokens == BLOCK_SIZE
        hold((d,), 3 * timeout)
        assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, "D gave up while P still held the request"
        settle((p, d), [p_req, d_req])
        assert d.checked == {d_req.request_id: 0}
        assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert kvflow_engine(d).stats()["capped_renewals"] == 0
    finally:
        d.close()
        p.close()


@scenario("d-abort-before-alloc")
def _d_abort_before_alloc(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    # D's request ends while still queued there (never allocated, so never registered).  P has
    # its KV ready and waits for D's registration: told, it frees its blocks at once, far
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


@scenario("preempt-p-prefill")
def _preempt_p_prefill(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    # Requests prefill in chunks on a P whose KV cache holds one and a half; D is held at first, so
    # kvflow keeps the finished prefills' blocks for it, and vLLM preempts the requests still
    # prefilling (their blocks go back, their prefill starts over).  kvflow pushes a request's
    # KV after its last chunk, from the blocks that hold it then: every D request gets P's bytes.
    p, d = make_pair(
        p_options={"num_blocks": 7, "max_num_batched_tokens": 2 * BLOCK_SIZE},
        d_options={"num_blocks": 40},
        max_model_len=160,
    )
    try:
        pairs = [dispatch(p, d, f"pre{i}", PROMPT - i) for i in range(4)]
        run((p,), lambda: any(p_req.num_preemptions for p_req, _ in pairs))
        settle((p, d), [r for pair in pairs for r in pair], limit=60.0)
        assert d.checked == {d_req.request_id: 0 for _, d_req in pairs}
        assert all(d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED for _, d_req in pairs)
    finally:
        d.close()
        p.close()
