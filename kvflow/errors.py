"""kvflow's exception hierarchy: one root, errors named by what went wrong.

Why a single module: every exception the library raises is defined here and derives from
`KVFlowError`, and every public function documents what it raises, so a caller that catches
`KVFlowError` catches every failure kvflow reports (the tools' own exceptions, in
`kvflow_tools.errors`, derive from it too).  A few also derive from the builtin a caller
would reach for: `UnknownTransfer` is a `KeyError`, `InvalidBatch` and `ConfigError` are
`ValueError`s, `UnknownTransport` a `LookupError`, `Timeout` (a transfer's, a handshake's or an
engine's) a `TimeoutError` and `UsageError` a `RuntimeError`.

The rule at the edges: a backend library's exception is mapped only where the library documents
it as the failure of a call, and only those types, chained with ``from`` (`map_exceptions`, or an
``except`` naming them):

* NIXL's ``nixl*Error`` types (one per error status) become `TransportError`, and the
  `RuntimeError` of an agent with no backend plugin `TransportUnavailable`;
* a missing backend package (`ModuleNotFoundError`) becomes `TransportUnavailable`;
* ZeroMQ's `ZMQError` becomes `ConfigError` when binding, `PeerUnreachable` when connecting to
  or sending to a peer (as does asyncio's `RuntimeError` for the closed loop of an in-process peer);
* `OSError` opening a peer's shared memory, and torch's `RuntimeError` for a device error,
  become `TransportError`;
* msgpack's exceptions on a peer's bytes become `PeerProtocolError` (control frames and WRITE
  notifications) or `TransportError` (transport metadata).  The control-frame decoder, which
  faces the network, refuses whatever it cannot decode with `PeerProtocolError`.

Anything else, a `KeyError`, `TypeError` or `AttributeError` from kvflow's own code or from a
library it called wrongly, is a bug: it propagates as it is, so that it stays visible.  Raised
in an engine callback or on its writer thread, it is recorded and surfaces as `EngineCrashed`
from the engine's next call and from `aclose`.

Messages follow h11's style: lower case, and they carry the state that made the operation fail
(transfer, state, input, field), so a log line alone says what happened.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

__all__ = (
    "BlockConflict",
    "BlockSizeMismatch",
    "ConfigError",
    "EngineAsleep",
    "EngineBusy",
    "EngineClosed",
    "EngineCrashed",
    "EngineTimeout",
    "HandshakeTimeout",
    "InvalidBatch",
    "InvalidTransition",
    "KVFlowError",
    "LayoutMismatch",
    "LedgerError",
    "MalformedRequest",
    "PeerProtocolError",
    "PeerNotAllowed",
    "PeerUnknown",
    "PeerUnreachable",
    "RingCorrupt",
    "StaleEpoch",
    "Timeout",
    "TransferFailed",
    "TransferTimeout",
    "TransportError",
    "TransportUnavailable",
    "UnknownTransfer",
    "UnknownTransport",
    "UnsendableMessage",
    "UnsupportedVersion",
    "UsageError",
    "map_exceptions",
)


class KVFlowError(Exception):
    """Root of every exception kvflow raises."""


class InvalidTransition(KVFlowError):
    """An input that the transition table does not allow in the machine's current state.

    The machine is left exactly as it was.
    """

    def __init__(self, transfer: str, state: str, input_: str) -> None:
        self.transfer = transfer
        self.state = state
        self.input = input_
        super().__init__(f"can't handle {input_} when transfer={transfer!r} and state={state}")


class UnknownTransfer(KVFlowError, KeyError):
    """No transfer with this id and epoch is known here."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else "unknown transfer"


class StaleEpoch(KVFlowError):
    """A transfer was started again with an epoch that is not newer than one already seen."""


class BlockConflict(KVFlowError):
    """A destination block is already held by another live or quarantined transfer."""


class LedgerError(KVFlowError):
    """A hold was opened twice, or released twice or never existed: a bug in whoever drives the
    block ledger, or an engine that closed still holding blocks."""


class InvalidBatch(KVFlowError, ValueError):
    """A batch of KV blocks is malformed: empty, out of range, overlapping, or too many."""


class ConfigError(KVFlowError, ValueError):
    """A configuration value or layout description is invalid."""


class BlockSizeMismatch(ConfigError):
    """D's block size is not a multiple of P's, found once associated with `peer` (which then
    still waits for the transfer unless told)."""

    def __init__(self, message: str, peer: str) -> None:
        super().__init__(message)
        self.peer = peer


