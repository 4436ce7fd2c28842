"""Compatibility matrix rows for heterogeneous P and D: tensor parallelism of different sizes
(GQA and MLA), block sizes that are multiples, data parallelism.

Each side is one stand-in engine holding all its tensor-parallel ranks in this process (vLLM's
real Scheduler, KV cache planning and allocation, one worker connector and kvflow engine per
rank); D checks every page of every rank against P's pattern, which is defined per model KV
head and token, so a head landing on the wrong rank, at the wrong offset or not at all fails.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.protocol.state import Mode
from kvflow_tools.routing import legs, router
from kvflow_tools.standin import EngineOptions, ModelShape, StandInEngine
from tests.vllm_compat_registry import moves, refused_at_handshake, scenario
from tests.vllm_pairs import consecutive_free_ports, fabric, kvflow_engine, make_pair, move_and_check, settle

HND = "LBHNC"  # heads outside tokens in each page: a head's tokens are one run of bytes
MLA: dict[str, Any] = {"model": ModelShape(family="deepseek_v3"), "backend": "TRITON_MLA"}


def sized(block_size: int) -> dict[str, int]:
    """Engine options for blocks of `block_size` tokens, enough of them for the model's length."""
    return {"block_size": block_size, "num_blocks": max(64, 64 * 32 // block_size)}


def pulled(tid: str, prompt: int, **options: Any) -> None:
    """As `moves`, in pull mode (D READs from the P ranks it pairs with)."""
    p, d = make_pair(**options)
    try:
        move_and_check(p, d, tid, prompt, mode="pull")
    finally:
        d.close()
        p.close()


def heads(engine: StandInEngine) -> list[range]:
    """The model KV heads each rank's kvflow engine announces."""
    return [kvflow_engine(engine, rank).layout.spec.heads for rank in range(engine.options.tensor_parallel)]


def unequal(
    p_tp: int,
    d_tp: int,
    d_heads: list[range],
    d_peers: list[list[str]],
    blocks: tuple[int, int] = (32, 32),
    **options: Any,
) -> None:
    """P with `p_tp` ranks, D with `d_tp` (and blocks of `blocks` tokens, P's and D's); one
    request moves and every D rank's pages hold P's KV head for head; D rank r holds heads
    `d_heads[r]` and received from `d_peers[r]`."""

    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        assert heads(d) == d_heads
        for rank, sources in enumerate(d_peers):
            engine = kvflow_engine(d, rank)
            assert engine.stats().get("completed") == len(sources), (rank, engine.stats())
            assert set(sources) <= set(engine.peers())

    moves(
        f"t-tp{p_tp}{d_tp}-{blocks[0]}",
        inspect=inspect,
        p_options={"tensor_parallel": p_tp, **sized(blocks[0])},
        d_options={"tensor_parallel": d_tp, **sized(blocks[1])},
        **options,
    )


@scenario("tp-1-to-2")
def _tp_1_to_2(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    unequal(1, 2, [range(2), range(2, 4)], [["prefill-tp0"], ["prefill-tp0"]], kv_cache_layout=HND)


@scenario("tp-2-to-1")
def _tp_2_to_1(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    unequal(2, 1, [range(4)], [["prefill-tp0", "prefill-tp1"]], kv_cache_layout=HND)


@scenario("tp-4-to-2")
def _tp_4_to_2(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    sources = [["prefill-tp0", "prefill-tp1"], ["prefill-tp2", "prefill-tp3"]]
    unequal(4, 2, [range(2), range(2, 4)], sources, kv_cache_layout=HND)


@scenario("tp-2-to-4")
def _tp_2_to_4(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    d_heads = [range(h, h + 1) for h in range(4)]
    sources = [["prefill-tp0"], ["prefill-tp0"], ["prefill-tp1"], ["prefill-tp1"]]
    unequal(2, 4, d_heads, sources, kv_cache_layout=HND)


@scenario("mla-tp-unequal")
def _mla_tp_unequal(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    # 1 -> 2: both D ranks from the one P rank; 2 -> 1: from P rank 0 only (P rank 1 frees at once)
    unequal(1, 2, [range(1), range(1)], [["prefill-tp0"], ["prefill-tp0"]], **MLA)
    unequal(2, 1, [range(1)], [["prefill-tp0"]], **MLA)


@scenario("tp-nhd-unequal")
def _tp_nhd_unequal(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    # D is refused by P's rank 0, which frees its blocks at once; P's rank 1, which D never
    # reaches (its address comes in rank 0's handshake), frees them at its transfer deadline
    tp = {"p_options": {"tensor_parallel": 2}, "d_options": {"tensor_parallel": 1}}
    refused_at_handshake(fragment, caplog, p_deadline=3.0, kv_cache_layout="LBNHC", **tp)


@scenario("block-size-multiple")
def _block_size_multiple(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        assert (kvflow_engine(p).layout.spec.block_size, kvflow_engine(d).layout.spec.block_size) == (16, 32)

    for layout in ("LBNHC", HND):  # tokens outside heads: one run per (array, P block); HND: per head
        moves(f"t-bs-{layout}", 5 * 16 + 3, inspect, p_options=sized(16), d_options=sized(32))
    unequal(1, 2, [range(2), range(2, 4)], [["prefill-tp0"]] * 2, (16, 32), kv_cache_layout=HND)
    pulled("t-bs-pull", 5 * 16 + 3, p_options=sized(16), d_options=sized(32))


@scenario("block-size-not-multiple")
def _block_size_not_multiple(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    refused_at_handshake(fragment, caplog, p_options=sized(32), d_options=sized(48))
    refused_at_handshake(fragment, caplog, p_options=sized(32), d_options=sized(16))  # D's smaller than P's


@scenario("data-parallel")
def _data_parallel(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    """DP rank 1 of 2 on each side (D also TP 2): the router's params for that DP rank name
    vLLM's engine id ``<engine>_dp1`` and the ports after DP rank 0's; the legs carry vLLM's
    ``X-data-parallel-rank``."""
    p_base, d_base = consecutive_free_ports(2), consecutive_free_ports(4)
    common = {"transport": "loopback", "fabric": fabric()}
    hnd: dict[str, Any] = {"kv_cache_layout": HND, "data_parallel": (1, 2)}
    p = StandInEngine(EngineOptions("prefill", "kv_producer", {**common, "port": p_base}, **hnd))
    try:
        d = StandInEngine(EngineOptions("decode", "kv_consumer", {**common, "port": d_base}, tensor_parallel=2, **hnd))
    except BaseException:
        p.close()
        raise
    try:
        prefill = router.Backend("http://p:8100", "prefill", f"tcp://127.0.0.1:{p_base}", tp_size=1, dp_rank=1)
        decode = router.Backend("http://d:8200", "decode", f"tcp://127.0.0.1:{d_base}", tp_size=2, dp_rank=1)
        kv = legs.kvflow_params(Mode.PUSH, prefill, decode, "t-dp")
        assert kv["decode"] == {"engine": "decode_dp1", "address": f"tcp://127.0.0.1:{d_base + 2}", "tp_size": 2}
        assert [e.engine_id for e in d.kvflow_engines()] == ["decode_dp1-tp0", "decode_dp1-tp1"]
        assert decode.headers({}) == {"X-data-parallel-rank": "1"}
        prompt = 3 * 32 + 7
        d_req = d.add("d-t-dp", prompt, 4, {"do_remote_prefill": True, "kvflow": kv}, tag="t-dp")
        p_req = p.add("p-t-dp", prompt, 1, {"do_remote_decode": True, "kvflow": kv}, tag="t-dp")
        settle((p, d), [p_req, d_req])
        assert d.checked == {d_req.request_id: 0}, d.checked
    finally:
        d.close()
        p.close()
