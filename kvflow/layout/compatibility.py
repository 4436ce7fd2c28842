"""Layout compatibility: the fingerprint two peers compare, and whether their caches can exchange blocks.

Why this module: a layout says where one side's bytes live; whether two sides may move blocks to
each other is a separate question, asked once per association in the handshake and never by the
planner.  `fingerprint` reduces a `KVSpec` to plain fields (the model's, the rank's, a state
page's shard), and `check_compatible` compares two of them and names the first field that
differs, before any byte moves: ranks of different tensor parallelism (different KV heads) and
block sizes that are multiples of each other are allowed where a planner can map them, and a
Mamba / linear-attention state page only where it can be sliced.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvflow.errors import LayoutMismatch
from kvflow.layout.groups import parse_groups
from kvflow.layout.spec import LAYOUT_FORMAT, MAX_RANKS, KVSpec, heads_outer
from kvflow.layout.states import parse_split

__all__ = (
    "FINGERPRINT_FIELDS",
    "check_compatible",
    "fingerprint",
)


MODEL_FIELDS = (  # equal on both sides, always
    "format",
    "model",
    "num_layers",
    "total_kv_heads",
    "head_dim",
    "head_dim_v",
    "dtype",
    "cache_dtype",
    "kv_layout",
    "kv_groups",
    "state_split",
)
RANK_FIELDS = (  # equal unless the ranks hold different heads or the block sizes differ
    "num_kv_heads",
    "head_start",
    "block_size",
    "page_bytes",
    "arrays_per_layer",
    "block_len",
)
SHARD_FIELDS = ("tp_rank", "tp_size")  # a state page's shard: compared for models with Mamba state
FINGERPRINT_FIELDS = MODEL_FIELDS + RANK_FIELDS + SHARD_FIELDS


def fingerprint(spec: KVSpec) -> dict[str, int | str]:
    """What two peers compare before transferring: the model's fields, and the rank's (its heads
    and block size), which `check_compatible` lets differ where a planner can map them."""
    fields: dict[str, int | str] = {"format": LAYOUT_FORMAT, "head_dim_v": spec.value_dim}
    for name in FINGERPRINT_FIELDS:
        if name not in fields:
            value = getattr(spec, name)
            assert isinstance(value, int | str)
            fields[name] = value
    return {name: fields[name] for name in FINGERPRINT_FIELDS}


def _overlap(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    """Whether two (first head, count) ranges share a head (malformed ones: assumed so)."""
    if not all(type(n) is int for n in (*a, *b)):
        return True
    return bool(max(a[0], b[0]) < min(a[0] + a[1], b[0] + b[1]))


def _kinds(fingerprint: Mapping[str, Any]) -> tuple[bool, bool]:
    """Whether a (well-formed, local) fingerprint's model has a sliding-window KV cache group,
    and whether it has a Mamba / linear-attention state group."""
    groups = parse_groups(str(fingerprint.get("kv_groups", "")), int(fingerprint.get("num_layers", 0)))
    return any(group.sliding for group in groups), any(group.state for group in groups)


def check_compatible(local: Mapping[str, Any], remote: Mapping[str, Any]) -> None:
    """Compare two fingerprints: the model's fields (`MODEL_FIELDS`, its KV cache groups among
    them) must be equal; the ranks may hold different KV heads (different tensor parallelism)
    when they share none (they then move nothing to each other, but may still associate: a rank
    0 tells its peers where its other ranks are) or when the layout keeps a head's tokens
    together, and their block sizes may differ when one is a multiple of the other and no group
    is a sliding window's; otherwise the rank's fields (`RANK_FIELDS`) must be equal too.

    :raises LayoutMismatch: naming the first field that differs or is missing, and why it may not.
    """
    for name in MODEL_FIELDS:
        if local.get(name) != remote.get(name):
            raise LayoutMismatch(name, local.get(name), remote.get(name))
    sizes = (local.get("block_size"), remote.get("block_size"))
    if not all(type(size) is int and size > 0 for size in sizes):
        raise LayoutMismatch("block_size", *sizes)
    small, large = sorted(int(size) for size in sizes if size is not None)
    if large % small:
        raise LayoutMismatch("block_size", *sizes, detail="one side's block size must be a multiple of the other's")
    slides, states = _kinds(local)
    heads = [(fp.get("head_start"), fp.get("num_kv_heads")) for fp in (local, remote)]
    if states:
        _check_states(local, remote, small != large)
    if small != large and slides:
        raise LayoutMismatch(
            "block_size",
            *sizes,
            detail="sliding-window KV cache groups (vLLM's hybrid KV cache manager) need one block size on both "
            "sides: each side keeps the blocks of its own window, which differ when the sizes do",
        )
    layout = str(local.get("kv_layout"))
    if heads[0] != heads[1] and _overlap(*heads) and not heads_outer(layout):
        raise LayoutMismatch(
            "kv_layout",
            layout,
            remote.get("kv_layout"),
            detail=f"the ranks hold different KV heads (start, count: {heads[0]} here, {heads[1]} there) and "
            f"layout {layout} keeps tokens outside heads, so a head's KV is not one run of bytes; "
            "use equal tensor parallelism or a heads-outside-tokens layout (HND: LBHNC, BLHNC, LHBNC, BHLNC)",
        )
    if heads[0] == heads[1] and sizes[0] == sizes[1]:
        for name in RANK_FIELDS:
            if local.get(name) != remote.get(name):
                raise LayoutMismatch(name, local.get(name), remote.get(name))


def _check_states(local: Mapping[str, Any], remote: Mapping[str, Any], sizes_differ: bool) -> None:
    """A model with Mamba / linear-attention state: equal block sizes, and a state page that can
    be sliced where the tensor parallelism differs.

    :raises LayoutMismatch: naming the field, and why.
    """
    if sizes_differ:
        raise LayoutMismatch(
            "block_size",
            local.get("block_size"),
            remote.get("block_size"),
            detail="Mamba / linear-attention state moves between equal block sizes only (vLLM raises each side's "
            "attention block size until a page holds that rank's state, so sides of different tensor parallelism "
            "may differ: give both the same --block-size, at least the larger of the two)",
        )
    sizes = (local.get("tp_size"), remote.get("tp_size"))
    checked = [size for size in sizes if type(size) is int and 0 < size <= MAX_RANKS]
    if len(checked) != 2:
        raise LayoutMismatch("tp_size", *sizes)
    if sizes[0] == sizes[1]:
        return  # rank r to rank r: a state page moves whole
    split = parse_split(str(local.get("state_split", "")))
    if split is None:
        raise LayoutMismatch(
            "tp_size",
            *sizes,
            detail="this model's Mamba / linear-attention state moves between equal tensor parallelism only: "
            "kvflow slices the conv and temporal state of Mamba1, Mamba2 and gated delta net layers, not "
            "replicated across ranks and of two states each",
        )
    for size in checked:
        split.rank_bytes(size)
