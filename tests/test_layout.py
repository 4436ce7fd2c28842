"""Descriptor planning moves exactly the right bytes, and coalescing only merges true runs."""

from __future__ import annotations

from dataclasses import replace

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from kvflow.errors import ConfigError, InvalidBatch, LayoutMismatch
from kvflow.layout import (
    FINGERPRINT_FIELDS,
    BlockArray,
    DescriptorPlan,
    KVLayout,
    KVSpec,
    Region,
    check_compatible,
    fingerprint,
    layout_from_wire,
    layout_to_wire,
    plan_transfer,
)

SPEC = KVSpec(num_layers=3, block_size=2, num_kv_heads=1, head_dim=4, dtype="float16")  # 16-byte blocks


def make_layout(kind: str, num_blocks: int, spec: KVSpec = SPEC) -> KVLayout:
    block = spec.block_len
    if kind == "per-layer":
        size = num_blocks * block * spec.arrays_per_layer
        return KVLayout.per_layer_regions(
            spec, num_blocks, [Region(0x1000 * (i + 1), size) for i in range(spec.num_layers)]
        )
    size = num_blocks * block * spec.arrays_per_layer * spec.num_layers
    return KVLayout.single_region(spec, num_blocks, Region(0x100000, size), block_major=kind == "block-major")


def memories(layout: KVLayout, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, layout.required_bytes(i), dtype=np.uint8) for i in range(len(layout.regions))]


def apply_plan(plan: DescriptorPlan, src: list[np.ndarray], dst: list[np.ndarray]) -> None:
    for d in plan:
        dst[d.remote_region][d.remote_offset : d.remote_offset + d.length] = src[d.local_region][
            d.local_offset : d.local_offset + d.length
        ]


def apply_naive(
    local: KVLayout,
    remote: KVLayout,
    lids: list[int],
    rids: list[int],
    layers: range,
    src: list[np.ndarray],
    dst: list[np.ndarray],
) -> None:
    for layer in layers:
        for la, ra in zip(local.layer_arrays(layer), remote.layer_arrays(layer), strict=True):
            for lb, rb in zip(lids, rids, strict=True):
                s = la.offset + lb * la.stride
                t = ra.offset + rb * ra.stride
                dst[ra.region][t : t + local.block_len] = src[la.region][s : s + local.block_len]


kinds = st.sampled_from(["per-layer", "layer-major", "block-major"])


@settings(max_examples=200)
@given(
    local_kind=kinds,
    remote_kind=kinds,
    data=st.data(),
)
def test_plan_moves_the_same_bytes_as_block_by_block_copies(
    local_kind: str, remote_kind: str, data: st.DataObject
) -> None:
    local, remote = make_layout(local_kind, 12), make_layout(remote_kind, 10)
    n = data.draw(st.integers(1, 10))
    lids = data.draw(st.lists(st.integers(0, 11), min_size=n, max_size=n))
    rids = data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n, unique=True))
    first = data.draw(st.integers(0, SPEC.num_layers - 1))
    stop = data.draw(st.integers(first + 1, SPEC.num_layers))
    src = memories(local, 1)
    expected, got = memories(remote, 2), memories(remote, 2)
    apply_naive(local, remote, lids, rids, range(first, stop), src, expected)
    plan = plan_transfer(local, remote, lids, rids, (first, stop))
    apply_plan(plan, src, got)
    for e, g in zip(expected, got, strict=True):
        assert np.array_equal(e, g)
    assert plan.total_bytes == n * (stop - first) * SPEC.arrays_per_layer * SPEC.block_len
    assert len(plan) <= plan.uncoalesced == n * (stop - first) * SPEC.arrays_per_layer
    uncoalesced = plan_transfer(local, remote, lids, rids, (first, stop), coalesce=False)
    assert len(uncoalesced) == plan.uncoalesced


@pytest.mark.parametrize(
    ("kind", "descriptors"),
    [("per-layer", 3 * 2), ("layer-major", 3 * 2), ("block-major", 1)],
)
def test_contiguous_blocks_coalesce_to_one_run_per_contiguous_array(kind: str, descriptors: int) -> None:
    layout = make_layout(kind, 16)
    plan = plan_transfer(layout, layout, range(4, 12), range(2, 10))
    assert len(plan) == descriptors
    assert plan.uncoalesced == 8 * 3 * 2


def test_mostly_contiguous_blocks_break_runs_only_where_either_side_jumps() -> None:
    layout = make_layout("per-layer", 32)
    local = [0, 1, 2, 3, 10, 11, 12, 20]
    remote = [5, 6, 7, 8, 9, 10, 11, 30]  # contiguous where local jumps at 10
    plan = plan_transfer(layout, layout, local, remote, (0, 1))
    # runs: [0..3]->[5..8], [10..12]->[9..11], [20]->[30], for each of the 2 arrays of layer 0
    assert len(plan) == 3 * 2
    assert sorted(plan.length.tolist()) == sorted([4 * 16, 3 * 16, 16] * 2)


