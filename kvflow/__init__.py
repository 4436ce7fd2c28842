"""kvflow: a push-based KV-cache transfer engine for prefill/decode disaggregated inference.

The pure core (`kvflow.protocol.state`, `kvflow.protocol.core`, `kvflow.protocol.ledger`, `kvflow.layout`) decides; the
asyncio engine (`kvflow.runtime.engine`) executes through a transport (`kvflow.transports`) and a
control channel.  See docs/design.md for the design and docs/benchmarks.md for the figures.
"""

from __future__ import annotations

from kvflow.control.channel import ControlChannel, LocalControlHub
from kvflow.control.zeromq import ZmqControl
from kvflow.errors import (
    BlockConflict,
    BlockSizeMismatch,
    ConfigError,
    EngineAsleep,
    EngineBusy,
    EngineClosed,
    EngineCrashed,
    EngineTimeout,
    HandshakeTimeout,
    InvalidBatch,
    InvalidTransition,
    KVFlowError,
    LayoutMismatch,
    LedgerError,
    MalformedRequest,
    PeerNotAllowed,
    PeerProtocolError,
    PeerUnknown,
    PeerUnreachable,
    RingCorrupt,
    StaleEpoch,
    Timeout,
    TransferFailed,
    TransferTimeout,
    TransportError,
    TransportUnavailable,
    UnknownTransfer,
    UnknownTransport,
    UnsendableMessage,
    UnsupportedVersion,
    UsageError,
)
from kvflow.layout import KVLayout, KVSpec, MemoryType, Region, region_of
from kvflow.protocol.core import CoreConfig
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Mode, Outcome, Role, State
from kvflow.runtime.engine import Engine, EngineConfig, TransferHandle, TransferResult
from kvflow.runtime.loop import new_event_loop, run
from kvflow.runtime.threaded import EngineThread
from kvflow.transports.base import Transport
from kvflow.transports.registry import available_transports, load_transport

__version__ = "0.1.0"

__all__ = (
    "BlockConflict",
    "BlockSizeMismatch",
    "ConfigError",
    "ControlChannel",
    "CoreConfig",
    "Engine",
    "EngineAsleep",
    "EngineBusy",
    "EngineClosed",
    "EngineConfig",
    "EngineCrashed",
    "EngineTimeout",
    "HandshakeTimeout",
    "EngineThread",
    "InvalidBatch",
    "InvalidTransition",
    "KVFlowError",
    "KVLayout",
    "KVSpec",
    "LayoutMismatch",
    "LedgerError",
    "LocalControlHub",
    "MalformedRequest",
    "MemoryType",
    "Mode",
    "Outcome",
    "PeerProtocolError",
    "PeerNotAllowed",
    "PeerUnknown",
    "PeerUnreachable",
    "RingCorrupt",
    "Region",
    "Role",
    "StaleEpoch",
    "State",
    "TransferFailed",
    "TransferHandle",
    "TransferKey",
    "TransferResult",
    "Timeout",
    "TransferTimeout",
    "Transport",
    "TransportError",
    "TransportUnavailable",
    "UnknownTransfer",
    "UnknownTransport",
    "UnsendableMessage",
    "UnsupportedVersion",
    "UsageError",
    "ZmqControl",
    "__version__",
    "available_transports",
    "load_transport",
    "new_event_loop",
    "region_of",
    "run",
)
