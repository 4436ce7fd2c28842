"""KV-cache layouts: the pure mapping from logical block ids to registered byte ranges.

`spec` describes a cache (`KVSpec`, `KVLayout`), `compatibility` the fingerprint two peers
compare and whether their caches can exchange blocks, `plan` turns
block ids into coalesced descriptors, `heads` says where each KV head's tokens sit in a block
(for the planner and the integrity check), `pages` reads strided pages from a view's strides,
`groups` says which layers share a block table and which positions each keeps, `states` slices
Mamba / linear-attention state pages between ranks of different tensor parallelism, and
`buffers` turns numpy arrays and torch tensors into `Region`s.  No I/O, no clock.
"""

from __future__ import annotations

from kvflow.layout.buffers import region_of
from kvflow.layout.compatibility import FINGERPRINT_FIELDS, check_compatible, fingerprint
from kvflow.layout.plan import Descriptor, DescriptorPlan, plan_transfer
from kvflow.layout.spec import (
    DTYPE_SIZES,
    MAX_SPEC_TEXT,
    BlockArray,
    KVLayout,
    KVSpec,
    MemoryType,
    Region,
    layout_from_wire,
    layout_to_wire,
)

__all__ = (
    "DTYPE_SIZES",
    "FINGERPRINT_FIELDS",
    "MAX_SPEC_TEXT",
    "BlockArray",
    "Descriptor",
    "DescriptorPlan",
    "KVLayout",
    "KVSpec",
    "MemoryType",
    "Region",
    "check_compatible",
    "fingerprint",
    "layout_from_wire",
    "layout_to_wire",
    "plan_transfer",
    "region_of",
)
