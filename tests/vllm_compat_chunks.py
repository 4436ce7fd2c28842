"""The compatibility matrix's chunked-prefill rows: a prompt longer than P's token budget is
prefilled in several steps, and pushed chunk by chunk (see `tests/test_vllm_chunks.py` for the
cases around them), also into D blocks larger than P's, where a chunk may end inside one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvflow.protocol.state import Role
from tests.vllm_compat_hetero import HND, sized
from tests.vllm_compat_registry import moves, scenario
from tests.vllm_pairs import BLOCK_SIZE, dispatch, kvflow_engine, make_pair, move_and_check, settle

BUDGET = 72  # P's token budget: not a multiple of the block size, so chunks end mid-block
PROMPT = 6 * BLOCK_SIZE + 7  # 199 tokens: chunks of 72, 72 and 55
CHUNKED: dict[str, Any] = {"p_options": {"max_num_batched_tokens": BUDGET}}


@scenario("chunked-prefill-push")
def _chunked_push(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    moves("t-chunks", PROMPT, hook_order="v1", **CHUNKED)


@scenario("chunked-prefill-async")
def _chunked_async(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    moves("t-chunks-async", PROMPT, hook_order="v2", async_scheduling=True, **CHUNKED)


@scenario("chunked-prefill-cudagraph")
def _chunked_graph(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    moves("t-chunks-graph", PROMPT, hook_order="v2", full_cudagraph=True, **CHUNKED)


@scenario("chunked-prefill-pull")
def _chunked_pull(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    p, d = make_pair(**CHUNKED)
    try:
        move_and_check(p, d, "t-chunks-pull", PROMPT, mode="pull")
    finally:
        d.close()
        p.close()


def preempted_mid_prefill(p: Any, d: Any) -> tuple[Any, Any]:
    """On P (9 usable blocks, a budget of 64 tokens): a local request decoding alongside a
    250-token kvflow request (8 blocks).  vLLM admits the kvflow request (its whole prompt fits
    then), pushes its chunks, and when the local request's growth leaves no block for its last
    chunk, preempts it, freeing its blocks.  Returns the kvflow request's two legs, settled."""
    local = p.add("p-local", 32, 40, {}, tag="local")
    b_p, b_d = dispatch(p, d, "b", 250)
    for _ in range(20):
        d.step()
        p.step()
        if b_p.num_preemptions:
            break
    assert b_p.num_preemptions == 1, p.describe()
    settle((p, d), [local, b_p, b_d], limit=30.0)
    return b_p, b_d


def transfer_reason(engine: Any, tid: str) -> str:
    """Why the engine's (rank 0) side of transfer `tid` ended."""
    (machine,) = [m for m in kvflow_engine(engine).core.machines() if m.key.transfer_id == tid]
    return str(machine.reason)


def preempting_pair(**options: Any) -> tuple[Any, Any]:
    return make_pair(p_options={"max_num_batched_tokens": 64, "num_blocks": 10}, max_model_len=256, **options)


@scenario("chunked-preempted")
def _chunked_preempted(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    p, d = preempting_pair(hook_order="v2")
    try:
        _, b_d = preempted_mid_prefill(p, d)
        assert b_d.status == RequestStatus.FINISHED_ERROR and b_d.request_id not in d.checked
        assert fragment in transfer_reason(d, "b")
        move_and_check(p, d, "after", 3 * BLOCK_SIZE + 7)  # the next request's KV moves
    finally:
        d.close()
        p.close()


# P's blocks of 16 tokens, D's of 32, and a P budget that ends chunks inside D's blocks
FINE_PROMPT = 6 * 16 + 7  # 103 tokens: P blocks 0..6 fill D blocks 0..3


def p_batch_starts(p: Any, tid: str) -> list[int]:
    """The P block positions P's batches of transfer `tid` started at (rank 0; with unequal
    tensor parallelism, in each of its pair transfers, ``tid@p0d<r>``)."""
    machines = [
        m
        for m in kvflow_engine(p).core.machines()
        if m.key.transfer_id.partition("@")[0] == tid and m.role is Role.PREFILL
    ]
    assert machines, f"P holds no transfer {tid}"
    return sorted({batch.first for m in machines for batch in m.batches})


def straddles(tid: str) -> Callable[[Any, Any], None]:
    """An `inspect` asserting that a chunk of P's started inside one of D's blocks."""

    def inspect(p: Any, d: Any) -> None:
        assert any(first % 2 for first in p_batch_starts(p, tid)), p_batch_starts(p, tid)

    return inspect


@scenario("chunked-block-multiple")
def _chunked_block_multiple(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    # budget 40: chunks start at P blocks 0, 2, 5; budget 48: at 0, 3, 6
    for layout in ("LBNHC", HND):  # tokens outside heads; heads outside tokens (a P block strided in D's)
        for budget in (40, 48):
            tid = f"t-cbm-{layout}-{budget}"
            p_options = {**sized(16), "max_num_batched_tokens": budget}
            moves(tid, FINE_PROMPT, straddles(tid), kv_cache_layout=layout, p_options=p_options, d_options=sized(32))
    tid = "t-cbm-tp12"  # and each of two D ranks taking its heads
    p_options = {**sized(16), "max_num_batched_tokens": 40}
    d_options = {**sized(32), "tensor_parallel": 2}
    moves(tid, FINE_PROMPT, straddles(tid), kv_cache_layout=HND, p_options=p_options, d_options=d_options)


@scenario("chunked-block-multiple-shared")
def _chunked_block_multiple_shared(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    """Two prompts share P's budget of 64: the first takes 40 tokens, the second the other 24
    (one P block, half a D block), so its next chunk starts inside a D block."""
    for layout in ("LBNHC", HND):
        p, d = make_pair(
            kv_cache_layout=layout, p_options={**sized(16), "max_num_batched_tokens": 64}, d_options=sized(32)
        )
        try:
            first = dispatch(p, d, f"t-a-{layout}", 40)
            second = dispatch(p, d, f"t-b-{layout}", FINE_PROMPT)
            settle((p, d), [*first, *second])
            assert d.checked == {first[1].request_id: 0, second[1].request_id: 0}, d.checked
            assert all(leg.status == RequestStatus.FINISHED_LENGTH_CAPPED for leg in (first[1], second[1]))
            assert any(start % 2 for start in p_batch_starts(p, f"t-b-{layout}")), p_batch_starts(p, f"t-b-{layout}")
        finally:
            d.close()
            p.close()
