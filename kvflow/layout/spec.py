"""KV-cache layout: where each logical block's bytes live.

Why this module: the transfer engine moves *logical block ids*; transports move *byte ranges*.
A layout is a set of registered memory regions and, per layer, one or more block arrays (for
example vLLM's FlashAttention cache keeps K and V as two arrays per layer).  Block `b` of an array
occupies `[offset + b * stride, + block_len)` of its region.  `kvflow.layout.plan` turns block ids
into byte ranges.

`layout_to_wire` / `layout_from_wire` carry a layout through the handshake;
`kvflow.layout.compatibility` reduces its spec to the fingerprint two peers compare.

Heterogeneous peers: a rank holds KV heads ``[head_start, head_start + num_kv_heads)`` of the
model's ``total_kv_heads`` (tensor parallelism splits them; vLLM replicates a head on several
ranks when there are more ranks than heads), and the two sides' block sizes may differ by an
integer factor.  `kvflow.layout.compatibility` allows both, as long as the layout keeps a head's
tokens together (`heads_outer`), which is what lets `kvflow.layout.plan` slice heads out of pages.
A layout also names its engine's ranks (`KVLayout.ranks`): the handshake tells a peer where the
owner's other ranks are, so nobody derives them from port numbers.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.errors import ConfigError
from kvflow.layout.groups import KVGroup, parse_groups
from kvflow.layout.states import parse_split

__all__ = (
    "DTYPE_SIZES",
    "MAX_SPEC_TEXT",
    "BlockArray",
    "KVLayout",
    "KVSpec",
    "MemoryType",
    "Region",
    "heads_outer",
    "layout_from_wire",
    "layout_to_wire",
)

LAYOUT_FORMAT = 4  # 3: a rank's head range and its engine's ranks; 4: KV cache groups
MAX_SPEC_TEXT = 256  # characters of a spec's text fields (a model's name or path)
MAX_RANKS = 1024  # tensor-parallel ranks one layout may name

DTYPE_SIZES: Mapping[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class MemoryType(enum.Enum):
    DRAM = "DRAM"  # host memory: numpy arrays, CPU tensors, POSIX shared memory
    VRAM = "VRAM"  # device memory: CUDA tensors (GPUDirect), Neuron HBM through LIBFABRIC


@dataclass(frozen=True, slots=True)
class Region:
    """A registered span of memory: base address, length, memory type and device id."""

    base: int
    length: int
    memory: MemoryType = MemoryType.DRAM
    device_id: int = 0

    def __post_init__(self) -> None:
        if self.base < 0 or self.length <= 0 or self.device_id < 0:
            raise ConfigError(f"region needs base >= 0, length > 0, device_id >= 0, got {self}")


@dataclass(frozen=True, slots=True)
class BlockArray:
    """One layer's blocks inside one region: the layout's `num_blocks` blocks of `block_len`
    bytes, block `b` at ``offset + b * stride``."""

    region: int
    offset: int
    stride: int
    layer: int


@dataclass(frozen=True, slots=True)
class KVSpec:
    """What one block of one layer holds, and who may exchange it; both peers must agree on it.

    A layer's page for one block holds ``block_size`` tokens of ``num_kv_heads`` heads (those of
    this rank), each a K vector of ``head_dim`` values and a V vector of ``head_dim_v`` values (0
    for MLA's single latent vector).  ``page_bytes`` is derived from those unless given (packed
    or quantized caches).  The page is split into ``arrays_per_layer`` equal block arrays (2: K
    and V kept apart; 1: one run of bytes per page; H: one run per head, when a layout keeps
    heads outside blocks).
    """

    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int  # heads this rank holds
    head_dim: int
    dtype: str = "bfloat16"  # the storage type of the cache
    kv_layout: str = "NHD"  # the order of the bytes inside a page (vLLM: its KVCacheLayout name)
    arrays_per_layer: int = 2
    head_dim_v: int | None = None  # None: head_dim; 0: no V (MLA's latent cache)
    page_bytes: int = 0  # 0: derived from the fields above
    model: str = ""  # the model's identity: the same weights on both sides
    cache_dtype: str = ""  # how values are encoded when dtype does not tell (vLLM keeps fp8 caches as uint8)
    head_start: int = 0  # the first of the model's KV heads this rank holds
    total_kv_heads: int = 0  # the model's KV heads (all ranks together); 0: num_kv_heads
    # the layers' KV cache groups (`kvflow.layout.groups`): "" for one group of full attention
    kv_groups: str = ""
    # how a Mamba / linear-attention state page splits over tensor-parallel ranks
    # (`kvflow.layout.states`): "" where it cannot be sliced (moved between equal TP only)
    state_split: str = ""
    tp_rank: int = 0  # this rank's shard of a state page: rank `tp_rank` of `tp_size`
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "arrays_per_layer"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"kv spec field {name} must be > 0, got {getattr(self, name)}")
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError(f"kv spec dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if self.total_kv_heads == 0:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        if not 0 <= self.head_start <= self.head_start + self.num_kv_heads <= self.total_kv_heads:
            raise ConfigError(
                f"kv spec heads [{self.head_start}, {self.head_start + self.num_kv_heads}) are not within the "
                f"model's {self.total_kv_heads} KV heads"
            )
        if self.value_dim < 0 or self.page_bytes < 0:
            raise ConfigError(f"kv spec head_dim_v and page_bytes must be >= 0, got {self}")
        if self.page_bytes == 0:
            per_token = self.num_kv_heads * (self.head_dim + self.value_dim) * DTYPE_SIZES[self.dtype]
            object.__setattr__(self, "page_bytes", self.block_size * per_token)
        if self.page_bytes % self.arrays_per_layer:
            raise ConfigError(
                f"kv spec page of {self.page_bytes} bytes does not split into {self.arrays_per_layer} equal arrays"
            )
        if len(self.kv_groups) > MAX_SPEC_TEXT:
            raise ConfigError(f"kv spec kv_groups is longer than {MAX_SPEC_TEXT} characters")
        groups = parse_groups(self.kv_groups, self.num_layers)
        if len(self.state_split) > MAX_SPEC_TEXT:
            raise ConfigError(f"kv spec state_split is longer than {MAX_SPEC_TEXT} characters")
        if parse_split(self.state_split) is not None and not any(group.state for group in groups):
            raise ConfigError("kv spec state_split given for a model without Mamba / linear-attention state groups")
        if not 0 <= self.tp_rank < self.tp_size <= MAX_RANKS:
            raise ConfigError(f"kv spec tensor-parallel rank {self.tp_rank} of {self.tp_size} does not exist")

    @property
    def value_dim(self) -> int:
        """V's head size (``head_dim_v`` once resolved)."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def block_len(self) -> int:
        """Bytes of one block in one array."""
        return self.page_bytes // self.arrays_per_layer

    @property
    def heads(self) -> range:
        """The model's KV heads this rank holds."""
        return range(self.head_start, self.head_start + self.num_kv_heads)

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        """The layers' KV cache groups, each a range of layers (one group of every layer for a
        model without vLLM's hybrid KV cache manager)."""
        return parse_groups(self.kv_groups, self.num_layers)


