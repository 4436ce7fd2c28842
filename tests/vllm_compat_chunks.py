"""The compatibility matrix's chunked-prefill rows: a prompt longer than P's token budget is
prefilled in several steps, and pushed chunk by chunk (see `tests/test_vllm_chunks.py` for the
cases around them)."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.request import RequestStatus

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
