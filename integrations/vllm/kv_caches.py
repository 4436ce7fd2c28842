"""vLLM's KV caches as kvflow sees them: what vLLM allocates, and what kvflow refuses.

Why this module: vLLM 0.33 allocates one int8 buffer per `KVCacheTensor` and hands the connector
a strided view per layer (``[blocks, heads, tokens, K+V]`` in the layout the engine core
resolved), several layers possibly sharing a buffer, KV-sharing layers aliasing another layer's
view, and with some backends blocks split into kernel blocks.  `describe_kv_caches` reads the
views' strides and turns each layer into kvflow block arrays over the buffers, whatever the
layout, and names the layers in execution order (by the layer and attention-module indices in
their names, not the order of vLLM's dict).

With vLLM's hybrid KV cache manager a model's layers fall into KV cache groups (full attention,
sliding window, Mamba state), each with its own block table, and layers of different groups
overlay one another's memory (a block id belongs to one group at a time).  kvflow numbers layers
group by group (`cache_groups`), so that each group is a range of layers that moves with its own
blocks; a Mamba layer's page (its state, padded by vLLM to the attention page) moves whole
between ranks of equal tensor parallelism, and sliced by `state_split` (the conv state's
sub-projections and the temporal state, each sharded over the ranks) between unequal ones.

What kvflow cannot move is refused at start-up, in the connector's constructor, with an error
naming the feature (`check_supported`): caches that compress blocks (chunked local attention,
compressed caches), attention groups of different block sizes, pages of different sizes, a model
of Mamba layers only, pipeline and context parallelism.  A sliding-window model run with the
hybrid manager off keeps, and kvflow moves, the KV of every token (logged once at start-up).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvflow.errors import ConfigError
from kvflow.layout import BlockArray, KVLayout, KVSpec, MemoryType, Region
from kvflow.layout.groups import MAX_GROUPS, KVGroup, groups_text
from kvflow.layout.pages import StridedPages, page_runs
from kvflow.layout.states import StateSplit

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig

__all__ = (
    "CacheDescription",
    "cache_groups",
    "check_supported",
    "describe_kv_caches",
    "layer_position",
    "state_split",
)

log = logging.getLogger("kvflow.vllm")

_INTEGER = re.compile(r"^[0-9]+$")

# vLLM's `--kv-cache-dtype` names of one encoding: "fp8" is fp8_e4m3 (vLLM's CacheConfig says so,
# on CUDA and ROCm alike); an unquantized cache is stored in its own dtype, which the layout
# compares already, whether it was named or came from the model ("auto").
_SAME_ENCODING = {"fp8": "fp8_e4m3"}
_UNQUANTIZED = frozenset({"auto", "float16", "half", "bfloat16", "float32", "float"})


def cache_encoding(cache_dtype: str) -> str:
    """How a cache's values are encoded, whatever vLLM option string named it: "" where the
    storage dtype tells (unquantized), else the canonical name of the quantized encoding."""
    if cache_dtype in _UNQUANTIZED:
        return ""
    return _SAME_ENCODING.get(cache_dtype, cache_dtype)


def layer_position(name: str) -> tuple[int, int]:
    """Where a vLLM attention layer runs: its decoder layer and the attention module within it,
    from the integer parts of its name as vLLM's `extract_layer_index` reads them
    (``model.layers.7.self_attn.attn`` -> (7, 0); LongCat-Flash's two attention modules per
    layer, ``model.layers.7.self_attn.1.attn`` -> (7, 1)).  vLLM itself accepts a second
    integer only in a model with several attention modules per layer.

    :raises ConfigError: the name has no integer part, or more than two.
    """
    numbers = [int(part) for part in name.split(".") if _INTEGER.match(part)]
    if not 1 <= len(numbers) <= 2:
        raise ConfigError(
            f"cannot tell which layer KV cache {name!r} belongs to: it needs one integer part (the layer), "
            "or two (the layer and its attention module)"
        )
    return numbers[0], numbers[1] if len(numbers) == 2 else 0


def _kind(spec: Any) -> str:
    """The model feature a KV cache spec stands for, in words."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    kinds: list[tuple[type[Any], str]] = [
        (MLAAttentionSpec, "MLA attention"),
        (SlidingWindowSpec, "sliding-window attention"),
        (ChunkedLocalAttentionSpec, "chunked local attention"),
        (MambaSpec, "Mamba/linear-attention state"),
        (FullAttentionSpec, "full attention"),
    ]
    return next((words for cls, words in kinds if isinstance(spec, cls)), type(spec).__name__)


