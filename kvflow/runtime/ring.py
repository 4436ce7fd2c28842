"""A single-producer, single-consumer ring of records in shared memory, without system calls.

Why: it is how a host's hooks and its engine process talk. A hook that wrote its orders to a
socket paid a system call, and on a busy host the wake-up of the engine process that came with
it (the woken process took the hook's core in the middle of the hook: 90-150 µs per write
measured under `kvflow bench vllm`); reading the answers cost another call per step. With a ring
per direction the hook copies its record into shared memory and moves on; the reader finds it
there. The engine process sleeps between bursts of work, so the writer owes it a wake-up (an
eventfd write, which the driver makes) only once per sleep: the reader says when it goes to
sleep (`RingReader.sleep`), and `RingWriter.wake_owed` says whether this sleep has been
interrupted already. The host reads its ring of answers on every step; it sleeps on it only in
a step with nothing to do but wait for its engine, and the engine process then owes it one
wake-up per such sleep, the same way.

Pure: no system call, no clock.  The driver (`kvflow.runtime.process`, `engine_process`) maps
the memory, makes the wake-up and decides what a ring that stays unreadable means.

Layout, little-endian: a header of `HEADER` bytes, each field on its own 64-byte line and each
written by one side only: the writer's ``head`` (u64 at 0: bytes ever written), the reader's
``tail`` (u64 at 64: bytes ever consumed), the reader's ``sleeps`` (u64 at 128: odd while it is
asleep, bumped on every change), the capacity (u64 at 192, written once by the creator); then
the records.  A record is a 16-byte header (u32 length, u32 checksum, u64 sequence number) and
its payload, padded to 16 bytes, and never wraps: where the space left before the end is too
short, a skip record (length `SKIP`) fills it and the record starts at the beginning.

Memory ordering, by construction rather than by fences (Python has none):
- The writer stores a record's bytes, then ``head``.  A reader on a CPU that may see ``head``
  first (a weakly ordered one: Arm) finds the record's checksum, which covers its length,
  sequence number and payload, wrong: it stops there (`RingReader.stalled`) and reads the
  record whole on a later pass.  Sequence numbers make a stale record from the previous lap
  fail the same way.  On x86 stores are seen in order and this never happens.
- The reader copies a record out, checks its checksum on the copy, and only then stores
  ``tail``: the store depends on a branch taken on the loaded bytes, and no CPU makes a store
  visible before the branch it depends on is resolved, so the writer never reuses space the
  reader has not finished reading.  The writer's own stores into freed space likewise depend
  on its check of ``tail``.
- A wake-up can be missed when the writer's store of ``head`` and the reader's store of
  ``sleeps`` pass each other's loads (store buffers: every CPU allows it).  The writer checks
  again on its next pass (`wake_owed` on a ring the reader has not drained), and the reader
  looks at the ring on a timer as well, so a missed wake-up delays a record, never loses it.

A checksum that stays wrong is corruption (the memory is not this protocol's, or the other side
is hostile): the driver refuses the ring.
"""

from __future__ import annotations

import struct
import zlib

from kvflow.errors import ConfigError, RingCorrupt

__all__ = ("ALIGN", "HEADER", "RECORD_HEADER", "SKIP", "RingReader", "RingWriter", "ring_bytes")

HEADER = 256
ALIGN = 16
SKIP = 0xFFFFFFFF
_RECORD = struct.Struct("<IIQ")  # length, checksum, sequence number
RECORD_HEADER = _RECORD.size
_U64 = struct.Struct("<Q")
_HEAD, _TAIL, _SLEEPS, _CAPACITY = 0, 64, 128, 192
_SEAL = struct.Struct("<IQ")  # what a record's checksum covers besides its payload


def ring_bytes(capacity: int) -> int:
    """The shared bytes a ring of `capacity` record bytes takes (header included)."""
    return HEADER + capacity


def _checksum(length: int, sequence: int, payload: bytes | memoryview = b"") -> int:
    return zlib.crc32(payload, zlib.crc32(_SEAL.pack(length, sequence)))


