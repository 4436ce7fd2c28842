"""Control messages between a prefill and a decode engine, and the data-plane notification.

Why a separate module: the core produces and consumes these as plain frozen dataclasses; how
they travel (in-process hub, msgpack over ZeroMQ) is the control channel's business.  Only the
WRITE notification is encoded here, because it rides inside the data plane (a NIXL notification
or the loopback transport's) and the core must parse whatever bytes arrive there; with the
integrity check on it carries a `Seal`, the digests of what the WRITE moved.

Times never cross the wire as absolute values: hosts do not share a clock, so a registration
carries a time-to-live in seconds and the receiver turns it into its own deadline.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from dataclasses import dataclass
from typing import Any

import msgpack

from kvflow.errors import ConfigError, InvalidBatch, PeerProtocolError
from kvflow.protocol.state import Outcome

__all__ = (
    "Claim",
    "ControlMessage",
    "Done",
    "FirstToken",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "Message",
    "MAX_BLOCK_ID",
    "MAX_BLOCKS",
    "MAX_EPOCH",
    "MAX_TOKEN_ID",
    "MAX_POSITION",
    "MAX_TRANSFER_ID",
    "OPEN_BATCHES",
    "Notice",
    "Quiesced",
    "Ready",
    "Registration",
    "Reject",
    "Seal",
    "TransferKey",
    "decode_notification",
    "encode_notification",
    "engine_id_problem",
    "address_problem",
    "epoch_problem",
    "id_tag",
    "require_engine_id",
    "transfer_id_problem",
    "transfer_key",
    "transfer_key_problem",
)

NOTIFICATION_TAG = "kvf1"
# A registration's batch count when D cannot know it (P's token budget splits the prompt into
# chunks only P sees): P decides, and the notification of its last batch says it is the last.
OPEN_BATCHES = 0
MAX_NOTIFICATION_BYTES = 32_768  # a seal's digests of ~2,000 blocks fit (shm reads 64 KiB datagrams)
MAX_LAYER = (1 << 16) - 1
MAX_ENGINE_ID = 128
# What a transfer key may hold: what the wire carries (`kvflow.control.wire`), checked where a
# key enters (the local API, the vLLM connector's parameters), so that nothing accepted there
# can fail to encode later, in a registration or in every heartbeat that lists it.
MAX_TRANSFER_ID = 256  # characters
MAX_EPOCH = (1 << 63) - 1  # epochs travel as uint64 in heartbeats, as int64 elsewhere
MAX_BLOCKS = 1 << 17  # block ids one message names (a registration, a Ready)
# transfer keys one heartbeat names (a sender with more sends several): what decoding one costs
# is a Python object per key, so the cap bounds the loop's work per frame (about 2 ms)
MAX_HEARTBEAT_KEYS = 4096
MAX_POSITION = (1 << 31) - 1  # a block position in a prompt
MAX_TOKEN_ID = (1 << 31) - 1  # a vocabulary entry (vLLM keeps token ids as int32)
MAX_BLOCK_ID = (1 << 31) - 1  # block ids travel as uint32; below 2**31 for every engine's index type
ENGINE_ID_CHARACTERS = "letters, digits and . _ : @ + - (not first)"
_ENGINE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]*")


def engine_id_problem(value: object) -> str | None:
    """Why `value` cannot name an engine, or None when it can.

    Why strict: a peer's engine id becomes part of file and socket names on this host (the
    shared-memory transport's lock and generation files), of log lines and of metrics labels, so
    only a short id of plain characters is accepted, from the wire and from local configuration.
    """
    if type(value) is not str:
        return "must be a string"
    if not 0 < len(value) <= MAX_ENGINE_ID:
        return f"must have 1 to {MAX_ENGINE_ID} characters"
    if _ENGINE_ID.fullmatch(value) is None:
        return f"may hold only {ENGINE_ID_CHARACTERS}"
    return None


_TCP_ADDRESS = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[0-9.]+):([0-9]{1,5})", re.ASCII)


def address_problem(address: str) -> str | None:
    """Why `address` is not ``tcp://IP:PORT`` (an IPv4 address, or an IPv6 one in brackets, and
    a port 1..65535), or None when it is.

    Why literal addresses only: ZeroMQ resolves a host name with a blocking lookup on its one I/O
    thread (again at every reconnect), so one slow name stalls every peer's control traffic."""
    match = _TCP_ADDRESS.fullmatch(address)
    if match is None:
        return "must be tcp://IP:PORT with a literal IPv4 address or [IPv6] address (no host name)"
    try:
        ipaddress.ip_address(match.group(1).strip("[]"))
    except ValueError:
        return f"names {match.group(1)!r}, which is not an IP address"
    if not 0 < int(match.group(2)) <= 65535:
        return "must have a port 1..65535"
    return None


