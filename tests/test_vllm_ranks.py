"""Which P ranks feed which D ranks, and the pair transfer ids (`kvflow.integrations.vllm.ranks`):
pure code, checked against vLLM's head sharding."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.params import PeerRef, TransferParams
from kvflow.integrations.vllm.ranks import (
    heads_of,
    pair_keys,
    pair_transfer_id,
    sources,
    state_sources,
    targets,
    tp_sizes,
    transfer_parts,
)
from kvflow.layout.groups import KVGroup
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Mode, Role

SIZES = st.sampled_from([1, 2, 4, 8])


def vllm_heads(total: int, tp: int, rank: int) -> range:
    """vLLM's own rule (ModelConfig.get_num_kv_heads and the attention layer's head slice)."""
    per_rank = max(1, total // tp)
    return range(rank * total // tp, rank * total // tp + per_rank)


@given(total=SIZES, p_tp=SIZES, d_tp=SIZES)
def test_every_d_head_comes_from_exactly_one_p_rank_that_holds_it(total: int, p_tp: int, d_tp: int) -> None:
    for d in range(d_tp):
        assert heads_of(total, d_tp, d) == vllm_heads(total, d_tp, d)
        feeding = sources(total, p_tp, d_tp, d)
        for head in heads_of(total, d_tp, d):
            holders = [p for p in feeding if head in heads_of(total, p_tp, p)]
            assert len(holders) == 1, (head, feeding)
        assert all(set(heads_of(total, p_tp, p)) & set(heads_of(total, d_tp, d)) for p in feeding)
    for p in range(p_tp):
        assert targets(total, p_tp, d_tp, p) == [d for d in range(d_tp) if p in sources(total, p_tp, d_tp, d)]
    if p_tp == d_tp:  # rank r to rank r, under the request's own transfer id
        assert all(sources(total, p_tp, d_tp, r) == [r] for r in range(d_tp))
        assert pair_transfer_id("t", p_tp, d_tp, 1, 1) == "t"


@given(p_tp=SIZES, d_tp=SIZES)
def test_an_mla_cache_comes_from_one_p_rank_and_d_ranks_spread_over_p_ranks(p_tp: int, d_tp: int) -> None:
    chosen = [sources(1, p_tp, d_tp, d) for d in range(d_tp)]
    assert all(len(c) == 1 for c in chosen)
    load = [sum(c == [p] for c in chosen) for p in range(p_tp)]
    assert max(load) - min(load) <= 1  # no P rank sends twice while another could send


def test_pair_ids_differ_per_pair_and_bad_sharding_is_refused() -> None:
    ids = {pair_transfer_id("t", 2, 4, p, d) for p in range(2) for d in range(4)}
    assert len(ids) == 8 and "t" not in ids
    with pytest.raises(ConfigError, match="do not split"):
        heads_of(6, 4, 0)
    with pytest.raises(ConfigError, match="does not exist"):
        heads_of(4, 2, 2)


def params(p_tp: int = 0, d_tp: int = 0) -> TransferParams:
    return TransferParams(
        "t", 3, Mode.PUSH, PeerRef("prefill", "tcp://h:1", p_tp), PeerRef("decode", "tcp://h:2", d_tp)
    )


def test_a_rank_pairs_as_the_params_say_and_refuses_params_that_misname_its_own_size() -> None:
    assert tp_sizes(params(), Role.DECODE, 2) == (2, 2)  # nothing said: the local size, checked at the handshake
    assert pair_keys(params(4, 2), Role.DECODE, 1, 2, 8) == [
        (2, TransferKey("t@p2d1", 3)),
        (3, TransferKey("t@p3d1", 3)),
    ]
    assert pair_keys(params(2, 1), Role.PREFILL, 1, 2, 1) == []  # MLA 2 -> 1: P rank 1 feeds nobody
    with pytest.raises(ConfigError, match="give engine 'decode' 4 tensor-parallel ranks; it has 2"):
        pair_keys(params(2, 4), Role.DECODE, 0, 2, 8)


GROUPS = (KVGroup((0, 2), state=True), KVGroup((2, 4)))  # a Mamba state group, then full attention


@given(total=SIZES, p_tp=SIZES, d_tp=SIZES)
def test_state_groups_pair_every_rank_whose_shard_overlaps_and_both_sides_name_the_same_parts(
    total: int, p_tp: int, d_tp: int
) -> None:
    request = params(p_tp, d_tp)
    decode = {
        (p, d, g, key)
        for d in range(d_tp)
        for p, g, key in transfer_parts(request, Role.DECODE, d, d_tp, total, GROUPS)
    }
    prefill = {
        (p, d, g, key)
        for p in range(p_tp)
        for d, g, key in transfer_parts(request, Role.PREFILL, p, p_tp, total, GROUPS)
    }
    assert decode == prefill  # each part is named alike on both sides, without talking
    for d in range(d_tp):
        # P rank p holds [p / p_tp, (p + 1) / p_tp) of the state, D rank d [d / d_tp, (d + 1) / d_tp)
        overlapping = [p for p in range(p_tp) if p / p_tp < (d + 1) / d_tp and d / d_tp < (p + 1) / p_tp]
        assert state_sources(p_tp, d_tp, d) == overlapping
        assert sorted(p for p, dd, g, _ in decode if dd == d and g == 0) == overlapping
        assert sorted(p for p, dd, g, _ in decode if dd == d and g == 1) == sources(total, p_tp, d_tp, d)
    for d in range(d_tp):  # on one D rank (one engine), every part is a transfer of its own
        mine = [key for _, dd, _, key in decode if dd == d]
        assert len(set(mine)) == len(mine)


def test_p_ranks_that_replicate_heads_still_send_their_share_of_the_state() -> None:
    """2 KV heads on 4 P ranks (each head on two), one D rank: the attention KV comes from one
    replica of each head, the state from all four P ranks."""
    request = params(4, 1)
    parts = transfer_parts(request, Role.DECODE, 0, 1, 2, GROUPS)
    assert [(p, g) for p, g, _ in parts] == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (3, 0)]
    assert [(d, g) for d, g, _ in transfer_parts(request, Role.PREFILL, 1, 4, 2, GROUPS)] == [(0, 0)]
    without_state = [(p, g) for p, g, _ in transfer_parts(request, Role.DECODE, 0, 1, 2, 2)]
    assert without_state == [(0, 0), (0, 1), (2, 0), (2, 1)]  # no state group: head pairs alone