def heads_outer(kv_layout: str) -> bool:
    """Whether a layout named `kv_layout` keeps each head's tokens together inside a page (heads
    outside tokens: HND, vLLM's LBHNC, BLHNC, LHBNC, BHLNC), so that a head's KV for a run of
    tokens is one run of bytes.  NHD-style names (tokens outside heads) and unknown ones: False."""
    head, token = kv_layout.find("H"), kv_layout.find("N")
    return 0 <= head < token


@dataclass(frozen=True)
class KVLayout:
    """Where a KV cache lives: regions plus, per layer, `arrays_per_layer` block arrays.

    `ranks`: the (engine id, control address) of every tensor-parallel rank of the engine that
    owns this cache, in rank order, and `rank` this one's index (empty: one rank, or unknown);
    a peer learns from it which ranks exist and where, instead of assuming its own numbering."""

    spec: KVSpec
    num_blocks: int
    regions: tuple[Region, ...]
    arrays: tuple[BlockArray, ...]
    rank: int = 0
    ranks: tuple[tuple[str, str], ...] = ()
    _by_layer: tuple[tuple[BlockArray, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        spec = self.spec
        if self.num_blocks <= 0:
            raise ConfigError(f"layout num_blocks must be > 0, got {self.num_blocks}")
        if not 0 <= self.rank < max(1, len(self.ranks)):
            raise ConfigError(f"layout rank {self.rank} is not one of its {len(self.ranks)} ranks")
        by_layer: list[list[BlockArray]] = [[] for _ in range(spec.num_layers)]
        for array in self.arrays:
            if not 0 <= array.layer < spec.num_layers:
                raise ConfigError(f"block array {array} names layer outside 0..{spec.num_layers - 1}")
            if not 0 <= array.region < len(self.regions):
                raise ConfigError(f"block array {array} names region outside 0..{len(self.regions) - 1}")
            if array.stride < spec.block_len or array.offset < 0:
                raise ConfigError(f"block array {array} has stride < block_len {spec.block_len} or offset < 0")
            end = array.offset + (self.num_blocks - 1) * array.stride + spec.block_len
            if end > self.regions[array.region].length:
                raise ConfigError(
                    f"block array {array} ends at byte {end}, past its region of "
                    f"{self.regions[array.region].length} bytes"
                )
            by_layer[array.layer].append(array)
        for layer, arrays in enumerate(by_layer):
            if len(arrays) != spec.arrays_per_layer:
                raise ConfigError(f"layer {layer} has {len(arrays)} block arrays, spec says {spec.arrays_per_layer}")
        object.__setattr__(self, "_by_layer", tuple(tuple(a) for a in by_layer))

    @property
    def block_len(self) -> int:
        return self.spec.block_len

    def layer_arrays(self, layer: int) -> tuple[BlockArray, ...]:
        return self._by_layer[layer]

    def bytes_of(self, blocks: int, layers: tuple[int, int] | None = None) -> int:
        """The bytes `blocks` blocks take in every array of `layers` (None: all).  Never raises."""
        first, stop = layers or (0, self.spec.num_layers)
        return blocks * max(stop - first, 0) * self.spec.arrays_per_layer * self.block_len

    @classmethod
    def per_layer_regions(cls, spec: KVSpec, num_blocks: int, regions: Sequence[Region]) -> KVLayout:
        """One region per layer, each holding all K blocks then all V blocks (vLLM's
        FlashAttention shape ``(2, num_blocks, block_size, heads, head_dim)``), or joint blocks
        when `arrays_per_layer` is 1.

        :raises ConfigError: wrong number of regions, or a region too small.
        """
        if len(regions) != spec.num_layers:
            raise ConfigError(f"need one region per layer ({spec.num_layers}), got {len(regions)}")
        span = num_blocks * spec.block_len
        arrays = tuple(
            BlockArray(region=layer, offset=k * span, stride=spec.block_len, layer=layer)
            for layer in range(spec.num_layers)
            for k in range(spec.arrays_per_layer)
        )
        return cls(spec, num_blocks, tuple(regions), arrays)

    @classmethod
    def single_region(cls, spec: KVSpec, num_blocks: int, region: Region, *, block_major: bool = False) -> KVLayout:
        """Every layer in one region.

        Layer-major (default): layer 0's arrays, then layer 1's, ...  Block-major: all arrays of
        block 0 side by side, then block 1, ... (the HND-style cross-layer layout in which one
        block of every layer is one contiguous run).

        :raises ConfigError: the region is too small for the layout.
        """
        n_arrays = spec.num_layers * spec.arrays_per_layer
        arrays = []
        for layer in range(spec.num_layers):
            for k in range(spec.arrays_per_layer):
                index = layer * spec.arrays_per_layer + k
                if block_major:
                    arrays.append(BlockArray(0, index * spec.block_len, n_arrays * spec.block_len, layer))
                else:
                    arrays.append(BlockArray(0, index * num_blocks * spec.block_len, spec.block_len, layer))
        return cls(spec, num_blocks, (region,), tuple(arrays))

    def required_bytes(self, region: int) -> int:
        """Smallest length region `region` may have for this layout."""
        ends = [a.offset + (self.num_blocks - 1) * a.stride + self.block_len for a in self.arrays if a.region == region]
        return max(ends, default=0)


def layout_to_wire(layout: KVLayout) -> dict[str, Any]:
    """A plain-data form of a layout for the handshake (msgpack-friendly, no objects)."""
    spec = layout.spec
    return {
        "spec": [
            spec.num_layers,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_dim,
            spec.dtype,
            spec.kv_layout,
            spec.arrays_per_layer,
            spec.value_dim,
            spec.page_bytes,
            spec.model,
            spec.cache_dtype,
            spec.head_start,
            spec.total_kv_heads,
            spec.kv_groups,
            spec.state_split,
            spec.tp_rank,
            spec.tp_size,
        ],
        "num_blocks": layout.num_blocks,
        "rank": layout.rank,
        "ranks": [list(entry) for entry in layout.ranks],
        "regions": [[r.base, r.length, r.memory.value, r.device_id] for r in layout.regions],
        "arrays": [[a.region, a.offset, a.stride, a.layer] for a in layout.arrays],
    }


_MEMORY_TYPES = {memory.value: memory for memory in MemoryType}


def layout_from_wire(data: Mapping[str, Any]) -> KVLayout:
    """Rebuild a peer's layout, checking every field.

    :raises ConfigError: anything missing, mistyped or inconsistent.
    """

    def ints(values: Any, n: int, what: str) -> list[int]:
        if not isinstance(values, list | tuple) or len(values) != n or any(type(v) is not int for v in values):
            raise ConfigError(f"layout {what} must be {n} integers")
        return list(values)

    try:
        raw_spec = data["spec"]
        if not isinstance(raw_spec, list | tuple) or len(raw_spec) != 17:
            raise ConfigError("layout spec must have 17 fields")
        texts = [raw_spec[i] for i in (4, 5, 9, 10, 13, 14)]
        if any(not isinstance(text, str) or len(text) > MAX_SPEC_TEXT for text in texts):
            raise ConfigError(
                "layout spec dtype, kv_layout, model, cache_dtype, kv_groups and state_split must be strings of "
                f"at most {MAX_SPEC_TEXT} characters"
            )
        dtype, kv_layout, model, cache_dtype, kv_groups, state_split = texts
        numbers = ints([raw_spec[i] for i in (0, 1, 2, 3, 6, 7, 8, 11, 12, 15, 16)], 11, "spec")
        layers, size, n_heads, dim, per, dim_v, page, head_start, total, tp_rank, tp_size = numbers
        spec = KVSpec(
            layers,
            size,
            n_heads,
            dim,
            dtype,
            kv_layout,
            per,
            dim_v,
            page,
            model,
            cache_dtype,
            head_start,
            total,
            kv_groups,
            state_split,
            tp_rank,
            tp_size,
        )
        regions = []
        for raw in data["regions"]:
            if not isinstance(raw, list | tuple) or len(raw) != 4 or not isinstance(raw[2], str):
                raise ConfigError("layout region must be [base, length, memory, device]")
            base, length = ints(raw[:2], 2, "region")
            memory = _MEMORY_TYPES.get(raw[2])  # a memory type travels as its value
            if memory is None:
                raise ConfigError(f"layout region memory must be one of {list(_MEMORY_TYPES)}, not {raw[2]!r:.40}")
            regions.append(Region(base, length, memory, ints(raw[3:], 1, "region device")[0]))
        arrays = tuple(BlockArray(*ints(raw, 4, "block array")) for raw in data["arrays"])
        num_blocks = data["num_blocks"]
        if type(num_blocks) is not int:
            raise ConfigError("layout num_blocks must be an integer")
        rank = ints([data.get("rank", 0)], 1, "rank")[0]
        raw_ranks = data.get("ranks", [])
        if not isinstance(raw_ranks, list | tuple) or len(raw_ranks) > MAX_RANKS:
            raise ConfigError(f"layout ranks must be a list of at most {MAX_RANKS} entries")
        ranks = []
        for entry in raw_ranks:
            if (
                not isinstance(entry, list | tuple)
                or len(entry) != 2
                or not all(isinstance(text, str) and 0 < len(text) <= MAX_SPEC_TEXT for text in entry)
            ):
                raise ConfigError("layout rank entry must be [engine id, control address]")
            ranks.append((entry[0], entry[1]))
        return KVLayout(spec, num_blocks, tuple(regions), arrays, rank, tuple(ranks))
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"malformed layout: {type(exc).__name__}: {exc}") from exc
