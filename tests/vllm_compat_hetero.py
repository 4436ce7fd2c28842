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

from kvflow.integrations.vllm.standin import ModelShape, StandInEngine
from tests.vllm_compat_registry import moves, refused_at_handshake, scenario
from tests.vllm_pairs import kvflow_engine

HND = "LBHNC"  # heads outside tokens in each page: a head's tokens are one run of bytes
MLA: dict[str, Any] = {"model": ModelShape(family="deepseek_v3"), "backend": "TRITON_MLA"}


def heads(engine: StandInEngine) -> list[range]:
    """The model KV heads each rank's kvflow engine announces."""
    return [kvflow_engine(engine, rank).layout.spec.heads for rank in range(engine.options.tensor_parallel)]


def unequal(p_tp: int, d_tp: int, d_heads: list[range], d_peers: list[list[str]], **options: Any) -> None:
    """P with `p_tp` ranks, D with `d_tp`; one request moves and every D rank's pages hold
    P's KV head for head; D rank r holds heads `d_heads[r]` and received from `d_peers[r]`."""

    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        assert heads(d) == d_heads
        for rank, sources in enumerate(d_peers):
            engine = kvflow_engine(d, rank)
            assert engine.stats().get("completed") == len(sources), (rank, engine.stats())
            assert set(sources) <= set(engine.peers())

    moves(
        f"t-tp{p_tp}{d_tp}",
        inspect=inspect,
        p_options={"tensor_parallel": p_tp},
        d_options={"tensor_parallel": d_tp},
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
    refused_at_handshake(
        fragment, caplog, kv_cache_layout="LBNHC", p_options={"tensor_parallel": 2}, d_options={"tensor_parallel": 1}
    )