def transfer_id_problem(transfer_id: object, limit: int = MAX_TRANSFER_ID) -> str | None:
    """Why `transfer_id` cannot name a transfer, or None when it can: a string of 1..`limit`
    characters that UTF-8 encodes (no lone surrogate, which JSON can carry)."""
    if type(transfer_id) is not str or not 0 < len(transfer_id) <= limit:
        return f"the transfer id must be a string of 1 to {limit} characters"
    try:
        transfer_id.encode()
    except UnicodeEncodeError:
        return "the transfer id must be text that UTF-8 encodes (it holds a lone surrogate)"
    return None


def epoch_problem(epoch: object) -> str | None:
    """Why `epoch` cannot be a transfer's epoch, or None when it can: an integer 0..`MAX_EPOCH`."""
    if type(epoch) is not int or not 0 <= epoch <= MAX_EPOCH:
        return f"the epoch must be an integer 0..{MAX_EPOCH} (2**63 - 1)"
    return None


def transfer_key_problem(transfer_id: object, epoch: object) -> str | None:
    """Why (`transfer_id`, `epoch`) cannot be a transfer key, or None when it can."""
    return transfer_id_problem(transfer_id) or epoch_problem(epoch)


def transfer_key(transfer_id: str, epoch: int) -> TransferKey:
    """The key of a transfer named locally, checked.

    :raises ConfigError: naming what is wrong with it (see `transfer_key_problem`).
    """
    problem = transfer_key_problem(transfer_id, epoch)
    if problem is not None:
        raise ConfigError(f"{problem}, not {transfer_id!r:.80}@{epoch!r:.40}")
    return TransferKey(transfer_id, epoch)


def require_engine_id(value: str, what: str = "engine id") -> str:
    """`value`, checked as an engine id given locally (a name, a peer to connect to).

    :raises ConfigError: naming what is wrong with it.
    """
    problem = engine_id_problem(value)
    if problem is not None:
        raise ConfigError(f"{what} {value!r} {problem}")
    return value


@dataclass(frozen=True, slots=True, order=True)
class TransferKey:
    """A router-set transfer id and the epoch of this attempt at it."""

    transfer_id: str
    epoch: int

    def __str__(self) -> str:
        """How the key appears in logs and error messages: a digest of the id, never the id
        itself (a capability: who knows it can ask for the transfer's KV), and the epoch."""
        return f"{id_tag(self.transfer_id)}@{self.epoch}"


