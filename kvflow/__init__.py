"""kvflow: a push-based KV-cache transfer engine for prefill/decode disaggregated inference.

The pure core (`kvflow.protocol.state`, `kvflow.protocol.core`, `kvflow.protocol.ledger`, `kvflow.layout`) decides; the
asyncio engine (`kvflow.runtime.engine`) executes through a transport (`kvflow.transports`) and a
control channel.  See README.md for the design and the figures.
"""

from __future__ import annotations

from kvflow.errors import (
    BlockConflict,
    ConfigError,
    EngineClosed,
    EngineCrashed,
    InvalidBatch,
    InvalidTransition,
    KVFlowError,
    LayoutMismatch,
    PeerProtocolError,
    PeerUnknown,
    StaleEpoch,
    TransferFailed,
    TransferTimeout,
    TransportError,
    TransportUnavailable,
    UnknownTransfer,
    UnknownTransport,
)
from kvflow.layout import KVLayout, KVSpec, MemoryType, Region
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Mode, Outcome, Role, State

__version__ = "0.1.0"

__all__ = (
    "BlockConflict",
    "ConfigError",
    "EngineClosed",
    "EngineCrashed",
    "InvalidBatch",
    "InvalidTransition",
    "KVFlowError",
    "KVLayout",
    "KVSpec",
    "LayoutMismatch",
    "MemoryType",
    "Mode",
    "Outcome",
    "PeerProtocolError",
    "PeerUnknown",
    "Region",
    "Role",
    "StaleEpoch",
    "State",
    "TransferFailed",
    "TransferKey",
    "TransferTimeout",
    "TransportError",
    "TransportUnavailable",
    "UnknownTransfer",
    "UnknownTransport",
    "__version__",
)