class LayoutMismatch(KVFlowError):
    """Two peers' KV layouts are incompatible; `field` names the first field that differs."""

    def __init__(self, field: str, local: object, remote: object, detail: str = "") -> None:
        self.field = field
        self.local = local
        self.remote = remote
        why = f": {detail}" if detail else ""
        super().__init__(f"kv layout mismatch on {field}: local={local!r} remote={remote!r}{why}")


class UnknownTransport(KVFlowError, LookupError):
    """No transport is registered under the requested name."""


class UsageError(KVFlowError, RuntimeError):
    """An object was used against its contract, out of order (an engine or a control channel
    started twice, a worker used before its KV caches were registered): a bug in the caller."""


class MalformedRequest(UsageError):
    """The wire form of a request (`kvflow.protocol.requests`) that is not one: not a map, of a
    type no request has, or with a field missing, unexpected or of the wrong type."""


class EngineClosed(KVFlowError):
    """The engine (or its control channel or writer) was closed; it accepts no more work."""


class EngineBusy(KVFlowError):
    """An engine process owes answers to as many calls as its host lets wait (it is stopped,
    frozen or overloaded): the host refuses new work until it answers; what ends or frees work
    still goes."""


class EngineAsleep(KVFlowError):
    """The engine let go of its KV memory's registration (vLLM's sleep mode): it starts no
    transfer and accepts no handshake until the memory is registered again."""


class RingCorrupt(KVFlowError):
    """A ring shared with an engine process holds a header or record its protocol never writes
    (the memory is not the ring's, or the other side is hostile)."""


class EngineCrashed(KVFlowError):
    """A background task of the engine raised; `errors` holds what was recorded."""

    def __init__(self, errors: list[BaseException]) -> None:
        self.errors = list(errors)
        first = errors[0] if errors else None
        super().__init__(f"engine background task failed {len(errors)} time(s); first: {first!r}")


class PeerProtocolError(KVFlowError):
    """A peer sent a malformed or unexpected control message or notification."""


class UnsendableMessage(PeerProtocolError):
    """A message this side built cannot be encoded (a frame over the limit, a value the wire
    cannot carry): the fault of that message, not of the peer or the link."""


class UnsupportedVersion(PeerProtocolError):
    """A peer's control frame is well formed but speaks another protocol version."""

    def __init__(self, version: object, sender: str, supported: int) -> None:
        self.version = version
        self.sender = sender
        self.supported = supported
        super().__init__(f"{sender!r} speaks control protocol version {version!r}; this engine speaks {supported}")


class PeerNotAllowed(KVFlowError):
    """The deployment does not permit this peer: its engine id or its control address is not
    on the engine's allow-list (`kvflow.protocol.admission.PeerAllowList`)."""


class PeerUnknown(KVFlowError):
    """An operation named a peer this engine has no route to (no address, no such engine)."""


class PeerUnreachable(KVFlowError):
    """A known peer cannot be sent to now: its send queue is full (it is not reading), its
    connection failed, or it stopped running."""


class TransferFailed(KVFlowError):
    """A transfer ended without its KV blocks arriving.

    `outcome` is one of "aborted", "failed", "expired"; `reason` says why.
    """

    def __init__(self, transfer: str, outcome: str, reason: str) -> None:
        self.transfer = transfer
        self.outcome = outcome
        self.reason = reason
        super().__init__(f"transfer {transfer!r} {outcome}: {reason}")


class Timeout(KVFlowError, TimeoutError):
    """A wait ran past its deadline; the subclasses say what was waited for."""


class TransferTimeout(Timeout):
    """A transfer's outcome (or the device's writing of its KV) was not there by the deadline."""


class HandshakeTimeout(Timeout):
    """A peer did not answer a handshake by the deadline."""


class EngineTimeout(Timeout):
    """An engine's thread or process did not start, answer or close by the deadline."""


class TransportError(KVFlowError):
    """The only family of exceptions a transport may raise."""


class TransportUnavailable(TransportError):
    """A transport's library or device is missing; the message carries an install hint."""


@contextlib.contextmanager
def map_exceptions(mapping: Mapping[type[BaseException], type[KVFlowError]], context: str = "") -> Iterator[None]:
    """Re-raise third-party exceptions as kvflow exceptions (httpcore's `map_exceptions`).

    The first entry whose key matches the raised exception wins; kvflow exceptions pass
    through untouched, and unmatched exceptions propagate unchanged so that bugs stay visible.

    :raises KVFlowError: the mapped exception, chained to the original with ``from``.
    """
    try:
        yield
    except KVFlowError:
        raise
    except Exception as exc:
        for source, target in mapping.items():
            if isinstance(exc, source):
                prefix = f"{context}: " if context else ""
                raise target(f"{prefix}{type(exc).__name__}: {exc}") from exc
        raise
