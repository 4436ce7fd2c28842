"""KV cache groups (vLLM's hybrid KV cache manager): the pure rules and the core's part.

A model's layers fall into groups, each a range of kvflow layers with a block table of its own;
a transfer moves one group's layers, and a sliding-window group only the block positions its
window keeps, by vLLM's own rule (checked here against vLLM's `SlidingWindowManager`).
"""

from __future__ import annotations

from types import SimpleNamespace

import hypothesis.strategies as st
import pytest
from hypothesis import given
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

from kvflow.errors import ConfigError, InvalidBatch, LayoutMismatch
from kvflow.integrations.vllm.settings import push_units
from kvflow.layout import KVLayout, KVSpec, Region, check_compatible, fingerprint, layout_from_wire, layout_to_wire
from kvflow.layout.groups import MAX_GROUPS, KVGroup, check_groups, group_of, groups_text, parse_groups
from kvflow.protocol.actions import Action, SendMessage, SubmitOp
from kvflow.protocol.core import TransferCore
from kvflow.protocol.messages import Message, Ready, TransferKey
from kvflow.protocol.requests import Expect, KvReady
from kvflow.protocol.state import Mode, Outcome, Role, State

KEY = TransferKey("t#g1", 1)
GROUPS = (KVGroup((0, 2), retained=63), KVGroup((2, 4)))  # Gemma-2-like: two sliding layers, two full


def sent(actions: list[Action]) -> list[Message]:
    return [a.message for a in actions if isinstance(a, SendMessage)]


def ops(actions: list[Action]) -> list[SubmitOp]:
    return [a for a in actions if isinstance(a, SubmitOp)]


def pair() -> tuple[TransferCore, TransferCore]:
    p, d = TransferCore("P", 4, groups=GROUPS), TransferCore("D", 4, groups=GROUPS)
    p.peer_connected("D", 0.0)
    d.peer_connected("P", 0.0)
    return p, d


# ---------------------------------------------------------------- the pure rules


def test_groups_travel_as_text_and_malformed_text_is_refused_naming_it() -> None:
    assert groups_text(GROUPS) == "sw63*2,full*2" and parse_groups("sw63*2,full*2", 4) == GROUPS
    assert groups_text((KVGroup((0, 4)),)) == "" and parse_groups("", 4) == (KVGroup((0, 4)),)
    assert parse_groups("sw63*4", 4) == (KVGroup((0, 4), 63),)  # every layer slides: one group, not ""
    for text, problem in (
        ("full*3", "hold 3 layers, the model has 4"),
        ("sw*2,full*2", "is not full*LAYERS"),
        ("full*0,full*4", "is not full*LAYERS"),
        ("full*2,,full*2", "is not full*LAYERS"),
        ("sw-1*2,full*2", "is not full*LAYERS"),
        (",".join(["full*1"] * (MAX_GROUPS + 1)), f"more than {MAX_GROUPS} groups"),
    ):
        with pytest.raises(ConfigError, match=problem.replace("*", r"\*")):
            parse_groups(text, 4)


def test_groups_must_cover_the_layers_in_order() -> None:
    assert check_groups((), 3) == (KVGroup((0, 3)),)
    for groups in ((KVGroup((0, 2)),), (KVGroup((1, 4)),), (KVGroup((0, 2)), KVGroup((1, 4))), (KVGroup((0, 0)),)):
        with pytest.raises(ConfigError, match="do not cover layers"):
            check_groups(groups, 4)
    assert group_of(GROUPS, (0, 2)) == GROUPS[0] and group_of(GROUPS, (3, 4)) == GROUPS[1]
    assert group_of(GROUPS, (1, 3)) is None and group_of(GROUPS, (4, 5)) is None


@given(st.integers(0, 100_000), st.integers(1, 8192), st.sampled_from([16, 32, 64, 128]), st.integers(0, 8))
def test_kept_from_is_vllms_own_rule(tokens: int, window: int, block_size: int, extra: int) -> None:
    """The first block a sliding-window group still holds after `tokens`: vLLM frees
    ``get_num_skipped_tokens(tokens) // block_size`` blocks (`remove_skipped_blocks`)."""
    manager = SimpleNamespace(sliding_window=window, extra_retained_tokens=extra)
    skipped = SlidingWindowManager.get_num_skipped_tokens(manager, tokens)  # type: ignore[arg-type]
    assert KVGroup((0, 1), window - 1 + extra).kept_from(tokens, block_size) == skipped // block_size
    assert KVGroup((0, 1)).kept_from(tokens, block_size) == 0  # full attention keeps every block


