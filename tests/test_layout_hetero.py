"""The planner between heterogeneous ranks (different tensor parallelism, block sizes that are
multiples), checked byte for byte against a token-by-token, head-by-head reference.

The reference computes every byte's address on each side from first principles (where a head's
token sits in a page of each layout) and walks the prompt token by token; the planner's
descriptors, expanded to bytes, must give the same mapping, coalesced or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.errors import InvalidBatch, LayoutMismatch
from kvflow.layout import KVLayout, KVSpec, Region, check_compatible, fingerprint, plan_transfer
from kvflow.layout.spec import heads_outer

KINDS = ("LBHNC", "LHBNC", "LBNHC")  # heads in one run per page; one array per head; tokens outside heads


def rank_heads(total: int, tp: int, rank: int) -> tuple[int, int]:
    """(first head, count) of a rank, as vLLM shards KV heads (replicated when tp > heads)."""
    return rank * total // tp, max(1, total // tp)


@dataclass(frozen=True)
class Side:
    kind: str
    tp: int
    rank: int
    block_size: int
    block_major: bool


def build(side: Side, total: int, token_bytes: int, layers: int, num_blocks: int, base: int) -> KVLayout:
    start, count = rank_heads(total, side.tp, side.rank)
    spec = KVSpec(
        num_layers=layers,
        block_size=side.block_size,
        num_kv_heads=count,
        head_dim=token_bytes,
        dtype="int8",
        kv_layout=side.kind,
        arrays_per_layer=count if side.kind == "LHBNC" else 1,
        head_dim_v=0,
        head_start=start,
        total_kv_heads=total,
    )
    size = num_blocks * spec.page_bytes * layers
    return KVLayout.single_region(spec, num_blocks, Region(base, size), block_major=side.block_major)


def address(layout: KVLayout, layer: int, head: int, token: int, byte: int, block: int) -> tuple[int, int]:
    """Where byte `byte` of head `head`'s token `token` of block `block` sits, by the layout's name."""
    spec = layout.spec
    local, size, width = head - spec.head_start, spec.block_size, spec.head_dim
    assert 0 <= local < spec.num_kv_heads
    if spec.kv_layout == "LHBNC":
        array, inner = layout.layer_arrays(layer)[local], token * width + byte
    elif spec.kv_layout == "LBHNC":
        array, inner = layout.layer_arrays(layer)[0], (local * size + token) * width + byte
    else:
        array, inner = layout.layer_arrays(layer)[0], (token * spec.num_kv_heads + local) * width + byte
    return array.region, array.offset + block * array.stride + inner


def reference(
    local: KVLayout, remote: KVLayout, lids: list[int], rids: list[int], layers: range, fine_start: int = 0
) -> dict[tuple[int, int], tuple[int, int]]:
    """Byte -> byte, token by token; the fine side's first block lands `fine_start` fine blocks
    into the coarse side's first block."""
    heads = range(
        max(local.spec.head_start, remote.spec.head_start), min(local.spec.heads.stop, remote.spec.heads.stop)
    )
    fine = min(local.spec.block_size, remote.spec.block_size)
    local_fine = local.spec.block_size == fine
    fine_ids = lids if local_fine else rids
    shift = fine_start * fine  # the coarse side's tokens before the first fine block's
    mapping = {}
    for token in range(len(fine_ids) * fine):
        lb, lt = divmod(token + (0 if local_fine else shift), local.spec.block_size)
        rb, rt = divmod(token + (shift if local_fine else 0), remote.spec.block_size)
        for layer in layers:
            for head in heads:
                for byte in range(local.spec.head_dim):
                    here = address(local, layer, head, lt, byte, lids[lb])
                    mapping[here] = address(remote, layer, head, rt, byte, rids[rb])
    return mapping


def expanded(plan: object) -> dict[tuple[int, int], tuple[int, int]]:
    mapping = {}
    for d in plan:  # type: ignore[attr-defined]
        for i in range(d.length):
            here = (d.local_region, d.local_offset + i)
            assert here not in mapping, "two descriptors write one byte"
            mapping[here] = (d.remote_region, d.remote_offset + i)
    return mapping


