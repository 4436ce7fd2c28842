"""The control-plane codec: exact round trips, and only PeerProtocolError for anything else."""

from __future__ import annotations

import contextlib

import hypothesis.strategies as st
import msgpack
import pytest
from hypothesis import given, settings

from kvflow.control import wire
from kvflow.errors import ConfigError, PeerProtocolError, UnsupportedVersion
from kvflow.layout import fingerprint, layout_to_wire
from kvflow.protocol.messages import (
    MAX_BLOCK_ID,
    MAX_BLOCKS,
    MAX_EPOCH,
    MAX_POSITION,
    MAX_TOKEN_ID,
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
    require_engine_id,
)
from kvflow.protocol.state import Outcome
from kvflow_tools.testing import SMALL_SPEC, KVBuffers

LAYOUT = layout_to_wire(KVBuffers(SMALL_SPEC, 8).layout)
ids = st.text(min_size=1, max_size=40)  # transfer ids: any text
engine_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,39}", fullmatch=True)
keys = st.builds(TransferKey, ids, st.integers(0, 2**63 - 1))
blocks = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=64).map(tuple)
text = st.text(max_size=200)
messages: st.SearchStrategy[ControlMessage] = st.one_of(
    st.builds(Registration, keys, blocks, st.integers(1, 64), st.floats(0.001, 1e6), st.integers(0, 2**31 - 1)),
    st.builds(Registration, keys, st.just(()), st.just(0), st.floats(0.001, 1e6), st.integers(0, 2**31 - 1)),
    st.builds(Ready, keys, blocks),
    st.builds(Notice, keys, st.sampled_from(wire.OUTCOMES), text),
    st.builds(Quiesced, keys),
    st.builds(Done, keys),
    st.builds(Claim, keys),
    st.builds(FirstToken, keys, st.integers(0, MAX_TOKEN_ID)),
    st.builds(Heartbeat, st.lists(keys, max_size=20).map(tuple)),
    st.builds(Goodbye, text),
    st.builds(Reject, text),
    st.builds(
        Hello,
        engine_ids,
        st.just(fingerprint(SMALL_SPEC)),
        st.just(LAYOUT),
        st.binary(max_size=600),
        st.booleans(),
        st.text(max_size=60),
        st.integers(0, 2**63 - 1),
    ),
)
envelopes = st.builds(
    wire.Envelope, engine_ids, st.integers(0, 2**63 - 1), engine_ids, st.integers(0, 2**63 - 1), messages
)


@given(envelopes)
def test_every_message_round_trips(envelope: wire.Envelope) -> None:
    assert wire.decode(wire.encode(envelope)) == envelope


@settings(max_examples=2000)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_the_protocol_error(data: bytes) -> None:
    with pytest.raises(PeerProtocolError):
        wire.decode(data)


@settings(max_examples=1000)
@given(envelopes, st.data())
def test_mutated_frames_decode_to_a_valid_message_or_raise_the_protocol_error(
    envelope: wire.Envelope, data: st.DataObject
) -> None:
    frame = bytearray(wire.encode(envelope))
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, max(len(frame) - 1, 0)))
        if kind == "flip" and frame:
            frame[at] ^= data.draw(st.integers(1, 255))
        elif kind == "cut":
            del frame[at:]
        else:
            frame[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        decoded = wire.decode(bytes(frame))
    except PeerProtocolError:
        return
    assert isinstance(decoded, wire.Envelope)  # a mutation that still spells a valid envelope


@settings(max_examples=500)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text() | st.binary(),
        lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=5), c, max_size=5),
    )
)
def test_well_formed_msgpack_of_the_wrong_shape_is_refused(value: object) -> None:
    for body in (value, [value], [value] * 5):
        for code in range(9):
            frame = msgpack.packb([wire.MAGIC, wire.VERSION, "a", 1, "b", 1, code, body, 0], use_bin_type=True)
            with contextlib.suppress(PeerProtocolError):
                wire.decode(frame)


