"""The compatibility matrix's hybrid-model rows: vLLM's hybrid KV cache manager on (kvflow's
connector declares `SupportsHMA`), so each KV cache group has a block table of its own, and a
sliding-window group holds only the blocks of its window.

Each scenario runs P and D on vLLM's own scheduler, KV cache planning and allocation (the
stand-in); D checks every page it holds (every group's, a sliding window's within the window)
against P's pattern, and the bytes P wrote are compared with what each group keeps: a sliding
window's blocks and nothing more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Role
from kvflow_tools.standin import ModelShape, StandInEngine
from tests.vllm_compat_hetero import HND
from tests.vllm_compat_registry import refused_at_handshake, scenario
from tests.vllm_pairs import (
    BLOCK_SIZE,
    consecutive_free_ports,
    dispatch,
    kvflow_engine,
    make_pair,
    move_and_check,
    sequential_move,
    settle,
)

S, F = "sliding_attention", "full_attention"
GEMMA2 = ModelShape(family="gemma2")  # sliding (window 64) and full attention in turn: gpt-oss's pattern
GEMMA3 = ModelShape(family="gemma2", layers=12, layer_types=((S,) * 5 + (F,)) * 2)  # 5 sliding : 1 full
ALL_SLIDING = ModelShape(family="gemma2", layer_types=(S,) * 4)
PROMPTS = (7, 3 * BLOCK_SIZE + 7, 300)  # under one block; under the window; past it


def kept(prompt: int, window: int = 64) -> int:
    """The first block position a sliding-window group keeps after `prompt` tokens (vLLM frees
    the blocks wholly before the last ``window - 1`` tokens)."""
    return max(0, prompt - (window - 1)) // BLOCK_SIZE


def expected_bytes(engine: StandInEngine, prompt: int) -> int:
    """What P writes for one request: each KV cache group's blocks times its layers, a sliding
    window's only from `kept` on."""
    spec = kvflow_engine(engine).layout.spec
    needed = -(-prompt // BLOCK_SIZE)
    total = 0
    for group in spec.groups:
        blocks = needed - (kept(prompt, group.retained + 1) if group.retained is not None else 0)
        total += blocks * group.count
    return int(total * spec.page_bytes)


def moved_bytes(p: StandInEngine, d: StandInEngine, tid: str, prompt: int, mode: str = "push") -> int:
    """One request through P and D, checked; the bytes it moved (P's WRITEs, or D's READs)."""
    counter, side = ("bytes_written", p) if mode == "push" else ("bytes_read", d)
    before = sum(int(getattr(e.counters, counter)) for e in side.kvflow_engines())
    d.checked.clear()
    move_and_check(p, d, tid, prompt, mode=mode)
    return sum(int(getattr(e.counters, counter)) for e in side.kvflow_engines()) - before


def registered(d: StandInEngine, tid: str, group: int, rank: int = 0) -> tuple[int, int]:
    """(first position, blocks) D's rank registered for one KV cache group of transfer `tid`."""
    m = kvflow_engine(d, rank).core.machine(TransferKey(f"{tid}#g{group}", 1), Role.DECODE)
    return m.first_position, len(m.block_ids)


def each_prompt(p: StandInEngine, d: StandInEngine, name: str, mode: str = "push") -> None:
    """Every prompt of `PROMPTS` moves, its bytes what each group keeps."""
    for prompt in PROMPTS:
        assert moved_bytes(p, d, f"{name}-{prompt}", prompt, mode) == expected_bytes(p, prompt), prompt


@scenario("hybrid-hma-on")
def _hma_on(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    p, d = make_pair(model=GEMMA2, num_blocks=256)
    try:
        for engine in (p, d):  # vLLM keeps its hybrid manager on for kvflow: two groups of two layers
            assert not engine.config.scheduler_config.disable_hybrid_kv_cache_manager
            assert kvflow_engine(engine).layout.spec.kv_groups == "sw63*2,full*2"
        each_prompt(p, d, "gemma2")
        # past the window, D registered the sliding group's last 3 blocks only, the full group's 10
        assert (registered(d, "gemma2-300", 0), registered(d, "gemma2-300", 1)) == ((7, 3), (0, 10))
        with_hma = moved_bytes(p, d, "again", 300)
    finally:
        d.close()
        p.close()
    p, d = make_pair(model=GEMMA2, num_blocks=256, hybrid_kv_cache_manager=False)
    try:  # the same prompt with the manager off: every layer's every block
        assert moved_bytes(p, d, "off", 300) == 40 * kvflow_engine(p).layout.spec.page_bytes > with_hma
    finally:
        d.close()
        p.close()


@scenario("hybrid-hma-off")
def _hma_off(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvflow.vllm"):
        p, d = make_pair(model=GEMMA2, hybrid_kv_cache_manager=False)
    try:
        [group] = p.kv_cache_config.kv_cache_groups
        assert getattr(group.kv_cache_spec, "sliding_window", None) == 64 and len(group.layer_names) == 4
        assert kvflow_engine(p).layout.spec.kv_groups == ""
        move_and_check(p, d, "t-gemma", 5 * BLOCK_SIZE)  # a prompt longer than the 64-token window
    finally:
        d.close()
        p.close()
    assert fragment in caplog.text
    assert "kvflow: 2 of the 4 layers are sliding-window" in caplog.text  # Gemma 2 alternates them


@scenario("kv-cache-groups")
def _groups(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    p, d = make_pair(model=GEMMA3, num_blocks=512)
    try:
        groups = [type(g.kv_cache_spec).__name__ for g in p.kv_cache_config.kv_cache_groups]
        assert groups == ["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"], groups
        each_prompt(p, d, "gemma3")
        assert [registered(d, "gemma3-300", g) for g in range(6)] == [(7, 3)] * 5 + [(0, 10)]
    finally:
        d.close()
        p.close()


@scenario("sliding-window-group")
def _sliding_only(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    p, d = make_pair(model=ALL_SLIDING, num_blocks=256)
    try:
        assert kvflow_engine(p).layout.spec.kv_groups == "sw63*4"
        each_prompt(p, d, "sliding")
        assert registered_single(d, "sliding-300") == (7, 3)
    finally:
        d.close()
        p.close()


def registered_single(d: StandInEngine, tid: str) -> tuple[int, int]:
    """As `registered`, for a model with one KV cache group (its transfer keeps the pair's id)."""
    m = kvflow_engine(d).core.machine(TransferKey(tid, 1), Role.DECODE)
    return m.first_position, len(m.block_ids)


@scenario("hybrid-chunked")
def _chunked(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    """P's budget of 48 tokens prefills 300 in 7 chunks: vLLM frees each chunk's sliding-window
    blocks once the window has passed them (and hands them to other requests); P pushes only
    the blocks the window keeps at the end, and two prompts prefilled side by side both land.
    A model whose every layer slides hands nothing over in its first chunks: aborted then, its
    request holds nothing anywhere."""
    for options in ({"hook_order": "v1"}, {"hook_order": "v2", "async_scheduling": True}):
        p, d = make_pair(model=GEMMA3, num_blocks=512, p_options={"max_num_batched_tokens": 48}, **options)
        try:
            each_prompt(p, d, f"chunks-{options['hook_order']}")
            first, second = dispatch(p, d, "side-a", 300), dispatch(p, d, "side-b", 250)
            d.checked.clear()
            settle((p, d), [*first, *second])
            assert d.checked == {first[1].request_id: 0, second[1].request_id: 0}, d.checked
        finally:
            d.close()
            p.close()
    # every layer slides: P's first chunks hand nothing over (all before the window); a request
    # aborted then leaves P and D empty, and D's request fails at once
    p, d = make_pair(model=ALL_SLIDING, num_blocks=256, p_options={"max_num_batched_tokens": 48})
    try:
        p_req, d_req = dispatch(p, d, "cut", 300)
        while p_req.num_computed_tokens < 96:
            d.step()
            p.step()
        p.scheduler.finish_requests(p_req.request_id, RequestStatus.FINISHED_ABORTED)
        settle((p, d), [p_req, d_req])
        assert d_req.status == RequestStatus.FINISHED_ERROR
    finally:
        d.close()
        p.close()


@scenario("hybrid-prefix")
def _prefix(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    """D's prefix cache holds a prompt's first blocks in every group (a prompt within the window
    loaded them all): a longer prompt sharing them registers the full-attention group's blocks
    after the hit, and the sliding window's within its window only."""
    from tests.vllm_prefix import move, prompt

    p, d = make_pair(model=GEMMA2, num_blocks=256, d_options={"prefix_caching": True})
    try:
        warm = prompt(2, seed=11)
        move(p, d, "warm", warm)
        move(p, d, "hit", prompt(9, 7, seed=12, shared=warm))
        sliding, full = registered(d, "hit", 0), registered(d, "hit", 1)
        hit = full[0]  # what vLLM's hybrid coordinator found for every group (a block: the last is recomputed)
        assert hit >= 1 and (sliding, full) == ((7, 3), (hit, 10 - hit)), (sliding, full)
    finally:
        d.close()
        p.close()


@scenario("hybrid-tp")
def _tensor_parallel(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    p, d = make_pair(model=GEMMA2, num_blocks=256, kv_cache_layout=HND, d_options={"tensor_parallel": 2})
    try:
        each_prompt(p, d, "tp12")
        assert [registered(d, "tp12-300@p0d1", 0, rank=1)] == [(7, 3)]
    finally:
        d.close()
        p.close()


@scenario("hybrid-pull")
def _pull(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    """Pull (D READs each group's blocks, P's Ready naming the window's first position), and a
    sequential router's pull, where P assigns the transfer and D claims each group's part."""
    pulled(each_prompt, model=GEMMA2, num_blocks=256)


def pulled(each: Callable[..., None], **options: Any) -> None:
    """`each(p, d, name, mode="pull")` on a pair made with `options`, then a sequential router's
    request (P's port fixed, for the address P names in its answer)."""
    p, d = make_pair(**options, p_extra={"port": consecutive_free_ports(1)})
    try:
        each(p, d, "pull", mode="pull")
        sequential_move(p, d, "toy-proxy", 300)
    finally:
        d.close()
        p.close()


@scenario("hybrid-block-multiple")
def _block_multiple(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    p_options, d_options = {"block_size": 16, "num_blocks": 256}, {"block_size": 32, "num_blocks": 128}
    refused_at_handshake(fragment, caplog, model=GEMMA2, p_options=p_options, d_options=d_options)
