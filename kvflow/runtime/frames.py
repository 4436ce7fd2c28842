"""Records and frames between a host and its engine process: how each is packed and read back.

Why apart from `process`: both ends use them (the host in `process`, the child in
`engine_process`), and the embedder's agent answers errors the same way.  A record is a msgpack
array of plain types; a frame (on the socket that carries the link's life) is a 4-byte
big-endian length and a msgpack array of records; an error crosses as its class name and
message and comes back as the `KVFlowError` of that name.  Nothing but msgpack's plain types
crosses.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import Any

import msgpack

import kvflow.errors as errors
from kvflow.errors import ConfigError, KVFlowError

__all__ = (
    "MAX_FRAME",
    "READ_CHUNK",
    "FrameReader",
    "encode_frame",
    "encode_record",
    "error_from_record",
    "error_record",
    "frame_of",
)

MAX_FRAME = 256 << 20  # one frame's msgpack body, at most
READ_CHUNK = 256 << 10  # bytes read from the socket at a time, into a buffer kept for it
_LENGTH = struct.Struct(">I")


def encode_frame(records: Any) -> bytes:
    """One frame: its length, then the msgpack of `records`."""
    body: bytes = msgpack.packb(records, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


def encode_record(record: Any) -> bytes:
    """One record of a frame, packed on its own (`frame_of` joins them), so that a record that
    cannot be packed fails alone, before it is queued with others.

    :raises ConfigError: a value msgpack cannot carry (an integer past 64 bits, a lone surrogate).
    """
    try:
        packed: bytes = msgpack.packb(record, use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot send {record[:3]!r:.200} to the engine process: {exc}") from None
    return packed


def frame_of(records: Sequence[bytes]) -> bytes:
    """The frame of records packed by `encode_record`: the same bytes `encode_frame` makes."""
    packer = msgpack.Packer(use_bin_type=True)
    body = packer.pack_array_header(len(records)) + b"".join(records)
    return _LENGTH.pack(len(body)) + body


class FrameReader:
    """Cuts a byte stream into frames and unpacks each (`feed` returns the complete ones)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._chunk = bytearray(READ_CHUNK)
        self._view = memoryview(self._chunk)

    def read(self, sock: socket.socket) -> tuple[int, list[Any]]:
        """Read what `sock` has (up to `READ_CHUNK`) into the kept buffer, with no allocation
        of its own (``recv(n)`` allocates n bytes on every call, 1 MiB cost 50-100 µs): the
        bytes read (0: the peer closed) and the frames now complete.

        :raises BlockingIOError: nothing to read (a non-blocking socket).
        :raises OSError: the socket failed.
        :raises KVFlowError: see `feed`.
        """
        count = sock.recv_into(self._view)
        return count, self.feed(self._view[:count]) if count else []

    def feed(self, data: bytes | memoryview) -> list[Any]:
        """:raises KVFlowError: a frame longer than `MAX_FRAME` (the stream is not ours)."""
        self._buffer += data
        frames = []
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if length > MAX_FRAME:
                raise KVFlowError(f"engine process frame of {length} bytes exceeds {MAX_FRAME}")
            if len(self._buffer) < _LENGTH.size + length:
                break
            body = bytes(self._buffer[_LENGTH.size : _LENGTH.size + length])
            del self._buffer[: _LENGTH.size + length]
            frames.append(msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=False))
        return frames


def error_record(exc: BaseException) -> list[str]:
    """How an exception raised in the engine process travels: its class name and message."""
    return [type(exc).__name__, str(exc)]


def error_from_record(record: Sequence[Any]) -> KVFlowError:
    """The `KVFlowError` an error record names (its class when kvflow has one by that name,
    else `KVFlowError`), carrying the message the engine process gave."""
    name, message = str(record[0]), str(record[1])
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, KVFlowError)):
        cls, message = KVFlowError, f"{name}: {message}"
    exc = cls.__new__(cls)  # some classes take other arguments; the message is what travels
    Exception.__init__(exc, message)
    return exc