def test_a_notice_outcome_travels_as_its_value_and_decodes_to_the_enum() -> None:
    notice = wire.Envelope("a", 1, "b", 1, Notice(TransferKey("t", 1), Outcome.EXPIRED, "late"))
    frame = wire.encode(notice)
    assert msgpack.unpackb(frame)[7][2] == "expired"
    decoded = wire.decode(frame).message
    assert isinstance(decoded, Notice) and decoded.outcome is Outcome.EXPIRED
    # unknown values, "succeeded" (a notice reports giving up) and other types are refused
    refusal = r"notice outcome must be one of \['aborted', 'failed', 'expired'\]"
    for outcome in ("exploded", "succeeded", "ABORTED", 1, None, b"aborted"):
        bad = msgpack.packb([wire.MAGIC, wire.VERSION, "a", 1, "b", 1, 4, ["t", 1, outcome, ""], 0], use_bin_type=True)
        with pytest.raises(PeerProtocolError, match=refusal):
            wire.decode(bad)


def test_a_first_token_is_a_vocabulary_entry_and_anything_else_is_refused() -> None:
    token = wire.Envelope("a", 1, "b", 1, FirstToken(TransferKey("t", 3), 1023))
    frame = wire.encode(token)
    assert msgpack.unpackb(frame)[6:8] == [10, ["t", 3, 1023]]
    assert wire.decode(frame).message == FirstToken(TransferKey("t", 3), 1023)
    for body, refusal in (
        (["t", 3, -1], "first token"),
        (["t", 3, MAX_TOKEN_ID + 1], "first token"),
        (["t", 3, "7"], "first token"),
        (["t", 3, True], "first token"),
        (["t", 3], "first token"),
        (["", 3, 7], "transfer id"),
    ):
        bad = msgpack.packb([wire.MAGIC, wire.VERSION, "a", 1, "b", 1, 10, body, 0], use_bin_type=True)
        with pytest.raises(PeerProtocolError, match=refusal):
            wire.decode(bad)


def test_limits_and_versions() -> None:
    big = wire.Envelope("a", 1, "b", 1, Goodbye("x" * wire.MAX_FRAME_BYTES))
    with pytest.raises(PeerProtocolError, match="exceeds"):
        wire.encode(big)
    with pytest.raises(PeerProtocolError, match="bytes of at most"):
        wire.decode(b"\x00" * (wire.MAX_FRAME_BYTES + 1))
    for other in (wire.VERSION - 1, wire.VERSION + 1):
        frame = msgpack.packb([wire.MAGIC, other, "peer", 1, "me", 1, 2, []])
        with pytest.raises(
            UnsupportedVersion,
            match=f"'peer' speaks control protocol version {other}; this engine speaks {wire.VERSION}",
        ):
            wire.decode(frame)
    reject = msgpack.packb([wire.MAGIC, wire.VERSION + 1, "peer", 1, "me", 1, 0, ["too old"]])
    assert wire.decode(reject).message == Reject("too old")  # readable across versions
    # a later version may append fields: its REJECT stays readable, its receiver incarnation unread
    later = msgpack.packb([wire.MAGIC, wire.VERSION + 1, "peer", 1, "me", 1, 0, ["too old"], 77, "new"])
    assert wire.decode(later) == wire.Envelope("peer", 1, "me", 1, Reject("too old"), 0)