Case = tuple[KVLayout, KVLayout, list[int], list[int], range, int]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    total = draw(st.sampled_from([1, 2, 4]))
    kind = draw(st.sampled_from(KINDS))
    tps = draw(st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4])))
    if not heads_outer(kind):
        tps = (tps[0], tps[0])  # tokens outside heads: only equal head ranges are planned
    fine = draw(st.sampled_from([1, 2, 4]))
    ratio = draw(st.sampled_from([1, 2, 3]))
    local_fine = draw(st.booleans())
    sizes = (fine, fine * ratio) if local_fine else (fine * ratio, fine)
    ranks = [draw(st.integers(0, tp - 1)) for tp in tps]
    sides = [Side(kind, tp, rank, size, draw(st.booleans())) for tp, rank, size in zip(tps, ranks, sizes, strict=True)]
    lh, rh = (rank_heads(total, s.tp, s.rank) for s in sides)
    if max(lh[0], rh[0]) >= min(lh[0] + lh[1], rh[0] + rh[1]):  # no head in common: another draw
        sides[1] = Side(kind, tps[0], ranks[0], sizes[1], sides[1].block_major)
    token_bytes, layers, num_blocks = draw(st.sampled_from([1, 2])), draw(st.integers(1, 2)), 7
    local = build(sides[0], total, token_bytes, layers, num_blocks, 0x1000)
    remote = build(sides[1], total, token_bytes, layers, num_blocks, 0x9000)
    n_fine = draw(st.integers(1, 5))
    fine_start = draw(st.integers(0, ratio - 1))  # a chunk of P's may end inside a block of D's
    n_coarse = -(-(fine_start + n_fine) // ratio)
    fine_ids = draw(st.permutations(range(num_blocks)))[:n_fine]
    coarse_ids = draw(st.permutations(range(num_blocks)))[:n_coarse]
    lids, rids = (fine_ids, coarse_ids) if local_fine else (coarse_ids, fine_ids)
    first = draw(st.integers(0, layers - 1))
    return local, remote, list(lids), list(rids), range(first, draw(st.integers(first + 1, layers))), fine_start


@settings(max_examples=300, deadline=None)
@given(cases())
def test_the_planner_moves_the_bytes_the_reference_moves(case: Case) -> None:
    local, remote, lids, rids, layers, start = case
    want = reference(local, remote, lids, rids, layers, start)
    span = (layers.start, layers.stop)
    coalesced = plan_transfer(local, remote, lids, rids, span, fine_start=start)
    per_run = plan_transfer(local, remote, lids, rids, span, coalesce=False, fine_start=start)
    assert expanded(per_run) == want
    assert expanded(coalesced) == want
    assert len(coalesced) <= len(per_run) == coalesced.uncoalesced
    check_compatible(fingerprint(local.spec), fingerprint(remote.spec))


def test_a_one_to_two_split_moves_half_of_each_page_in_one_run() -> None:
    """TP 1 -> 2, LBHNC: D rank 1 receives heads 2 and 3 of P's four, which sit side by side
    in both pages: one (head, block, layer) run each before coalescing, one run per block and
    layer after (the other half of P's page lies between P's blocks)."""
    p = build(Side("LBHNC", 1, 0, 4, False), 4, 2, 2, 8, 0x1000)
    d = build(Side("LBHNC", 2, 1, 4, False), 4, 2, 2, 8, 0x9000)
    plan = plan_transfer(p, d, [0, 1, 2], [3, 4, 5])
    assert plan.total_bytes == 3 * 2 * 2 * 4 * 2  # blocks x layers x heads x tokens x bytes
    assert expanded(plan) == reference(p, d, [0, 1, 2], [3, 4, 5], range(2))
    assert plan.uncoalesced == 2 * 2 * 3 and len(plan) == 2 * 3


def test_what_cannot_be_sliced_is_refused_with_the_reason() -> None:
    nhd_p = build(Side("LBNHC", 1, 0, 4, False), 4, 2, 1, 4, 0x1000)
    nhd_d = build(Side("LBNHC", 2, 0, 4, False), 4, 2, 1, 4, 0x9000)
    with pytest.raises(LayoutMismatch, match="tokens outside heads") as caught:
        check_compatible(fingerprint(nhd_p.spec), fingerprint(nhd_d.spec))
    assert caught.value.field == "kv_layout" and "LBNHC" in str(caught.value)
    with pytest.raises(LayoutMismatch, match="kv_layout"):
        plan_transfer(nhd_p, nhd_d, [0], [0])
    p = build(Side("LBHNC", 1, 0, 4, False), 4, 2, 1, 4, 0x1000)
    d = build(Side("LBHNC", 1, 0, 6, False), 4, 2, 1, 4, 0x9000)
    with pytest.raises(LayoutMismatch, match="multiple") as caught:
        check_compatible(fingerprint(p.spec), fingerprint(d.spec))
    assert caught.value.field == "block_size"
    with pytest.raises(LayoutMismatch, match="block_size"):
        plan_transfer(p, d, [0], [0])
    wide = build(Side("LBHNC", 1, 0, 8, False), 4, 2, 1, 4, 0x9000)
    with pytest.raises(InvalidBatch, match="do not fill"):
        plan_transfer(p, wide, [0, 1, 2], [0])  # three 4-token blocks need two 8-token blocks
    far = build(Side("LBHNC", 4, 3, 4, False), 4, 2, 1, 4, 0x9000)
    near = build(Side("LBHNC", 4, 0, 4, False), 4, 2, 1, 4, 0x1000)
    with pytest.raises(InvalidBatch, match="share no KV head"):
        plan_transfer(near, far, [0], [0])
    with pytest.raises(InvalidBatch, match="fine_start"):
        plan_transfer(p, wide, [0, 1], [0], fine_start=2)  # a 4-token block sits at 0 or 1 of an 8-token one
    with pytest.raises(InvalidBatch, match="fine_start"):
        plan_transfer(p, p, [0], [1], fine_start=1)  # equal block sizes: no position inside


@pytest.mark.parametrize("kind", ["LBNHC", "LBHNC"])
def test_two_chunks_meeting_inside_a_coarse_block_fill_it_byte_for_byte(kind: str) -> None:
    """P's token budget ends a chunk inside one of D's blocks (twice P's): the first batch fills
    its first half, the next batch its second half from fine position 1, and together they
    write every byte of D's three blocks once, as one batch of the five P blocks would (in an
    HND page a P block's tokens lie strided inside D's, one run per head)."""
    p = build(Side(kind, 1, 0, 4, False), 2, 2, 2, 8, 0x1000)
    d = build(Side(kind, 1, 0, 8, False), 2, 2, 2, 8, 0x9000)
    first = expanded(plan_transfer(p, d, [0, 1, 2], [5, 6]))
    second = expanded(plan_transfer(p, d, [3, 4], [6, 7], fine_start=1))
    assert not set(first.values()) & set(second.values()), "a byte of D's written twice"
    assert {**first, **second} == reference(p, d, [0, 1, 2, 3, 4], [5, 6, 7], range(2))
