"""Chunk-by-chunk push on vLLM's real Scheduler: a prompt longer than P's token budget
(``max_num_batched_tokens``) is prefilled in several steps, and each chunk's full blocks are
written to D in that chunk's step, so only the last chunk's blocks are left for the end.

Bytes are checked on D (every page, every rank) in each case: synchronous and asynchronous
scheduling, both hook orders, a full CUDA graph (no ``save_kv_layer``), a lagging device.
Preemption: vLLM frees a preempted request's blocks without asking the connector, so a
request preempted after some of its chunks were handed over has its transfer aborted (D's
request fails by its load-failure policy; it never reads KV a reused block gave a late WRITE).
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvflow.integrations.vllm.worker import Settings, layer_groups
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Role
from tests.vllm_compat_chunks import BUDGET, PROMPT, preempted_mid_prefill, preempting_pair, transfer_reason
from tests.vllm_pairs import dispatch, kvflow_engine, make_pair, move_and_check, run, settle


def landed(d: Any, tid: str) -> int:
    """How many of the transfer's batches have landed on D so far."""
    machines = [m for m in kvflow_engine(d).core.machines() if m.key == TransferKey(tid, 1) and m.role is Role.DECODE]
    return len(machines[0].landed) if machines else 0


@pytest.mark.parametrize(
    "options",
    [
        {"hook_order": "v1"},
        {"hook_order": "v2"},
        {"hook_order": "v2", "async_scheduling": True},
        {"hook_order": "v1", "async_scheduling": True},
        {"hook_order": "v2", "full_cudagraph": True},
        {"hook_order": "v1", "device_lag": 0.002},
        {"extra": {"push_posting": "step"}},
        {"extra": {"push_posting": "step"}, "device_lag": 0.002},  # each part still waits for its own event
    ],
    ids=["sync-v1", "sync-v2", "async-v2", "async-v1", "full-cudagraph", "lagging-device", "step", "step-lagging"],
)
def test_a_prompt_of_three_chunks_moves_byte_for_byte(options: dict[str, Any]) -> None:
    p, d = make_pair(p_options={"max_num_batched_tokens": BUDGET}, **options)
    try:
        move_and_check(p, d, "long", PROMPT)
        # layer groups x chunks: 4 groups for each of the three chunks that completed blocks
        assert p.steps >= 3
    finally:
        d.close()
        p.close()


def test_earlier_chunks_are_written_before_the_last_chunks_step() -> None:
    """D registers first; P then runs only its first two chunks' steps: their full blocks (four
    of seven, in every layer group) have landed on D before P's last chunk is even scheduled."""
    p, d = make_pair(p_options={"max_num_batched_tokens": BUDGET})
    try:
        p_req, d_req = dispatch(p, d, "early", PROMPT)
        for _ in range(10):
            d.step()  # D allocates and registers; P has not stepped yet
        assert p.steps == 0
        p.step()
        p.step()
        assert p_req.num_computed_tokens == 2 * BUDGET < PROMPT  # the last chunk is still to come
        groups = len(layer_groups(p.shape.layers, Settings().push_layer_groups))
        run((d,), lambda: landed(d, "early") == 2 * groups, limit=10.0)  # D steps, P does not
        settle((p, d), [p_req, d_req])
        assert d.checked == {d_req.request_id: 0}
    finally:
        d.close()
        p.close()


def test_pull_with_chunks_reads_once_at_the_end() -> None:
    p, d = make_pair(p_options={"max_num_batched_tokens": BUDGET})
    try:
        move_and_check(p, d, "pulled", PROMPT, mode="pull")
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_after_a_chunk_went_out_aborts_the_transfer(async_scheduling: bool) -> None:
    """vLLM's Scheduler preempts the request mid-prefill (see `preempted_mid_prefill`): its
    transfer is aborted on both sides, D never reads its pages, P frees every block, and the
    next request on the same engines moves."""
    p, d = preempting_pair(async_scheduling=async_scheduling, hook_order="v2")
    try:
        b_p, b_d = preempted_mid_prefill(p, d)
        assert b_d.status == RequestStatus.FINISHED_ERROR and b_d.request_id not in d.checked
        assert "prefill request preempted" in transfer_reason(p, "b")
        assert "prefill request preempted" in transfer_reason(d, "b")
        assert b_p.status == RequestStatus.FINISHED_LENGTH_CAPPED  # recomputed, not pushed again
        move_and_check(p, d, "after", PROMPT)
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize(("prompt", "groups"), [(64, 1), (128, 2), (256, 4), (512, 4)])
def test_a_chunk_goes_out_in_as_many_layer_groups_as_push_group_bytes_fills(prompt: int, groups: int) -> None:
    """Every WRITE costs P's engine the same work whatever its size, so a small chunk goes out
    in fewer of them: at least ``push_group_bytes`` each, at most ``push_layer_groups``.  (A
    block here holds 128 KiB over the model's four layers.)"""
    extra = {"push_layer_groups": 4, "push_group_bytes": 256 << 10}
    p, d = make_pair(extra=extra)
    try:
        move_and_check(p, d, f"g{prompt}", prompt)
        assert landed(d, f"g{prompt}") == groups
    finally:
        d.close()
        p.close()