def test_the_envelope_names_the_receivers_run() -> None:
    bound = wire.Envelope("a", 1, "b", 2, Goodbye("x"), receiver_incarnation=12345)
    frame = wire.encode(bound)
    assert msgpack.unpackb(frame)[8] == 12345 and wire.decode(frame) == bound
    without = msgpack.packb([wire.MAGIC, wire.VERSION, "a", 1, "b", 2, 8, ["x"]])  # version 2's layout
    with pytest.raises(PeerProtocolError, match=f"an envelope of version {wire.VERSION} has 9 fields"):
        wire.decode(without)
    for bad in (-1, "1", 1.5, None, MAX_EPOCH + 1):
        with pytest.raises(PeerProtocolError, match="receiver incarnation must be an integer"):
            wire.decode(msgpack.packb([wire.MAGIC, wire.VERSION, "a", 1, "b", 2, 8, ["x"], bad]))
    nan_body = ["t", 1, wire.pack_blocks((1,)), 1, float("nan"), 0]
    nan_ttl = msgpack.packb([wire.MAGIC, wire.VERSION, "a", 1, "b", 1, 2, nan_body, 0], use_bin_type=True)
    with pytest.raises(PeerProtocolError, match="ttl"):
        wire.decode(nan_ttl)
    ext = msgpack.packb([wire.MAGIC, wire.VERSION, "a", 1, "b", 1, 5, [msgpack.ExtType(1, b"x"), 1], 0])
    with pytest.raises(PeerProtocolError):
        wire.decode(ext)
    broken_layout = dict(LAYOUT, num_blocks=-1)
    hello = msgpack.packb(
        [wire.MAGIC, wire.VERSION, "a", 1, "b", 1, 1, ["a", {}, broken_layout, b"", False, "", 0], 0], use_bin_type=True
    )
    with pytest.raises(PeerProtocolError, match="layout"):
        wire.decode(hello)
    odd_memory = dict(LAYOUT, regions=[[r[0], r[1], "XRAM", r[3]] for r in LAYOUT["regions"]])
    hello = msgpack.packb(
        [wire.MAGIC, wire.VERSION, "a", 1, "b", 1, 1, ["a", {}, odd_memory, b"", False, "", 0], 0], use_bin_type=True
    )
    with pytest.raises(PeerProtocolError, match=r"layout region memory must be one of \['DRAM', 'VRAM'\], not 'XRAM'"):
        wire.decode(hello)


BAD_ENGINE_IDS = ["../evil", "a/b", "a\x00b", "", "x" * 129, "-lead", " space", "tab\t", "dot/../x", "é"]


@pytest.mark.parametrize("bad", BAD_ENGINE_IDS)
def test_engine_ids_outside_the_strict_set_are_refused_where_they_come_in(bad: str) -> None:
    # An engine id becomes part of file and socket names on the receiving host.
    good_hello = ["P", fingerprint(SMALL_SPEC), LAYOUT, b"", False, "", 0]
    for field, frame in (
        ("sender", [wire.MAGIC, wire.VERSION, bad, 1, "D", 1, 8, ["bye"], 0]),
        ("receiver", [wire.MAGIC, wire.VERSION, "P", 1, bad, 1, 8, ["bye"], 0]),
        ("engine id", [wire.MAGIC, wire.VERSION, "P", 1, "D", 1, 1, [bad, *good_hello[1:]], 0]),
    ):
        with pytest.raises(PeerProtocolError, match=f"{field} (must|may hold only)"):
            wire.decode(msgpack.packb(frame, use_bin_type=True))
    assert wire.decode(msgpack.packb([wire.MAGIC, wire.VERSION, "P", 1, "D", 1, 1, good_hello, 0])).sender == "P"
    with pytest.raises(ConfigError, match="engine id"):
        require_engine_id(bad)


def test_a_registration_names_no_block_exactly_when_it_expects_no_write() -> None:
    """An empty registration (D needs nothing) expects no WRITE; a WRITE without blocks, or a
    negative first position, is refused as malformed (blocks with a count of 0 leave the count
    open to P: see `OPEN_BATCHES`)."""
    for blocks, batches, first in (((), 1, 0), ((1,), 1, -1), ((1,), 1, 2**31)):
        body = ["t", 1, wire.pack_blocks(blocks), batches, 1.0, first]
        frame = msgpack.packb([wire.MAGIC, wire.VERSION, "a", 1, "b", 1, 2, body, 0], use_bin_type=True)
        with pytest.raises(PeerProtocolError, match="expected batches|first position|block ids"):
            wire.decode(frame)
    empty = wire.Envelope("a", 1, "b", 1, Registration(TransferKey("t", 1), (), 0, 1.0, 3))
    assert wire.decode(wire.encode(empty)) == empty


