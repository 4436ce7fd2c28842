"""The transfer requests a host makes of an engine (`Expect`, `KvReady`, `Abort`), each one typed value.

Why values: a request crosses several boundaries between the host and the transfer core (the
engine's API and its thread, an engine process's ring, a vLLM rank's agent, the `Endpoint`).
Built once, it carries each parameter once, and everything on the way passes it on whole.
Across a process it travels in its wire form, plain data msgpack carries (no Python objects), and
the other side finds its type in a table by the form's tag, not by a method name.  Each field
travels as its annotated type says (`_FIELD_TYPES`): a field added to a request is carried
with it, and one of a type the table lacks stops the module from importing.

Only the wire form is checked here (`MalformedRequest`: not a map, an unknown tag, a field
missing, unexpected or of the wrong type).  What a request asks for is checked where it always
was: its key by the engine (`transfer_key`), the rest by the core (`TransferCore.expect`,
`kv_ready`, `abort`), so that a request refused there changes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from kvflow.errors import MalformedRequest
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Mode, Role

__all__ = ("REQUESTS", "Abort", "Expect", "KvReady", "Request", "request_from_wire")

_Field = Callable[[str, Any], Any]  # a wire value, checked and made the field's (`what` names it)


def _wrong(what: str, value: object, wanted: str) -> MalformedRequest:
    return MalformedRequest(f"{what} is not {wanted}: {value!r:.80}")


def _int(what: str, value: object) -> int:
    if type(value) is not int:
        raise _wrong(what, value, "an int")
    return value


def _flag(what: str, value: object) -> bool:
    if type(value) is not bool:
        raise _wrong(what, value, "a bool")
    return value


def _text(what: str, value: object) -> str:
    if not isinstance(value, str):
        raise _wrong(what, value, "a string")
    return value


def _maybe_text(what: str, value: object) -> str | None:
    return None if value is None else _text(what, value)


def _ints(what: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _wrong(what, value, "a list of ints")
    return tuple(_int(f"{what}[{index}]", item) for index, item in enumerate(value))


def _key(what: str, value: object) -> TransferKey:
    if not (isinstance(value, list) and len(value) == 2):
        raise _wrong(what, value, "a [transfer id, epoch] pair")
    return TransferKey(_text(f"{what}'s transfer id", value[0]), _int(f"{what}'s epoch", value[1]))


def _layers(what: str, value: object) -> tuple[int, int] | None:
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2):
        raise _wrong(what, value, "null or a [first, end] pair of layers")
    return _int(what, value[0]), _int(what, value[1])


def _timeout(what: str, value: object) -> float | None:
    if value is None:
        return None
    if type(value) not in (int, float):
        raise _wrong(what, value, "null or a number of seconds")
    return float(value)  # type: ignore[arg-type]  # an int or a float, as checked


def _choice(kind: type[Mode] | type[Role]) -> _Field:
    names = sorted(member.value for member in kind)

    def decode(what: str, value: object) -> Mode | Role:
        if value not in names:
            raise _wrong(what, value, f"one of {names}")
        return kind(value)

    return decode


def _plain(value: object) -> object:
    """A field's value as msgpack carries it."""
    if isinstance(value, TransferKey):
        return [value.transfer_id, value.epoch]
    if isinstance(value, Enum):
        return value.value
    return list(value) if isinstance(value, tuple) else value


def _freeze_block_ids(request: Expect | KvReady) -> None:
    """The request's `block_ids` kept as a tuple, whatever sequence it was given (the caller's
    list may change after the request was made)."""
    object.__setattr__(request, "block_ids", tuple(request.block_ids))


def _to_wire(request: Request) -> dict[str, Any]:
    """The request as plain data msgpack carries; `request_from_wire` makes it this request again."""
    return {"request": request.TAG, **{name: _plain(getattr(request, name)) for name in _WIRE_FIELDS[type(request)]}}


