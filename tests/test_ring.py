"""The ring between a host's hooks and its engine process (`kvflow.runtime.ring`).

A model of the ring (a queue of the records written) against the real one over a plain
buffer, through any sequence of writes, reads and wrap-arounds; and the faults a shared memory
can show: a record whose bytes are not all there yet (the writer's ``head`` seen before its
payload, as a weakly ordered CPU may show it), a stale record from the previous lap, torn
bytes, and a hostile ``head`` or ``tail``.  A reader never returns a record that was not
written whole.
"""

from __future__ import annotations

import struct
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvflow.errors import ConfigError, RingCorrupt
from kvflow.runtime.ring import HEADER, RECORD_HEADER, RingReader, RingWriter, ring_bytes

CAPACITY = 1024


def ring(capacity: int = CAPACITY) -> tuple[bytearray, RingWriter, RingReader]:
    memory = bytearray(ring_bytes(capacity))
    writer = RingWriter(memoryview(memory), create=True)
    return memory, writer, RingReader(memoryview(memory))


def payload(seed: int, length: int) -> bytes:
    return bytes((seed + i) % 251 for i in range(length))


class RingModel(RuleBasedStateMachine):
    """Writes and reads in any order: what comes out is what went in, in order, whole."""

    def __init__(self) -> None:
        super().__init__()
        self.memory, self.writer, self.reader = ring()
        self.written: deque[bytes] = deque()
        self.count = 0

    @rule(length=st.integers(0, CAPACITY // 2 - RECORD_HEADER))
    def write(self, length: int) -> None:
        record = payload(self.count, length)
        if self.writer.write(record):
            self.written.append(record)
            self.count += 1
        else:  # refused only for want of room: a drained ring takes any record up to max_record
            assert self.written, "an empty ring refused a record"

    @rule(limit=st.integers(1, 8))
    def read(self, limit: int) -> None:
        got = self.reader.read(limit)
        assert not self.reader.stalled
        assert got == [self.written.popleft() for _ in range(len(got))]
        assert len(got) == limit or not self.written

    @precondition(lambda self: bool(self.written))
    @rule(data=st.data())
    def a_record_not_yet_whole_is_not_read(self, data: st.DataObject) -> None:
        """Any byte of the next unread record changed (as if not yet visible): the reader stops
        before it, and reads it once the byte is back."""
        at = self.reader.position % CAPACITY
        length = struct.unpack_from("<I", self.memory, HEADER + at)[0]
        if length == 0xFFFFFFFF:  # a skip to the end first: damage the record after it
            at = 0
            length = struct.unpack_from("<I", self.memory, HEADER)[0]
        offset = HEADER + at + data.draw(st.integers(0, RECORD_HEADER + length - 1))
        original = self.memory[offset]
        self.memory[offset] ^= data.draw(st.integers(1, 255))
        assert self.reader.read() == []
        assert self.reader.stalled
        self.memory[offset] = original

    @invariant()
    def unread_matches(self) -> None:
        assert self.writer.unread() == bool(self.written)
        assert self.reader.pending() == bool(self.written)


TestRingModel = RingModel.TestCase
TestRingModel.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


@given(st.lists(st.integers(0, 300), min_size=1, max_size=40))
def test_records_of_any_length_come_out_whole_and_in_order_across_laps(lengths: list[int]) -> None:
    _, writer, reader = ring()
    for index, length in enumerate(lengths):
        assert writer.write(payload(index, length))
        assert reader.read() == [payload(index, length)]


def test_a_record_announced_before_its_bytes_is_read_once_they_land() -> None:
    """A weakly ordered CPU may show the writer's ``head`` before the record's bytes: the
    reader's checksum stops it there, and the record is read whole later."""
    memory, writer, reader = ring()
    writer.write(b"first")
    before = bytes(memory[HEADER : HEADER + 64])
    writer.write(b"second")
    after = bytes(memory[HEADER : HEADER + 64])
    assert reader.read() == [b"first", b"second"]
    memory2, writer2, reader2 = ring()
    writer2.write(b"first")
    writer2.write(b"second")
    memory2[HEADER : HEADER + 64] = before  # head says two records; the second's bytes are not there
    assert reader2.read() == [b"first"] and reader2.stalled
    memory2[HEADER : HEADER + 64] = after
    assert reader2.read() == [b"second"] and not reader2.stalled


def test_a_stale_record_from_the_last_lap_is_not_read_again() -> None:
    memory, writer, reader = ring(64)
    for record in (b"a" * 10, b"b" * 10):  # a whole lap: 32 bytes each
        assert writer.write(record)
        assert reader.read() == [record]
    struct.pack_into("<Q", memory, 0, 96)  # head claims one more record: where the first one, whole, still is
    assert reader.read() == [] and reader.stalled


def test_a_hostile_head_or_tail_is_corruption() -> None:
    memory, writer, reader = ring()
    struct.pack_into("<Q", memory, 0, CAPACITY + 16)  # head past a whole lap
    with pytest.raises(RingCorrupt, match="writer"):
        reader.read()
    memory, writer, reader = ring()
    struct.pack_into("<Q", memory, 64, 4096)  # tail ahead of head
    with pytest.raises(RingCorrupt, match="reader"):
        writer.write(b"x")


def test_a_record_longer_than_half_the_ring_is_refused_and_a_full_ring_says_so() -> None:
    _, writer, reader = ring()
    with pytest.raises(ConfigError, match="longer than"):
        writer.write(bytes(writer.max_record + 1))
    assert writer.write(bytes(writer.max_record))
    assert writer.write(bytes(writer.max_record))
    assert not writer.write(b"")  # full: nothing written
    assert len(reader.read()) == 2
    assert writer.write(b"")


def test_a_ring_of_another_size_is_refused() -> None:
    memory, _, _ = ring()
    with pytest.raises(ConfigError, match="says"):
        RingReader(memoryview(memory)[: ring_bytes(512)])
    with pytest.raises(ConfigError, match="multiple"):
        RingWriter(memoryview(bytearray(HEADER + 40)), create=True)


def test_a_sleeping_reader_is_owed_one_wake_up_per_sleep() -> None:
    _, writer, reader = ring()
    assert not writer.wake_owed()  # awake
    reader.sleep()
    assert writer.wake_owed()
    assert not writer.wake_owed()  # this sleep was interrupted already
    reader.wake()
    assert not writer.wake_owed()
    reader.sleep()
    assert writer.wake_owed()  # a new sleep


def test_a_reader_says_how_long_it_has_been_stopped_at_the_same_record() -> None:
    memory, writer, reader = ring()
    writer.write(b"torn")
    memory[HEADER + RECORD_HEADER] ^= 0xFF
    assert reader.read() == [] and reader.stalled_for(10.0) == 0.0  # stopped just now
    reader.read()
    assert reader.stalled_for(12.5) == 2.5
    memory[HEADER + RECORD_HEADER] ^= 0xFF  # the bytes land: no longer stopped
    assert reader.read() == [b"torn"] and reader.stalled_for(13.0) == 0.0