def _layer_specs(kv_cache_config: KVCacheConfig) -> dict[str, AttentionSpec]:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    specs: dict[str, Any] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            specs[name] = spec.kv_cache_specs.get(name, spec) if isinstance(spec, UniformTypeKVCacheSpecs) else spec
    return specs


def _owners(kv_cache_config: KVCacheConfig) -> set[str]:
    """The layers with KV of their own (KV-sharing layers attend over another's)."""
    return {name for tensor in kv_cache_config.kv_cache_tensors for name in tensor.layers}


def _retained(spec: Any) -> int | None:
    """How many tokens before the next one a group of `spec` keeps (None: every token)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    if not isinstance(spec, SlidingWindowSpec):
        return None  # with the hybrid manager off vLLM turns sliding windows into full attention
    return int(spec.sliding_window) - 1 + int(getattr(spec, "extra_retained_tokens", 0))


def cache_groups(kv_cache_config: KVCacheConfig) -> tuple[tuple[KVGroup, ...], list[str]]:
    """vLLM's KV cache groups as kvflow numbers layers (group by group, each group's layers in
    execution order), and those layers' names in that numbering."""
    from vllm.v1.kv_cache_interface import MambaSpec

    owners = _owners(kv_cache_config)
    groups: list[KVGroup] = []
    names: list[str] = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        mine = sorted((n for n in group.layer_names if n in owners), key=lambda n: (layer_position(n), n))
        layers = (len(names), len(names) + len(mine))
        if isinstance(spec, MambaSpec):
            groups.append(KVGroup(layers, state=True, scratch=int(spec.num_speculative_blocks)))
        else:
            groups.append(KVGroup(layers, _retained(spec)))
        names += mine
    return tuple(groups), names