@given(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.randoms(use_true_random=False), st.integers(1, 6))
def test_push_units_cover_each_layer_once_each_within_one_group_in_forward_order(
    sizes: list[int], random: object, segments: int
) -> None:
    """However the groups' layers interleave in the forward, a push chunk's parts cover every
    layer once, each part one group's range, in the order the forward completes them."""
    groups, start = [], 0
    for size in sizes:
        groups.append(KVGroup((start, start + size)))
        start += size
    owners = [g for g, size in enumerate(sizes) for _ in range(size)]
    random.shuffle(owners)  # type: ignore[attr-defined]
    # the forward's order of kvflow layers: each group's in its own order (group-major numbering)
    taken = [group.layers[0] for group in groups]
    run_order = []
    for g in owners:
        run_order.append(taken[g])
        taken[g] += 1
    units = push_units(run_order, groups, segments)
    covered = sorted(layer for _, (a, b) in units for layer in range(a, b))
    assert covered == list(range(start))
    assert all(groups[g].layers[0] <= a < b <= groups[g].layers[1] for g, (a, b) in units)
    position = {layer: index for index, layer in enumerate(run_order)}
    done = [max(position[layer] for layer in range(a, b)) for _, (a, b) in units]
    assert done == sorted(done)


# ---------------------------------------------------------------- the layout and the handshake


def spec(groups: str = "sw63*2,full*2", block_size: int = 16) -> KVSpec:
    return KVSpec(num_layers=4, block_size=block_size, num_kv_heads=2, head_dim=8, kv_groups=groups)


def test_the_groups_travel_in_the_layout_and_the_fingerprint() -> None:
    layout = KVLayout.single_region(spec(), 8, Region(4096, 1 << 20))
    assert layout_from_wire(layout_to_wire(layout)).spec.groups == GROUPS
    wire = layout_to_wire(layout)
    for bad in ("sw63*3", "x" * 300, 7):
        with pytest.raises(ConfigError, match="kv_groups|kv groups|layers"):
            layout_from_wire({**wire, "spec": [*wire["spec"][:13], bad, *wire["spec"][14:]]})
    with pytest.raises(LayoutMismatch, match="kv_groups"):
        check_compatible(fingerprint(spec()), fingerprint(spec("full*4")))


def test_sliding_window_groups_need_one_block_size_on_both_sides() -> None:
    check_compatible(fingerprint(spec("full*4", 16)), fingerprint(spec("full*4", 32)))  # full attention: ok
    with pytest.raises(LayoutMismatch, match="sliding-window KV cache groups"):
        check_compatible(fingerprint(spec(block_size=16)), fingerprint(spec(block_size=32)))


# ---------------------------------------------------------------- the core


def test_a_transfer_moves_one_groups_layers_with_its_blocks() -> None:
    """D registers the full-attention group's blocks (layers 2..4); P's batches of that group's
    layers fill them, their WRITEs name those layers, and the transfer completes on that
    group's layers alone."""
    p, d = pair()
    (registration,) = sent(
        d.expect(
            Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[20, 21], expected_batches=2, layers=(2, 4)),
            now=0.0,
            deadline=9.0,
        )
    )
    p.receive("D", registration, 0.0)
    first = ops(p.kv_ready(KvReady(KEY, block_ids=[10, 11], layers=(2, 3), final=False), now=0.0, deadline=9.0))
    second = ops(p.kv_ready(KvReady(KEY, block_ids=[10, 11], layers=(3, 4)), now=0.0))
    assert [(op.local_blocks, op.remote_blocks, op.layers) for op in first + second] == [
        ((10, 11), (20, 21), (2, 3)),
        ((10, 11), (20, 21), (3, 4)),
    ]
    assert p.machine(KEY, Role.PREFILL).span == (2, 4) and p.machine(KEY, Role.PREFILL).outcome is None


def test_a_batch_must_stay_in_its_transfers_group() -> None:
    p, _ = pair()
    with pytest.raises(InvalidBatch, match="cross KV cache groups"):
        p.kv_ready(KvReady(KEY, block_ids=[10], layers=(1, 3)), now=0.0, deadline=9.0)
    with pytest.raises(InvalidBatch, match="cross KV cache groups"):
        p.kv_ready(KvReady(KEY, block_ids=[10]), now=0.0, deadline=9.0)  # every layer: both groups
    p.kv_ready(KvReady(KEY, block_ids=[10], layers=(2, 3), final=False), now=0.0, deadline=9.0)
    with pytest.raises(InvalidBatch, match="not in the transfer's KV cache group"):
        p.kv_ready(KvReady(KEY, block_ids=[10], layers=(0, 1)), now=0.0)
    assert len(p.machine(KEY, Role.PREFILL).batches) == 1  # nothing changed