def _padded(length: int) -> int:
    return RECORD_HEADER + -(-length // ALIGN) * ALIGN


class _Ring:
    def __init__(self, buffer: memoryview, create: bool) -> None:
        """:raises ConfigError: `buffer` is too small, or (`create` False) holds another ring's size."""
        capacity = len(buffer) - HEADER
        if capacity < 4 * ALIGN or capacity % ALIGN:
            raise ConfigError(f"a ring needs a multiple of {ALIGN} bytes past its header, not {capacity}")
        self._buffer = buffer
        self.capacity = capacity
        if create:
            buffer[:HEADER] = bytes(HEADER)
            _U64.pack_into(buffer, _CAPACITY, capacity)
        elif _U64.unpack_from(buffer, _CAPACITY)[0] != capacity:
            raise ConfigError(f"the shared ring says {_U64.unpack_from(buffer, _CAPACITY)[0]} bytes, not {capacity}")
        self.max_record = capacity // 2 - RECORD_HEADER  # a record always fits once the ring is drained

    def _load(self, offset: int) -> int:
        value: int = _U64.unpack_from(self._buffer, offset)[0]
        return value


class RingWriter(_Ring):
    """The producing side of a ring (one thread at a time; the caller serialises)."""

    def __init__(self, buffer: memoryview, *, create: bool = False) -> None:
        """:raises ConfigError: see `_Ring`."""
        super().__init__(buffer, create)
        self._head = self._load(_HEAD)
        self._sequence = 0
        self._woken = -1  # the reader's sleep this writer has woken it from

    def write(self, payload: bytes) -> bool:
        """Append one record; False if the ring has no room for it now (nothing is written).

        :raises ConfigError: the record is longer than `max_record`.
        :raises RingCorrupt: the reader's ``tail`` is not a position this ring has had.
        """
        length = len(payload)
        if length > self.max_record:
            raise ConfigError(f"a record of {length} bytes is longer than the ring's {self.max_record}")
        size = _padded(length)
        used = self._head - self._load(_TAIL)
        if not 0 <= used <= self.capacity:
            raise RingCorrupt(f"the ring's reader is at {self._head - used}, outside 0..{self._head}")
        at = self._head % self.capacity
        skip = self.capacity - at if self.capacity - at < size else 0
        if used + skip + size > self.capacity:
            return False
        sequence = self._sequence
        if skip:
            _RECORD.pack_into(self._buffer, HEADER + at, SKIP, _checksum(SKIP, sequence), sequence)
            at = 0
        start = HEADER + at + RECORD_HEADER
        self._buffer[start : start + length] = payload
        _RECORD.pack_into(self._buffer, HEADER + at, length, _checksum(length, sequence, payload), sequence)
        self._sequence = sequence + 1
        self._head += skip + size
        _U64.pack_into(self._buffer, _HEAD, self._head)  # last: the record is whole before it is announced
        return True

    def unread(self) -> bool:
        """Whether the reader has records of this writer it has not consumed yet."""
        return self._load(_TAIL) != self._head

    def wake_owed(self) -> bool:
        """Whether the reader sleeps and nobody has woken it from this sleep yet; True once per
        sleep (the caller then wakes it).  Never raises."""
        sleeps = self._load(_SLEEPS)
        if sleeps % 2 == 0 or sleeps == self._woken:
            return False
        self._woken = sleeps
        return True


class RingReader(_Ring):
    """The consuming side of a ring."""

    def __init__(self, buffer: memoryview, *, create: bool = False) -> None:
        """:raises ConfigError: see `_Ring`."""
        super().__init__(buffer, create)
        self._tail = self._load(_TAIL)
        self._sequence = 0
        self._sleeps = self._load(_SLEEPS)
        self.stalled = False  # the last `read` stopped at a record not (yet) whole
        self._stall: tuple[int, float] | None = None  # (position, since when) of the record it stopped at

    def pending(self) -> bool:
        """Whether the writer has announced records not read yet."""
        return self._load(_HEAD) != self._tail

    def read(self, limit: int = 1 << 30) -> list[bytes]:
        """The records announced since the last call, in order, at most `limit` of them; stops
        early (and sets `stalled`) at a record whose checksum or sequence number is wrong.

        :raises RingCorrupt: the writer's ``head`` is not a position this ring can have.
        """
        head = self._load(_HEAD)
        if not 0 <= head - self._tail <= self.capacity:
            raise RingCorrupt(f"the ring's writer is at {head}, outside {self._tail}..{self._tail + self.capacity}")
        records: list[bytes] = []
        self.stalled = False
        start_tail = self._tail
        while self._tail < head and len(records) < limit:
            at = self._tail % self.capacity
            length, checksum, sequence = _RECORD.unpack_from(self._buffer, HEADER + at)
            if sequence != self._sequence:
                self.stalled = True
                break
            if length == SKIP:
                if checksum != _checksum(SKIP, sequence) or self._tail + self.capacity - at > head:
                    self.stalled = True
                    break
                self._tail += self.capacity - at
                continue
            size = _padded(length) if length <= self.max_record else self.capacity + 1
            if at + size > self.capacity or self._tail + size > head:
                self.stalled = True
                break
            start = HEADER + at + RECORD_HEADER
            payload = bytes(self._buffer[start : start + length])
            if _checksum(length, sequence, payload) != checksum:
                self.stalled = True
                break
            records.append(payload)
            self._sequence = sequence + 1
            self._tail += size
        if self._tail != start_tail:
            _U64.pack_into(self._buffer, _TAIL, self._tail)  # after the checks on the copies: see the header
        return records

    def stalled_for(self, now: float) -> float:
        """How long, on the caller's clock (`now`), the reader has been stopped at the same
        record not whole: 0 when the last `read` was not stopped.  A record that stays so is
        corruption, not a store still on its way.  Never raises."""
        if not self.stalled:
            self._stall = None
            return 0.0
        if self._stall is None or self._stall[0] != self._tail:
            self._stall = (self._tail, now)
        return now - self._stall[1]

    @property
    def position(self) -> int:
        """Bytes consumed so far (a reader stuck at one position for long reads a corrupt ring)."""
        return self._tail

    def sleep(self) -> None:
        """Say this reader is about to wait for a wake-up (look at `pending` once more after)."""
        if self._sleeps % 2 == 0:
            self._sleeps += 1
            _U64.pack_into(self._buffer, _SLEEPS, self._sleeps)

    def wake(self) -> None:
        """Say this reader is awake (it reads the ring without being woken)."""
        if self._sleeps % 2:
            self._sleeps += 1
            _U64.pack_into(self._buffer, _SLEEPS, self._sleeps)