def state_split(spec: Any, tp_size: int, dim_first: bool) -> str:
    """How a `MambaSpec`'s state page splits over `tp_size` ranks (`StateSplit.text`, summed over
    the ranks), read from its shapes as vLLM's own layers build them: the conv state
    ``(columns, rows)`` (`dim_first`, vLLM's "DS") or ``(rows, columns)``, whose columns are x
    (Mamba1), x, B, C (Mamba2: x is the temporal state's heads times head size, B and C equal)
    or Q, K, V (gated delta net: V is the temporal state's value heads times value size), then
    the temporal state, sharded by heads.  "" for a state it cannot slice: another kind of
    mixer, other than two states, or a state every rank holds whole."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as Kind

    shapes, dtypes = tuple(spec.shapes), tuple(spec.dtypes)
    if getattr(spec, "tp_replicated", False) or len(shapes) != 2 or len(shapes[0]) != 2 or len(shapes[1]) < 2:
        return ""
    columns, rows = (int(n) for n in (shapes[0] if dim_first else shapes[0][::-1]))
    heads, head_size = int(shapes[1][0]), int(shapes[1][1])
    kind = spec.mamba_type
    if kind == Kind.MAMBA1:
        parts: tuple[int, ...] = (columns,)
    elif kind in (Kind.MAMBA2, Kind.GDN_ATTN):
        rest = columns - heads * head_size  # B + C (Mamba2), Q + K (gated delta net)
        if rest <= 0 or rest % 2:
            return ""
        parts = (
            (heads * head_size, rest // 2, rest // 2)
            if kind == Kind.MAMBA2
            else (rest // 2, rest // 2, heads * head_size)
        )
    else:
        return ""
    conv_size, temporal_size = (int(dtype.itemsize) for dtype in dtypes)
    temporal = temporal_size * math.prod(int(n) for n in shapes[1])
    orientation = "ds" if dim_first else "sd"
    return StateSplit(orientation, rows, tuple(part * conv_size * tp_size for part in parts), temporal * tp_size).text()


def check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse, at start-up, what kvflow cannot move byte for byte; warn of what it moves in full.

    :raises ConfigError: naming the model feature or parallelism kvflow does not support.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    parallel = vllm_config.parallel_config
    for field, words in (
        ("pipeline_parallel_size", "pipeline parallelism"),
        ("decode_context_parallel_size", "decode context parallelism"),
        ("prefill_context_parallel_size", "prefill context parallelism"),
    ):
        if int(getattr(parallel, field, 1)) > 1:
            raise ConfigError(f"kvflow does not support {words} ({field}={getattr(parallel, field)})")
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return
    groups = kv_cache_config.kv_cache_groups
    if len(groups) > MAX_GROUPS:
        raise ConfigError(f"kvflow moves at most {MAX_GROUPS} KV cache groups; this model has {len(groups)}")
    attention = [g for g in groups if not isinstance(g.kv_cache_spec, MambaSpec)]  # a state block has no tokens
    sizes = {int(g.kv_cache_spec.block_size) for g in attention}
    if len(sizes) > 1:
        kinds = ", ".join(f"{_kind(g.kv_cache_spec)}: {g.kv_cache_spec.block_size}" for g in attention)
        raise ConfigError(f"kvflow needs one block size for every KV cache group; this model's are {kinds}")
    if not attention:
        raise ConfigError("kvflow moves Mamba / linear-attention state beside attention layers; this model has none")
    specs = _layer_specs(kv_cache_config)
    pages = {int(s.page_size_bytes) for s in specs.values()}
    for name, spec in list(specs.items()):
        if isinstance(spec, MambaSpec):
            if len(pages) > 1:  # vLLM pads a state page to the attention page
                raise ConfigError(f"kvflow needs one page size for every layer; this model's are {sorted(pages)} bytes")
            del specs[name]
            continue
        if type(spec) not in (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec):
            raise ConfigError(
                f"kvflow cannot move {_kind(spec)} KV caches (layer {name}: {type(spec).__name__}): "
                "their blocks are compressed or recurrent state, not one page per block of tokens"
            )
        if spec.tokens_per_state != 1:
            raise ConfigError(f"kvflow cannot move compressed KV caches (layer {name}: {spec.tokens_per_state} tokens)")
    shapes = {(s.page_size_bytes, s.num_heads, s.head_size, s.head_size_v, s.dtype) for s in specs.values()}
    if len(shapes) > 1:
        raise ConfigError(f"kvflow needs one KV page shape for every layer; this model's layers have {len(shapes)}")
    if len(groups) == 1 and any(getattr(s, "sliding_window", None) is not None for s in specs.values()):
        log.warning(
            "kvflow: %s layers are sliding-window layers, which keep (and kvflow moves) the KV of every token: "
            "vLLM's hybrid KV cache manager is off (with it on, only each window's blocks move)",
            _sliding_layers(vllm_config, len(specs)),
        )


def _sliding_layers(vllm_config: VllmConfig, layers: int) -> str:
    """How many of the model's layers use sliding-window attention, in words.  With the hybrid
    manager off vLLM merges every layer's spec into one that carries the window, so the specs
    cannot tell; the model's ``layer_types`` (Gemma 2/3, gpt-oss) can."""
    hf_config = getattr(vllm_config.model_config, "hf_text_config", None)
    types = getattr(hf_config, "layer_types", None)
    if not isinstance(types, (list, tuple)):
        return f"some of the {layers}"
    return f"{sum(kind == 'sliding_attention' for kind in types)} of the {len(types)}"