def id_tag(transfer_id: str) -> str:
    """The name a transfer id goes by in logs: ``t-`` and 12 hex digits of its BLAKE2b digest
    (the same on every engine, so P's and D's lines about one transfer can be matched)."""
    return "t-" + hashlib.blake2b(transfer_id.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()


@dataclass(frozen=True, slots=True)
class Hello:
    """Handshake: who I am and what my KV cache looks like.

    `reply` is False when a side starts an association (and expects a Hello back), True when it
    answers one.  `association` is the sender's number for its association with the receiver,
    the same in every Hello of one association (a retry after a handshake timed out on the
    sender's side, an answer) and new once the sender dropped the receiver.  A non-reply Hello
    from a peer already associated therefore says which it is: with the number of the live
    association, a retry, answered again; with another, the peer started over, and everything of
    the old association is torn down first.
    """

    engine_id: str
    fingerprint: dict[str, int | str]
    layout: dict[str, Any]
    transport_metadata: bytes
    reply: bool = False
    control_address: str = ""  # where the peer reaches this engine's control channel, if anywhere
    association: int = 0


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Liveness, and lease renewal: the transfers the sender still waits on from the receiver.
    A prefill engine keeps holding the blocks of these while heartbeats keep coming."""

    keys: tuple[TransferKey, ...] = ()


@dataclass(frozen=True, slots=True)
class Goodbye:
    """The sender is closing: tear the association down now instead of at the lease's end."""

    reason: str


@dataclass(frozen=True, slots=True)
class Reject:
    """A handshake (or frame) refused, with the reason; decodable across protocol versions."""

    reason: str


@dataclass(frozen=True, slots=True)
class Registration:
    """Push, D to P: write this transfer's KV for block positions ``first_position..`` into
    these blocks, in `expected_batches` WRITEs (`OPEN_BATCHES`: as many as P makes; P's
    batches must still tile the blocks x layers exactly).

    D already holds the KV of the positions before `first_position` (a prefix-cache hit): P
    writes nothing of them.  No blocks (and no WRITE expected) means D needs nothing at all;
    the registration is then also D's verdict, and P releases its blocks as soon as its KV is
    final, without writing.
    """

    key: TransferKey
    block_ids: tuple[int, ...]
    expected_batches: int
    ttl: float
    first_position: int = 0


@dataclass(frozen=True, slots=True)
class Ready:
    """Pull, P to D: the KV of block positions ``first_position..`` is ready in these blocks;
    read them (P holds no KV of the positions before: a sliding window's, freed)."""

    key: TransferKey
    block_ids: tuple[int, ...]
    first_position: int = 0


@dataclass(frozen=True, slots=True)
class Claim:
    """Pull, D to P: I am the decode side of this transfer; tell me where to read.

    P may have made the KV ready for a decode engine it does not know (a sequential router
    handed P's answer to D): the first associated peer that claims the exact transfer id and
    epoch becomes its peer; another claimant is refused.  The transfer id is the capability, so
    it must be unguessable; the control plane authenticates who claims it.
    """

    key: TransferKey


@dataclass(frozen=True, slots=True)
class Notice:
    """Either direction: this side gave up on the transfer (`outcome`: ABORTED, FAILED or EXPIRED)."""

    key: TransferKey
    outcome: Outcome
    reason: str


@dataclass(frozen=True, slots=True)
class Quiesced:
    """From the initiator: nothing of this transfer is in flight, and nothing more will be."""

    key: TransferKey


@dataclass(frozen=True, slots=True)
class Done:
    """D to P: the transfer completed (push: acknowledgement; pull: P may release)."""

    key: TransferKey


@dataclass(frozen=True, slots=True)
class FirstToken:
    """P to D: the first token P sampled for this transfer's request (a router that streams it
    to the client from P asked for it); D's request continues from it instead of drawing its own.
    Not about the transfer's bytes, so not the core's business: the engine hands it to its host."""

    key: TransferKey
    token: int


Message = Registration | Ready | Claim | Notice | Quiesced | Done  # about one transfer: the core's business
# everything a control channel carries
ControlMessage = Message | Hello | Heartbeat | Goodbye | Reject | FirstToken


@dataclass(frozen=True, slots=True)
class Seal:
    """What one WRITE carried, in its notification when P's integrity check is on: the D blocks
    (in position order) and layers it wrote, where its P blocks land in them (`count` P blocks,
    the first at fine position `start` of D's first block when block sizes differ: the
    planner's `fine_start`), and XXH3-64 digests of P's KV for each layer and each of those D
    blocks (`kvflow.runtime.integrity`)."""

    blocks: tuple[int, ...]
    layers: tuple[int, int] | None
    start: int
    count: int
    layer_digests: tuple[tuple[int, int], ...]  # (layer, digest), by layer
    block_digests: tuple[tuple[int, int], ...]  # (D block, digest), by block


def _pack_digests(pairs: tuple[tuple[int, int], ...]) -> list[Any]:
    return [[key for key, _ in pairs], b"".join(digest.to_bytes(8, "little") for _, digest in pairs)]


def _digests(ids: Any, packed: Any, limit: int) -> tuple[tuple[int, int], ...]:
    if (
        not isinstance(ids, list)
        or not isinstance(packed, bytes)
        or len(ids) > MAX_BLOCKS
        or len(packed) != 8 * len(ids)
        or any(type(i) is not int or not 0 <= i <= limit for i in ids)
    ):
        raise PeerProtocolError("notification's digests are not ids with 8 bytes each")
    return tuple((i, int.from_bytes(packed[8 * n : 8 * n + 8], "little")) for n, i in enumerate(ids))


def _seal_from(value: Any) -> Seal:
    if not isinstance(value, list) or len(value) != 8:
        raise PeerProtocolError("notification's seal is not [blocks, layers, start, count, digests by layer, by block]")
    blocks, layers, start, count = value[:4]
    if (
        not isinstance(blocks, list)
        or not 0 < len(blocks) <= MAX_BLOCKS
        or any(type(b) is not int or not 0 <= b <= MAX_BLOCK_ID for b in blocks)
        or len(set(blocks)) != len(blocks)
        or not (layers is None or (isinstance(layers, list) and len(layers) == 2))
        or any(type(x) is not int or not 0 <= x <= MAX_LAYER for x in layers or ())
        or (layers is not None and layers[0] >= layers[1])
        or type(start) is not int
        or type(count) is not int
        or not 0 <= start < MAX_BLOCKS
        or not 0 < count <= MAX_BLOCKS
    ):
        raise PeerProtocolError("notification's seal names blocks, layers or positions out of range, or a block twice")
    return Seal(
        tuple(blocks),
        None if layers is None else (layers[0], layers[1]),
        start,
        count,
        _digests(value[4], value[5], MAX_LAYER),
        _digests(value[6], value[7], MAX_BLOCK_ID),
    )


def encode_notification(key: TransferKey, batch: int, last: bool = False, seal: Seal | None = None) -> bytes:
    """The payload one WRITE carries so that D can count it against the right transfer; `last`
    marks P's last batch (so D knows the count when it registered `OPEN_BATCHES`), `seal` what
    the WRITE carried (P's integrity check on).

    :raises InvalidBatch: with its seal, the payload is over `MAX_NOTIFICATION_BYTES`.
    """
    fields: list[Any] = [NOTIFICATION_TAG, key.transfer_id, key.epoch, batch, last]
    if seal is not None:
        layers = None if seal.layers is None else list(seal.layers)
        fields.append(
            [list(seal.blocks), layers, seal.start, seal.count]
            + _pack_digests(seal.layer_digests)
            + _pack_digests(seal.block_digests)
        )
    payload: bytes = msgpack.packb(fields)
    if len(payload) > MAX_NOTIFICATION_BYTES:
        raise InvalidBatch(
            f"{key}: a notification with the digests of {len(seal.blocks) if seal else 0} blocks takes "
            f"{len(payload)} bytes, over {MAX_NOTIFICATION_BYTES}: push in smaller batches"
        )
    return payload


def decode_notification(payload: bytes) -> tuple[TransferKey, int, bool, Seal | None]:
    """Parse a WRITE notification: (key, batch index, whether it is P's last batch, its seal).

    :raises PeerProtocolError: for any payload that is not exactly what `encode_notification`
        produces (wrong size, type, tag, or numbers out of range).
    """
    if not isinstance(payload, bytes | bytearray) or len(payload) > MAX_NOTIFICATION_BYTES:
        raise PeerProtocolError("notification is not bytes or is too large")
    try:
        value = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises ExtraData, ValueError, UnicodeDecodeError, ...
        raise PeerProtocolError(f"notification is not valid msgpack: {type(exc).__name__}") from exc
    if (
        not isinstance(value, list)
        or len(value) not in (5, 6)
        or value[0] != NOTIFICATION_TAG
        or not isinstance(value[1], str)
        or not value[1]
        or type(value[2]) is not int
        or type(value[3]) is not int
        or value[2] < 0
        or value[3] < 0
        or type(value[4]) is not bool
    ):
        raise PeerProtocolError("notification does not have the shape [tag, transfer_id, epoch, batch, last]")
    seal = _seal_from(value[5]) if len(value) == 6 else None
    return TransferKey(value[1], value[2]), value[3], value[4], seal