def test_bad_plans_are_refused() -> None:
    layout = make_layout("per-layer", 4)
    with pytest.raises(InvalidBatch, match="out of range"):
        plan_transfer(layout, layout, [4], [0])
    with pytest.raises(InvalidBatch, match="equal, non-empty"):
        plan_transfer(layout, layout, [0, 1], [0])
    with pytest.raises(InvalidBatch, match="layers"):
        plan_transfer(layout, layout, [0], [0], (2, 9))
    other = make_layout("per-layer", 4, KVSpec(num_layers=3, block_size=2, num_kv_heads=1, head_dim=8, dtype="float16"))
    with pytest.raises(LayoutMismatch, match="block_len"):
        plan_transfer(layout, other, [0], [0])


def test_fingerprint_names_the_first_field_that_differs() -> None:
    a = fingerprint(SPEC)
    assert tuple(a) == FINGERPRINT_FIELDS
    check_compatible(a, fingerprint(SPEC))
    b = fingerprint(KVSpec(num_layers=3, block_size=2, num_kv_heads=1, head_dim=4, dtype="bfloat16"))
    with pytest.raises(LayoutMismatch, match="dtype") as caught:
        check_compatible(a, b)
    assert caught.value.field == "dtype"
    c = fingerprint(KVSpec(num_layers=4, block_size=4, num_kv_heads=1, head_dim=4, dtype="float16"))
    with pytest.raises(LayoutMismatch, match="num_layers"):
        check_compatible(a, c)
    with pytest.raises(LayoutMismatch, match="kv_layout"):
        check_compatible(a, {k: v for k, v in a.items() if k != "kv_layout"})


def test_the_fingerprint_names_what_a_byte_copy_needs_model_first() -> None:
    """Two engines serving other models, or encoding fp8 differently in the same uint8 pages,
    must not exchange KV even when every size agrees."""
    mla = KVSpec(2, 16, 1, 576, "uint8", "LBNHC", arrays_per_layer=1, head_dim_v=0, model="m", cache_dtype="fp8_e4m3")
    assert mla.page_bytes == 16 * 576 and mla.block_len == mla.page_bytes  # MLA: no V
    for field, other in [
        ("model", replace(mla, model="n")),
        ("cache_dtype", replace(mla, cache_dtype="fp8_e5m2")),
        ("kv_layout", replace(mla, kv_layout="LBHNC")),
        ("head_dim_v", replace(mla, head_dim_v=None, arrays_per_layer=2, page_bytes=0)),
    ]:
        with pytest.raises(LayoutMismatch) as caught:
            check_compatible(fingerprint(mla), fingerprint(other))
        assert caught.value.field == field
    different = replace(mla, model="n", num_layers=3)
    with pytest.raises(LayoutMismatch, match="model"):
        check_compatible(fingerprint(mla), fingerprint(different))


def test_a_page_splits_into_any_number_of_equal_arrays_and_round_trips_the_wire() -> None:
    spec = KVSpec(num_layers=2, block_size=4, num_kv_heads=4, head_dim=8, dtype="float16", arrays_per_layer=4)
    assert spec.page_bytes == 4 * 4 * 16 * 2 and spec.block_len == spec.page_bytes // 4
    layout = KVLayout.per_layer_regions(spec, 3, [Region(4096, 4 * 3 * spec.block_len), Region(8192, 4096)])
    assert layout_from_wire(layout_to_wire(layout)) == layout
    with pytest.raises(ConfigError, match="equal arrays"):
        KVSpec(num_layers=1, block_size=4, num_kv_heads=1, head_dim=3, dtype="int8", arrays_per_layer=5)
    with pytest.raises(ConfigError, match="at most"):
        long_model = [*layout_to_wire(layout)["spec"][:9], "m" * 300, "", 0, 0, "", "", 0, 1]
        layout_from_wire({**layout_to_wire(layout), "spec": long_model})


def test_invalid_layouts_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        KVSpec(num_layers=1, block_size=1, num_kv_heads=1, head_dim=1, dtype="float13")
    with pytest.raises(ConfigError, match="past its region"):
        KVLayout(SPEC, 4, (Region(0, 10),), tuple(BlockArray(0, 0, 16, layer) for layer in range(3) for _ in range(2)))
    with pytest.raises(ConfigError, match="layer 2 has 0 block arrays"):
        KVLayout(
            SPEC, 1, (Region(0, 1024),), tuple(BlockArray(0, 0, 16, layer) for layer in range(2) for _ in range(2))
        )
    with pytest.raises(ConfigError, match="stride"):
        KVLayout(SPEC, 2, (Region(0, 1024),), tuple(BlockArray(0, 0, 8, layer) for layer in range(3) for _ in range(2)))
    with pytest.raises(ConfigError, match="one region per layer"):
        KVLayout.per_layer_regions(SPEC, 4, [Region(0, 1024)])