def test_d_registers_one_groups_blocks_only() -> None:
    _, d = pair()
    with pytest.raises(InvalidBatch, match="cross KV cache groups"):
        d.expect(Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[20]), now=0.0, deadline=9.0)  # both groups
    with pytest.raises(InvalidBatch, match="whole KV cache groups"):
        d.expect(Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[20], layers=(2, 3)), now=0.0, deadline=9.0)
    assert d.machines() == []


def test_a_sliding_window_group_pushes_from_the_first_block_its_window_keeps() -> None:
    """P hands over the sliding group's blocks from position 7 (what its window keeps) and D
    registered positions 7..9: the WRITE covers exactly those, and nothing before them."""
    p, d = pair()
    (registration,) = sent(
        d.expect(
            Expect(
                KEY,
                peer="P",
                mode=Mode.PUSH,
                block_ids=[27, 28, 29],
                first_position=7,
                expected_batches=0,
                layers=(0, 2),
            ),
            now=0.0,
            deadline=9.0,
        )
    )
    p.receive("D", registration, 0.0)
    (op,) = ops(
        p.kv_ready(KvReady(KEY, block_ids=[17, 18, 19], first_position=7, layers=(0, 2)), now=0.0, deadline=9.0)
    )
    assert (op.local_blocks, op.remote_blocks, op.layers) == ((17, 18, 19), (27, 28, 29), (0, 2))


def test_pull_reads_a_sliding_window_from_the_first_block_p_holds() -> None:
    """P's Ready names where its blocks start (its window's first block); D reads the positions
    it registered; a Ready that starts after D's first position cannot fill D and fails it."""
    p, d = pair()
    d.expect(
        Expect(KEY, peer="P", mode=Mode.PULL, block_ids=[28, 29], first_position=8, layers=(0, 2)),
        now=0.0,
        deadline=9.0,
    )
    ready = sent(
        p.kv_ready(
            KvReady(KEY, block_ids=[17, 18, 19], first_position=7, layers=(0, 2), mode=Mode.PULL, peer="D"),
            now=0.0,
            deadline=9.0,
        )
    )
    assert ready == [Ready(KEY, (17, 18, 19), 7)]
    (op,) = ops(d.receive("P", ready[0], 0.1))
    assert (op.local_blocks, op.remote_blocks, op.layers) == ((28, 29), (18, 19), (0, 2))
    late = TransferKey("late#g0", 1)
    d.expect(
        Expect(late, peer="P", mode=Mode.PULL, block_ids=[26, 27], first_position=6, layers=(0, 2)),
        now=0.0,
        deadline=9.0,
    )
    d.receive("P", Ready(late, (17, 18, 19), 7), 0.1)
    m = d.machine(late, Role.DECODE)
    assert m.outcome is Outcome.FAILED and "D expects 6..8" in m.reason and m.state is not State.ALLOCATED


def test_a_state_groups_running_state_is_the_last_block_before_the_scratch_ones() -> None:
    """vLLM keeps a Mamba group's speculative scratch blocks after its running state, and in
    "align" mode earlier positions null: the state is the last entry before the scratch."""
    assert parse_groups("ssm*2,full*2", 4) == (KVGroup((0, 2), state=True), KVGroup((2, 4)))
    assert groups_text((KVGroup((0, 2), state=True, scratch=2), KVGroup((2, 4)))) == "ssm*2,full*2"
    assert KVGroup((0, 1), state=True).state_block([7]) == 7
    assert KVGroup((0, 1), state=True, scratch=2).state_block([None, 5, 8, 9]) == 5
    assert KVGroup((0, 1), state=True, scratch=2).state_block([6]) == 6  # no scratch allocated yet
    assert KVGroup((0, 1), state=True).state_block([5, None]) is None
    assert KVGroup((0, 1), state=True).state_block([]) is None


def test_mamba_state_moves_between_equal_block_sizes_and_without_a_split_equal_tensor_parallelism_only() -> None:
    mamba = spec("ssm*2,full*2")
    check_compatible(fingerprint(mamba), fingerprint(mamba))
    with pytest.raises(LayoutMismatch, match="block_size.*equal block sizes only"):
        check_compatible(fingerprint(mamba), fingerprint(spec("ssm*2,full*2", 32)))
    half = KVSpec(
        num_layers=4, block_size=16, num_kv_heads=1, head_dim=8, kv_groups="ssm*2,full*2", total_kv_heads=2, tp_size=2
    )
    with pytest.raises(LayoutMismatch, match="tp_size.*equal tensor parallelism only"):
        check_compatible(fingerprint(mamba), fingerprint(half))