@dataclass(frozen=True, slots=True)
class Expect:
    """D: receive transfer `key` from `peer` into `block_ids` (kept as a tuple), for P's block
    positions from `first_position` on, in `expected_batches` WRITEs (push), of the KV cache
    group of `layers` (None: the model's one group); other transfers of the same non-empty
    `share` group may hold the blocks too.  See `TransferCore.expect`.  `timeout`: the seconds
    the engine gives the transfer (None: its configured `transfer_timeout`)."""

    TAG: ClassVar[str] = "expect"

    key: TransferKey
    peer: str
    block_ids: Sequence[int]
    mode: Mode = Mode.PUSH
    expected_batches: int = 1
    first_position: int = 0
    share: str = ""
    layers: tuple[int, int] | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        _freeze_block_ids(self)

    to_wire = _to_wire


@dataclass(frozen=True, slots=True)
class KvReady:
    """P: KV for block positions from `first_position` on (of `layers`; None: every layer) is
    ready in `block_ids` (kept as a tuple); `final` marks the transfer's last batch.  Push: it
    is written once D's registration is here; pull: `peer` is told (None: the first peer to claim
    the transfer).  See `TransferCore.kv_ready`.  `timeout`: the seconds the engine gives a
    transfer this opens (None: its configured `transfer_timeout`)."""

    TAG: ClassVar[str] = "kv_ready"

    key: TransferKey
    block_ids: Sequence[int]
    final: bool = True
    first_position: int = 0
    layers: tuple[int, int] | None = None
    mode: Mode = Mode.PUSH
    peer: str | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        _freeze_block_ids(self)

    to_wire = _to_wire


@dataclass(frozen=True, slots=True)
class Abort:
    """Give up on transfer `key` as `role`, for `reason`.  D may abort a transfer it never
    registered by naming its `peer` and `mode` (P is told).  See `TransferCore.abort`."""

    TAG: ClassVar[str] = "abort"

    key: TransferKey
    role: Role
    reason: str = "aborted by caller"
    peer: str | None = None
    mode: Mode = Mode.PUSH

    to_wire = _to_wire


Request = Expect | KvReady | Abort
REQUESTS: dict[str, type[Request]] = {kind.TAG: kind for kind in (Expect, KvReady, Abort)}  # by wire tag


# a field's type, as annotated -> how its wire value is checked and made the field's
_FIELD_TYPES: dict[str, _Field] = {
    "TransferKey": _key,
    "str": _text,
    "str | None": _maybe_text,
    "int": _int,
    "bool": _flag,
    "Sequence[int]": _ints,
    "tuple[int, int] | None": _layers,
    "float | None": _timeout,
    "Mode": _choice(Mode),
    "Role": _choice(Role),
}
# each request type's fields, in their wire order, each with how it is read from the wire
_WIRE_FIELDS = {
    kind: {f.name: _FIELD_TYPES[str(f.type)] for f in dataclasses.fields(kind)} for kind in REQUESTS.values()
}


def request_from_wire(wire: object) -> Request:
    """The request whose wire form (`to_wire`) `wire` is: its tag picks its type.

    :raises MalformedRequest: `wire` is not a map, names no request type, or has a field
        missing, unexpected or of the wrong type (the message names which).
    """
    if not isinstance(wire, Mapping):
        raise _wrong("a request's wire form", wire, "a map")
    tag = wire.get("request")
    kind = REQUESTS.get(tag) if isinstance(tag, str) else None
    if kind is None:
        raise _wrong("a request's type", tag, f"one of {sorted(REQUESTS)}")
    decoders = _WIRE_FIELDS[kind]
    missing, unexpected = decoders.keys() - wire.keys(), wire.keys() - decoders.keys() - {"request"}
    if missing or unexpected:
        found = [f"no field {name!r}" for name in sorted(missing)]
        found += [f"a field {name:.40} it does not take" for name in sorted(map(repr, unexpected))]
        raise MalformedRequest(f"the {kind.TAG} request's wire form has {' and '.join(found)}")
    fields = {name: decode(f"the {kind.TAG} request's {name}", wire[name]) for name, decode in decoders.items()}
    return kind(**fields)
