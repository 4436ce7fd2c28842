"""Mamba / linear-attention state pages between ranks of different tensor parallelism, checked
byte for byte against a reference built from the whole (unsharded) state.

The reference holds each layer's state as vLLM's model would over all ranks: every conv
sub-projection as (columns, rows), the temporal state as a run of bytes sharded by heads.  A
rank's page is its shard of each, laid out DS or SD, then padding.  P's ranks hold their pages,
D's ranks start from a sentinel; every (P rank, D rank) pair the planner gives runs for moves
its descriptors, and each D page must then be exactly its shard, the padding untouched.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.errors import ConfigError, InvalidBatch, LayoutMismatch
from kvflow.layout import KVLayout, KVSpec, Region, check_compatible, fingerprint, plan_transfer
from kvflow.layout.states import StateSplit, parse_split, state_runs

HEADS = 8  # the attention layer's KV heads: every tp size below divides them
SENTINEL = 0xEE


def shard(array: npt.NDArray[np.uint8], rank: int, ranks: int) -> npt.NDArray[np.uint8]:
    size = array.shape[0] // ranks
    return array[rank * size : (rank + 1) * size]


def rank_page(
    split: StateSplit, parts: list[npt.NDArray[np.uint8]], temporal: npt.NDArray[np.uint8], rank: int, ranks: int
) -> npt.NDArray[np.uint8]:
    """Rank `rank` of `ranks`'s state bytes: its columns of each sub-projection, laid out DS or
    SD, then its shard of the temporal state."""
    columns = np.concatenate([shard(part, rank, ranks) for part in parts])  # (columns, rows)
    conv = columns if split.orientation == "ds" else columns.T
    return np.concatenate([conv.reshape(-1), shard(temporal, rank, ranks)])


def spec(split: StateSplit, rank: int, ranks: int, page: int) -> KVSpec:
    return KVSpec(
        num_layers=3,
        block_size=4,
        num_kv_heads=HEADS // ranks,
        head_dim=8,
        dtype="int8",
        kv_layout="LBHNC",
        arrays_per_layer=1,
        head_dim_v=0,
        page_bytes=page,  # the attention page, padded up to the largest state (vLLM pads the other way)
        head_start=rank * HEADS // ranks,
        total_kv_heads=HEADS,
        kv_groups="ssm*2,full*1",
        state_split=split.text(),
        tp_rank=rank,
        tp_size=ranks,
    )


@st.composite
def cases(draw: st.DrawFn) -> tuple[StateSplit, int, int, int]:
    p_tp, d_tp = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    unit = 8  # every part and the temporal state split over 8 ranks
    parts = tuple(unit * draw(st.integers(1, 4)) for _ in range(draw(st.sampled_from([1, 3]))))
    temporal = unit * draw(st.integers(0, 6))
    split = StateSplit(draw(st.sampled_from(["ds", "sd"])), draw(st.integers(1, 4)), parts, temporal)
    return split, p_tp, d_tp, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=150, deadline=None)
@given(cases())
def test_each_d_rank_gets_exactly_its_shard_of_every_state_from_the_p_ranks_that_hold_it(
    case: tuple[StateSplit, int, int, int],
) -> None:
    split, p_tp, d_tp, seed = case
    assert parse_split(split.text()) == split
    rng = np.random.default_rng(seed)
    blocks, layers = 3, (0, 2)  # the state group's layers; its block 1 on P goes to block 2 on D
    # a page as large as the largest rank's state (TP 1), in whole tokens of the attention layer
    page = 4 * HEADS * -(-split.rank_bytes(1) // (4 * HEADS)) + 4 * HEADS
    states = {
        layer: (
            [rng.integers(0, 256, (part, split.rows), dtype=np.uint8) for part in split.parts],
            rng.integers(0, 256, split.temporal, dtype=np.uint8),
        )
        for layer in range(*layers)
    }

    def memory(tp: int, rank: int) -> tuple[KVLayout, npt.NDArray[np.uint8]]:
        rank_spec = spec(split, rank, tp, page)
        layout = KVLayout.single_region(rank_spec, blocks, Region(0, blocks * rank_spec.page_bytes * 3))
        return layout, np.full(layout.required_bytes(0), SENTINEL, dtype=np.uint8)

    p_side = [memory(p_tp, p) for p in range(p_tp)]
    d_side = [memory(d_tp, d) for d in range(d_tp)]
    for layout, buffer in p_side:
        for layer in range(*layers):
            array = layout.layer_arrays(layer)[0]
            state = rank_page(split, *states[layer], layout.spec.tp_rank, p_tp)
            buffer[array.offset + 1 * array.stride :][: state.size] = state
    moved_pairs = set()
    for p, (p_layout, p_buffer) in enumerate(p_side):
        for d, (d_layout, d_buffer) in enumerate(d_side):
            if not state_runs(split, (p, p_tp), (d, d_tp)):
                with pytest.raises(InvalidBatch, match="share no"):
                    plan_transfer(p_layout, d_layout, [1], [2], layers)
                continue
            moved_pairs.add((p, d))
            for row in plan_transfer(p_layout, d_layout, [1], [2], layers):
                source = p_buffer[row.local_offset : row.local_offset + row.length]
                d_buffer[row.remote_offset : row.remote_offset + row.length] = source
    for d, (d_layout, d_buffer) in enumerate(d_side):
        for layer in range(*layers):
            array = d_layout.layer_arrays(layer)[0]
            start = array.offset + 2 * array.stride
            want = rank_page(split, *states[layer], d, d_tp)
            assert np.array_equal(d_buffer[start : start + want.size], want), (d, layer)
            assert (d_buffer[start + want.size : start + array.stride] == SENTINEL).all(), "padding written"
    # the pairs that move bytes: P ranks whose shard overlaps D rank's (all of them, once)
    expected = {
        (p, d) for d in range(d_tp) for p in range(p_tp) if p * d_tp < (d + 1) * p_tp and d * p_tp < (p + 1) * d_tp
    }
    assert moved_pairs == expected


def test_a_state_split_is_checked_where_it_enters() -> None:
    for text in ("ds:3", "xy:3:8:8", "ds:0:8:8", "ds:3::8", "ds:3:8+0:8", "ds:3:" + "+".join(["8"] * 9) + ":8"):
        with pytest.raises(ConfigError, match="state split"):
            parse_split(text)
    assert parse_split("") is None
    split = StateSplit("ds", 3, (64, 16, 16), 128)
    assert split.rank_bytes(4) == (3 * 96 + 128) // 4
    with pytest.raises(LayoutMismatch, match="do not split over 3 ranks"):
        split.rank_bytes(3)
    with pytest.raises(ConfigError, match="without Mamba"):
        KVSpec(2, 4, 1, 8, "int8", state_split=split.text())


def test_handshake_lets_tensor_parallelism_differ_for_a_state_it_can_slice_and_names_what_it_cannot() -> None:
    split = StateSplit("sd", 3, (64, 16, 16), 128)
    page = 4 * HEADS * 16

    def fp(ranks: int, text: str, rank: int = 0, block_size: int = 4) -> dict[str, int | str]:
        made = spec(split, rank, ranks, page)
        return fingerprint(dataclasses.replace(made, state_split=text, block_size=block_size))

    check_compatible(fp(1, split.text()), fp(2, split.text(), 1))
    check_compatible(fp(2, "", 1), fp(2, "", 1))  # equal tensor parallelism: the page moves whole
    with pytest.raises(LayoutMismatch, match="tp_size.*equal tensor parallelism only"):
        check_compatible(fp(1, ""), fp(2, ""))
    with pytest.raises(LayoutMismatch, match="state_split"):
        check_compatible(fp(1, split.text()), fp(2, ""))
    with pytest.raises(LayoutMismatch, match="equal block sizes only"):
        check_compatible(fp(1, split.text()), fp(1, split.text(), block_size=8))
    odd = StateSplit("ds", 3, (64, 16, 16), 100).text()  # 100 bytes do not split over 8 ranks
    with pytest.raises(LayoutMismatch, match="do not split over 8 ranks"):
        check_compatible(fp(1, odd), fp(8, odd))
    for hostile in (0, -1, 2**64, "2"):
        bad = {**fp(2, split.text()), "tp_size": hostile}
        with pytest.raises(LayoutMismatch, match="tp_size"):
            check_compatible(fp(1, split.text()), bad)


def test_the_split_and_the_shard_travel_in_the_layout_and_are_checked_there() -> None:
    from kvflow.layout import layout_from_wire, layout_to_wire

    split = StateSplit("ds", 3, (64, 16, 16), 128)
    made = spec(split, 1, 2, 4 * HEADS * 16)
    layout = KVLayout.single_region(made, 2, Region(0, 2 * made.page_bytes * 3))
    assert layout_from_wire(layout_to_wire(layout)) == layout
    wire = layout_to_wire(layout)
    for index, bad, words in (
        (14, "ds:3:64+16", "state split"),
        (14, "x" * 300, "at most"),
        (15, 2, "rank 2 of 2"),
        (16, 0, "rank 1 of 0"),
        (16, 2**64, "rank 1 of"),
        (15, "1", "integers"),
    ):
        with pytest.raises(ConfigError, match=words):
            layout_from_wire({**wire, "spec": [*wire["spec"][:index], bad, *wire["spec"][index + 1 :]]})


def test_the_connector_reads_the_split_from_the_shapes_vllm_s_own_layers_declare() -> None:
    """vLLM's shape calculator gives each rank's conv and temporal state; the split read from a
    rank's spec is the whole model's, the same for every tensor parallelism, with x, B, C
    (Mamba2), Q, K, V (gated delta net) or x (Mamba1) in their order and sizes."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Shapes
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as Kind
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvflow.integrations.vllm.kv_caches import state_split

    def read(
        shapes: tuple[tuple[int, ...], ...], kind: Kind, tp: int, dim_first: bool, replicated: bool = False
    ) -> str:
        conv = shapes[0] if not dim_first else shapes[0][::-1]  # the calculator orients as SD (the default)
        dtypes = (torch.bfloat16, torch.float32)
        spec = MambaSpec(
            block_size=16, shapes=(conv, *shapes[1:]), dtypes=dtypes, mamba_type=kind, tp_replicated=replicated
        )
        return state_split(spec, tp, dim_first)

    for dim_first in (False, True):
        orient = "ds" if dim_first else "sd"
        mamba2 = {
            read(Shapes.mamba2_state_shape(tp, 4096, 8, 64, 64, 128, 4), Kind.MAMBA2, tp, dim_first)
            for tp in (1, 2, 4, 8)
        }
        assert mamba2 == {f"{orient}:3:{4096 * 2}+{8 * 128 * 2}+{8 * 128 * 2}:{64 * 64 * 128 * 4}"}
        gdn = {
            read(Shapes.gated_delta_net_state_shape(tp, 16, 32, 128, 128, 4), Kind.GDN_ATTN, tp, dim_first)
            for tp in (1, 2, 4)
        }
        assert gdn == {f"{orient}:3:{2048 * 2}+{2048 * 2}+{4096 * 2}:{32 * 128 * 128 * 4}"}
        mamba1 = {read(Shapes.mamba1_state_shape(tp, 4096, 16, 4), Kind.MAMBA1, tp, dim_first) for tp in (1, 2)}
        assert mamba1 == {f"{orient}:3:{4096 * 2}:{4096 * 16 * 4}"}
    # one group shared by every head on one rank is replicated on more ranks: the split differs
    # by tensor parallelism, so the handshake names state_split
    one_group = [read(Shapes.mamba2_state_shape(tp, 4096, 1, 64, 64, 128, 4), Kind.MAMBA2, tp, False) for tp in (1, 2)]
    assert one_group[0] != one_group[1]
    # what cannot be sliced: a short convolution, a state every rank holds whole
    assert read(Shapes.short_conv_state_shape(2, 4096, 4) + ((1, 1),), Kind.SHORT_CONV, 2, False) == ""
    replicated = Shapes.mamba2_state_shape(2, 4096, 8, 64, 64, 128, 4)
    assert read(replicated, Kind.MAMBA2, 2, False, replicated=True) == ""