def frame_of(code: int, body: list[object]) -> bytes:
    return msgpack.packb([wire.MAGIC, wire.VERSION, "a", 1, "b", 1, code, body, 0], use_bin_type=True)


def test_block_ids_and_heartbeat_epochs_travel_packed_and_are_checked_as_such() -> None:
    ready = wire.Envelope("a", 1, "b", 1, Ready(TransferKey("t", 1), (0, 7, MAX_BLOCK_ID)))
    body = msgpack.unpackb(wire.encode(ready))[7]
    assert body[2] == bytes([0, 0, 0, 0, 7, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0x7F])  # uint32, little-endian
    beat = wire.Envelope("a", 1, "b", 1, Heartbeat((TransferKey("x", 1), TransferKey("y", MAX_EPOCH))))
    assert msgpack.unpackb(wire.encode(beat))[7] == [["x", "y"], bytes([1] + [0] * 7) + bytes([0xFF] * 7 + [0x7F])]
    # the largest block list there is fits a frame
    most = wire.Envelope("a", 1, "b", 1, Ready(TransferKey("t", 1), tuple(range(MAX_BLOCKS))))
    assert wire.decode(wire.encode(most)) == most
    for blocks, problem in (
        ([1, 2], "block ids must be packed 4-byte"),  # the list of earlier versions
        (b"\x01\x00\x00", "block ids must be packed 4-byte"),  # not a whole id
        (b"\x00" * 4 * (MAX_BLOCKS + 1), "not msgpack|block ids must be packed"),
        (b"\x00\x00\x00\x80", f"block ids must each be at most {MAX_BLOCK_ID}"),
        (b"", "block ids must not be empty"),
    ):
        with pytest.raises(PeerProtocolError, match=problem):
            wire.decode(frame_of(3, ["t", 1, blocks, 0]))
    # a Ready names the position of its first block: a sliding window's P holds no KV before it
    ready = wire.Envelope("a", 1, "b", 1, Ready(TransferKey("t", 1), (4, 5), first_position=3))
    assert wire.decode(wire.encode(ready)) == ready
    for first in (-1, MAX_POSITION + 1, "3", 1.0):
        with pytest.raises(PeerProtocolError, match="first position"):
            wire.decode(frame_of(3, ["t", 1, wire.pack_blocks((4,)), first]))
    epoch = bytes(8)
    for tids, epochs, problem in (
        (["x"], epoch * 2, "names 1 transfer ids but 2 epochs"),
        (["x", "y"], epoch, "names 2 transfer ids but 1 epochs"),
        (["x"], b"\x00" * 7 + b"\x80", f"heartbeat epochs must each be at most {MAX_EPOCH}"),
        (["x"], [0], "heartbeat epochs must be packed 8-byte"),
        ([""], epoch, "transfer ids must be strings of 1..256"),
        ([1], epoch, "transfer ids must be strings of 1..256"),
        (["x" * 257], epoch, "transfer ids must be strings of 1..256"),
        (["x", 1], epoch * 2, "transfer ids must be strings of 1..256"),
        # one heartbeat names at most 4,096 keys: decoding a key costs a Python object
        (["x"] * 4097, epoch * 4097, "at most 4096 items"),
    ):
        with pytest.raises(PeerProtocolError, match=problem):
            wire.decode(frame_of(7, [tids, epochs]))


def test_a_value_a_packed_field_cannot_carry_is_refused_when_encoding() -> None:
    for message in (
        Ready(TransferKey("t", 1), (2**32,)),
        Ready(TransferKey("t", 1), (-1,)),
        Heartbeat((TransferKey("t", 2**64),)),
        Heartbeat((TransferKey("t", -1),)),
    ):
        with pytest.raises(PeerProtocolError, match="cannot pack"):
            wire.encode(wire.Envelope("a", 1, "b", 1, message))