@dataclass(frozen=True)
class CacheDescription:
    """A rank's KV caches in kvflow's terms."""

    layout: KVLayout
    layer_of: dict[str, int]  # layer name -> kvflow layer, for the layers that own their KV
    run_order: tuple[int, ...] = ()  # kvflow layers in execution order (default: their own order)


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    kv_cache_config: KVCacheConfig,
    *,
    model: str,
    cache_dtype: str,
    layout_name: str | None,
    tp_size: int = 1,
) -> CacheDescription:
    """kvflow's layout for the per-layer views vLLM registers.

    Layers are numbered group by group, each group's in execution order (`cache_groups`); a
    layer whose KV is another's (KV sharing) is left out, as vLLM's allocation leaves it out of
    every `KVCacheTensor`.  Layers of different KV cache groups may overlay the same memory.
    A model with Mamba state carries how its state splits over the engine's `tp_size` ranks
    (`state_split`; none where its layers' states differ or cannot be sliced).

    :raises ConfigError: a view does not match vLLM's spec for its layer, two layers of one group
        start at the same address, a layer's pages overlap, or layers split their pages
        differently.
    """
    import torch

    specs = _layer_specs(kv_cache_config)
    groups, ordered = cache_groups(kv_cache_config)
    names = [n for n in ordered if n in kv_caches]
    if not names:
        raise ConfigError("no KV caches to register")
    if len(names) != len(ordered):
        missing = sorted(set(ordered) - set(names))[:4]
        raise ConfigError(f"vLLM registered no KV cache for layers {missing} of its KV cache config")
    group_of = {name: index for index, group in enumerate(groups) for name in ordered[slice(*group.layers)]}
    num_blocks = kv_cache_config.num_blocks
    regions: dict[int, Region] = {}
    arrays: list[BlockArray] = []
    runs_seen = set()
    starts: dict[tuple[int, int], str] = {}
    for layer, name in enumerate(names):
        tensor = kv_caches[name]
        start = (group_of[name], int(tensor.data_ptr()) if isinstance(tensor, torch.Tensor) else 0)
        if isinstance(tensor, torch.Tensor) and starts.setdefault(start, name) != name:
            raise ConfigError(f"layers {starts[start]} and {name} of one KV cache group share one KV cache")
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2 or int(tensor.shape[0]) % num_blocks:
            raise ConfigError(f"KV cache of {name} is not a tensor with a multiple of {num_blocks} blocks first")
        storage = tensor.untyped_storage()
        base = int(storage.data_ptr())
        memory = MemoryType.VRAM if tensor.device.type == "cuda" else MemoryType.DRAM
        device = int(tensor.device.index or 0) if memory is MemoryType.VRAM else 0
        regions.setdefault(base, Region(base, int(storage.nbytes()), memory, device))
        split = int(tensor.shape[0]) // num_blocks  # kernel blocks per block (vLLM may split blocks)
        shape = [split, *(int(n) for n in tensor.shape[1:])]
        strides = [int(s) for s in tensor.stride()]
        expected, element = specs[name].real_page_size_bytes, tensor.element_size()
        if groups[group_of[name]].state:  # a state page moves whole, with vLLM's padding to the attention page
            expected = specs[name].page_size_bytes
            if split != 1 or strides[0] * element != expected:
                raise ConfigError(f"{name}: state pages of {strides[0] * element} bytes, not {expected}")
            shape, strides, element = [1, expected], [expected, 1], 1
        runs = page_runs(shape, strides, element)
        if runs.page_bytes != expected:
            raise ConfigError(f"{name}: a {runs.page_bytes}-byte page, vLLM's spec says {expected} bytes")
        pages = StridedPages(
            list(regions).index(base), int(tensor.data_ptr()) - base, strides[0] * split * tensor.element_size(), runs
        )
        arrays += pages.block_arrays(layer, num_blocks)
        runs_seen.add((runs.run_bytes, len(runs.offsets)))
    if len(runs_seen) > 1:
        raise ConfigError(f"layers split their pages differently: {sorted(runs_seen)}")
    lead = next(n for n in names if not groups[group_of[n]].state)  # an attention layer: the KV's shape
    spec = specs[lead]
    (run_bytes, count) = runs_seen.pop()
    first = kv_caches[lead]
    kv_spec = KVSpec(
        num_layers=len(names),
        block_size=spec.block_size,
        num_kv_heads=spec.num_heads,
        head_dim=spec.head_size,
        dtype=str(first.dtype).removeprefix("torch."),
        kv_layout=layout_name or _inner_order(first),
        arrays_per_layer=count,
        head_dim_v=spec.head_size_v,
        page_bytes=run_bytes * count,
        model=model,
        cache_dtype=cache_encoding(cache_dtype),
        kv_groups=groups_text(groups),
        state_split=_model_split(specs, groups, ordered, tp_size),
    )
    layout = KVLayout(kv_spec, num_blocks, tuple(regions.values()), tuple(arrays))
    run_order = sorted(range(len(names)), key=lambda layer: (layer_position(names[layer]), names[layer]))
    return CacheDescription(layout, {name: layer for layer, name in enumerate(names)}, tuple(run_order))


def _model_split(specs: Mapping[str, Any], groups: tuple[KVGroup, ...], ordered: list[str], tp_size: int) -> str:
    """The one `state_split` of every state layer, or "" (none, or layers that differ)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    states = [name for group in groups if group.state for name in ordered[slice(*group.layers)]]
    dim_first = is_conv_state_dim_first()
    splits = {state_split(specs[name], tp_size, dim_first) for name in states}
    return splits.pop() if len(splits) == 1 else ""


def _inner_order(view: torch.Tensor) -> str:
    """A page's inner order read from a ``[blocks, heads, tokens, content]`` view's strides,
    for caches registered without a vLLM layout name."""
    if view.dim() != 4:
        return f"strided-{view.dim()}d"
    return "HNC" if view.stride(1) >= view.stride(2) else "NHC"
