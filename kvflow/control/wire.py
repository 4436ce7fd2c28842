"""The control plane's wire format: msgpack envelopes with a strict, typed decoder.

Why strict: the control socket is reachable by anything on its network, and the peers we learn
from (vLLM, SGLang, Mooncake) deserialized arbitrary Python objects from ZeroMQ and paid in CVEs (CVE-2025-32444,
CVE-2025-29783, CVE-2025-47277).  Here nothing but msgpack's plain types is ever decoded: no
extension types, bounded sizes, and every field is checked for type and range before a message
object exists.  Whatever bytes arrive, `decode` raises only `PeerProtocolError`.

An envelope is one msgpack array:

    [MAGIC, version, sender, incarnation, receiver, seq, type, body, receiver_incarnation]

`incarnation` identifies one run of the sending engine (a restarted engine gets a larger one),
`seq` increases with every frame it sends, so a receiver can refuse replays.
`receiver_incarnation` names the run of the receiver the frame is meant for, so that nothing
sent to an earlier run is accepted by a restarted receiver; 0 means "not known yet", which the
channel allows only for an opening Hello and a Reject.  The first eight fields and the REJECT
body keep their places across versions (later versions only append), so a peer speaking
another version can still be told why it is refused.  Authentication (an HMAC over the envelope bytes) is the
channel's job (`kvflow.control.auth`).

Block ids and heartbeat epochs travel packed, one binary field of little-endian integers
(uint32 per block id, uint64 per epoch), not a msgpack array of one object per id: a frame's
decode then costs a few C loops over its bytes rather than a Python check per id, and a block
list of 131k ids weighs 512 KiB rather than up to 640 KiB.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import numpy as np

from kvflow.errors import ConfigError, PeerProtocolError, UnsendableMessage, UnsupportedVersion
from kvflow.layout import layout_from_wire
from kvflow.protocol.messages import (
    MAX_BLOCK_ID,
    MAX_BLOCKS,
    MAX_EPOCH,
    MAX_HEARTBEAT_KEYS,
    MAX_POSITION,
    MAX_TOKEN_ID,
    MAX_TRANSFER_ID,
    Claim,
    ControlMessage,
    Done,
    FirstToken,
    Goodbye,
    Heartbeat,
    Hello,
    Notice,
    Quiesced,
    Ready,
    Registration,
    Reject,
    TransferKey,
    engine_id_problem,
)
from kvflow.protocol.state import Outcome

__all__ = (
    "MAGIC",
    "MAX_FRAME_BYTES",
    "VERSION",
    "Envelope",
    "decode",
    "encode",
    "pack_blocks",
)

MAGIC = "kvflow"
# 2: a Hello no longer carries a role; 3: the receiver's incarnation; 4: a registration's first position,
# Claim, a layout names its heads and ranks, open batch counts; 5: block ids and heartbeat epochs packed;
# 6: a Hello names the sender's association; 7: a heartbeat names at most 4,096 keys; 8: a Ready's first
# position, a layout's KV cache groups
VERSION = 8
MAX_FRAME_BYTES = 1 << 20
MAX_ID = MAX_TRANSFER_ID  # transfer ids (engine ids: `messages.MAX_ENGINE_ID`)
MAX_TEXT = 1024  # reasons, addresses
MAX_BATCHES = 1 << 16
MAX_KEYS = MAX_HEARTBEAT_KEYS
MAX_METADATA = 1 << 19
BLOCK_ID = np.dtype("<u4")  # a packed block id
EPOCH = np.dtype("<u8")  # a packed heartbeat epoch
OUTCOMES = (Outcome.ABORTED, Outcome.FAILED, Outcome.EXPIRED)  # a notice never says "succeeded"


@dataclass(frozen=True, slots=True)
class Envelope:
    sender: str
    incarnation: int
    receiver: str
    seq: int
    message: ControlMessage
    receiver_incarnation: int = 0  # 0: the sender does not know the receiver's run yet


# ---------------------------------------------------------------- field checks


def _fail(what: str) -> PeerProtocolError:
    return PeerProtocolError(f"malformed control message: {what}")


def _text(value: Any, what: str, limit: int = MAX_TEXT, *, empty: bool = True) -> str:
    if type(value) is not str or len(value) > limit or (not empty and not value):
        raise _fail(f"{what} must be a string of at most {limit} characters")
    return value


def _engine_id(value: Any, what: str) -> str:
    problem = engine_id_problem(value)
    if problem is not None:
        raise _fail(f"{what} {problem}")
    return str(value)


def _int(value: Any, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _fail(f"{what} must be an integer in {low}..{high}")
    return value


def _list(value: Any, what: str, limit: int) -> list[Any]:
    if type(value) is not list or len(value) > limit:
        raise _fail(f"{what} must be a list of at most {limit} items")
    return value


E = TypeVar("E", bound=enum.Enum)


def _member(value: Any, what: str, allowed: tuple[E, ...]) -> E:
    """The enum member whose value `value` is: an enum travels as its value, and any other
    value (an unknown one, one not allowed here, another type) is refused."""
    for member in allowed:
        if value == member.value:
            return member
    raise _fail(f"{what} must be one of {[m.value for m in allowed]}")


def _key(tid: Any, epoch: Any) -> TransferKey:
    return TransferKey(_text(tid, "transfer id", MAX_ID, empty=False), _int(epoch, "epoch", 0, MAX_EPOCH))


def _packed(value: Any, what: str, dtype: np.dtype[Any], limit: int, high: int) -> list[int]:
    """The integers a packed field holds: bytes, a whole number of `dtype` items, at most
    `limit` of them, each at most `high` (all unsigned: none below 0)."""
    if type(value) is not bytes or len(value) % dtype.itemsize or len(value) > limit * dtype.itemsize:
        raise _fail(f"{what} must be packed {dtype.itemsize}-byte little-endian integers, at most {limit} of them")
    items = np.frombuffer(value, dtype=dtype)
    if items.size and int(items.max()) > high:
        raise _fail(f"{what} must each be at most {high}")
    ids: list[int] = items.tolist()
    return ids


def pack_blocks(block_ids: tuple[int, ...]) -> bytes:
    """Block ids as they travel: little-endian uint32, one after the other.

    :raises PeerProtocolError: an id is not an integer a uint32 holds.
    """
    try:
        return np.asarray(block_ids, dtype=BLOCK_ID).tobytes()
    except (OverflowError, ValueError, TypeError) as exc:
        raise PeerProtocolError(f"cannot pack block ids: {exc}") from None


def _blocks(value: Any, *, allow_empty: bool = False) -> tuple[int, ...]:
    ids = _packed(value, "block ids", BLOCK_ID, MAX_BLOCKS, MAX_BLOCK_ID)
    if not ids and not allow_empty:
        raise _fail("block ids must not be empty")
    return tuple(ids)


def _body(value: Any, n: int, what: str) -> list[Any]:
    if type(value) is not list or len(value) != n:
        raise _fail(f"{what} body must have {n} fields")
    return value


def _fingerprint(value: Any) -> dict[str, int | str]:
    if type(value) is not dict or len(value) > 64:
        raise _fail("fingerprint must be a map of at most 64 fields")
    out: dict[str, int | str] = {}
    for k, v in value.items():
        _text(k, "fingerprint field", 64)
        if type(v) is int:
            out[k] = v
        else:
            out[k] = _text(v, f"fingerprint {k}", 256)
    return out


def _layout(value: Any) -> dict[str, Any]:
    if type(value) is not dict:
        raise _fail("layout must be a map")
    try:
        layout_from_wire(value)
    except ConfigError as exc:
        raise _fail(f"layout: {exc}") from None
    return value


# ---------------------------------------------------------------- per type

Decoder = Callable[[Any], ControlMessage]


def _reject(body: Any) -> Reject:
    (reason,) = _body(body, 1, "reject")
    return Reject(_text(reason, "reason"))


def _hello(body: Any) -> Hello:
    engine_id, fp, layout, metadata, reply, address, association = _body(body, 7, "hello")
    if type(metadata) is not bytes or len(metadata) > MAX_METADATA:
        raise _fail(f"transport metadata must be at most {MAX_METADATA} bytes")
    if type(reply) is not bool:
        raise _fail("hello reply flag must be a boolean")
    return Hello(
        _engine_id(engine_id, "engine id"),
        _fingerprint(fp),
        _layout(layout),
        metadata,
        reply,
        _text(address, "control address"),
        _int(association, "association", 0, MAX_EPOCH),
    )


def _registration(body: Any) -> Registration:
    tid, epoch, blocks, batches, ttl, first = _body(body, 6, "registration")
    if type(ttl) not in (int, float) or not math.isfinite(ttl) or not 0 < ttl <= 1e6:
        raise _fail("ttl must be a finite number of seconds in (0, 1e6]")
    ids = _blocks(blocks, allow_empty=True)
    # no blocks (D needs nothing) exactly when no WRITE is expected; with blocks, 0 is an open count
    expected = _int(batches, "expected batches", 0, 0 if not ids else MAX_BATCHES)
    return Registration(_key(tid, epoch), ids, expected, float(ttl), _int(first, "first position", 0, MAX_POSITION))


def _ready(body: Any) -> Ready:
    tid, epoch, blocks, first = _body(body, 4, "ready")
    return Ready(_key(tid, epoch), _blocks(blocks), _int(first, "first position", 0, MAX_POSITION))


def _notice(body: Any) -> Notice:
    tid, epoch, outcome, reason = _body(body, 4, "notice")
    return Notice(_key(tid, epoch), _member(outcome, "notice outcome", OUTCOMES), _text(reason, "reason"))


def _quiesced(body: Any) -> Quiesced:
    tid, epoch = _body(body, 2, "quiesced")
    return Quiesced(_key(tid, epoch))


def _done(body: Any) -> Done:
    tid, epoch = _body(body, 2, "done")
    return Done(_key(tid, epoch))


def _claim(body: Any) -> Claim:
    tid, epoch = _body(body, 2, "claim")
    return Claim(_key(tid, epoch))


def _heartbeat(body: Any) -> Heartbeat:
    tids, packed = _body(body, 2, "heartbeat")
    ids = _list(tids, "heartbeat transfer ids", MAX_KEYS)
    epochs = _packed(packed, "heartbeat epochs", EPOCH, MAX_KEYS, MAX_EPOCH)
    if len(epochs) != len(ids):
        raise _fail(f"heartbeat names {len(ids)} transfer ids but {len(epochs)} epochs")
    # checked at C speed, not a Python step per key
    if ids and (set(map(type, ids)) != {str} or min(map(len, ids)) == 0 or max(map(len, ids)) > MAX_ID):
        raise _fail(f"heartbeat transfer ids must be strings of 1..{MAX_ID} characters")
    return Heartbeat(tuple(map(TransferKey, ids, epochs)))


def _first_token(body: Any) -> FirstToken:
    tid, epoch, token = _body(body, 3, "first token")
    return FirstToken(_key(tid, epoch), _int(token, "first token", 0, MAX_TOKEN_ID))


def _goodbye(body: Any) -> Goodbye:
    (reason,) = _body(body, 1, "goodbye")
    return Goodbye(_text(reason, "reason"))


_DECODERS: dict[int, Decoder] = {
    0: _reject,
    1: _hello,
    2: _registration,
    3: _ready,
    4: _notice,
    5: _quiesced,
    6: _done,
    7: _heartbeat,
    8: _goodbye,
    9: _claim,
    10: _first_token,
}


def _encode_body(message: ControlMessage) -> tuple[int, list[Any]]:
    if isinstance(message, Reject):
        return 0, [message.reason]
    if isinstance(message, Hello):
        m = message
        hello = [m.engine_id, m.fingerprint, m.layout, m.transport_metadata, m.reply, m.control_address]
        return 1, [*hello, m.association]
    if isinstance(message, Registration):
        k = message.key
        r = message
        return 2, [k.transfer_id, k.epoch, pack_blocks(r.block_ids), r.expected_batches, r.ttl, r.first_position]
    if isinstance(message, Ready):
        return 3, [message.key.transfer_id, message.key.epoch, pack_blocks(message.block_ids), message.first_position]
    if isinstance(message, Notice):
        return 4, [message.key.transfer_id, message.key.epoch, message.outcome.value, message.reason]
    if isinstance(message, Quiesced):
        return 5, [message.key.transfer_id, message.key.epoch]
    if isinstance(message, Done):
        return 6, [message.key.transfer_id, message.key.epoch]
    if isinstance(message, Claim):
        return 9, [message.key.transfer_id, message.key.epoch]
    if isinstance(message, FirstToken):
        return 10, [message.key.transfer_id, message.key.epoch, message.token]
    if isinstance(message, Heartbeat):
        keys = message.keys
        return 7, [[k.transfer_id for k in keys], np.fromiter((k.epoch for k in keys), EPOCH, len(keys)).tobytes()]
    return 8, [message.reason]


# ---------------------------------------------------------------- envelopes


def encode(envelope: Envelope) -> bytes:
    """The frame for an envelope.

    :raises UnsendableMessage: the result would exceed `MAX_FRAME_BYTES`, or a value is outside
        what its field carries (a block id or epoch past its packed width, an integer past 64
        bits, text with a lone surrogate).
    """
    try:
        code, body = _encode_body(envelope.message)
        frame: bytes = msgpack.packb(
            [
                MAGIC,
                VERSION,
                envelope.sender,
                envelope.incarnation,
                envelope.receiver,
                envelope.seq,
                code,
                body,
                envelope.receiver_incarnation,
            ],
            use_bin_type=True,
        )
    except (OverflowError, ValueError, TypeError) as exc:  # numpy or msgpack refusing a value
        raise UnsendableMessage(f"cannot pack {type(envelope.message).__name__}: {exc}") from None
    if len(frame) > MAX_FRAME_BYTES:
        raise UnsendableMessage(f"control frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    return frame


def decode(frame: bytes) -> Envelope:
    """Parse and check a frame.

    :raises UnsupportedVersion: well formed, another protocol version (not a REJECT).
    :raises PeerProtocolError: anything else that is not a valid envelope of this version.
    """
    if type(frame) is not bytes or len(frame) > MAX_FRAME_BYTES:
        raise _fail(f"frame must be bytes of at most {MAX_FRAME_BYTES}")
    try:
        raw = msgpack.unpackb(
            frame,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_ext_len=0,
            max_str_len=MAX_METADATA,
            max_bin_len=MAX_METADATA,
            max_array_len=MAX_BLOCKS,
            max_map_len=4096,
        )
    except Exception as exc:  # msgpack raises ExtraData, FormatError, ValueError, StackError, ...
        raise _fail(f"not msgpack ({type(exc).__name__})") from None
    if type(raw) is not list or len(raw) < 8 or raw[0] != MAGIC:
        raise _fail("not a kvflow envelope")
    _, version, sender, incarnation, receiver, seq, code, body = raw[:8]
    sender = _engine_id(sender, "sender")
    incarnation = _int(incarnation, "incarnation", 0, MAX_EPOCH)
    receiver = _engine_id(receiver, "receiver")
    seq = _int(seq, "sequence number", 0, MAX_EPOCH)
    if version != VERSION and code != 0:
        raise UnsupportedVersion(version, sender, VERSION)
    if version == VERSION and len(raw) != 9:
        raise _fail(f"an envelope of version {VERSION} has 9 fields")
    # another version's REJECT: its receiver incarnation, if any, is not ours to read
    receiver_incarnation = _int(raw[8], "receiver incarnation", 0, MAX_EPOCH) if version == VERSION else 0
    decoder = _DECODERS.get(code) if type(code) is int else None
    if decoder is None:
        raise _fail(f"unknown message type {code!r}")
    try:
        message = decoder(body)
    except PeerProtocolError:
        raise
    except (TypeError, ValueError) as exc:  # wrong arity while unpacking a body, and the like
        raise _fail(f"{type(exc).__name__} in message type {code}") from None
    return Envelope(sender, incarnation, receiver, seq, message, receiver_incarnation)
