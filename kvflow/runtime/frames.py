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
from kvflow.runtime.fd_passing import FdInbox

__all__ = (
    "MAX_FRAME",
    "READ_CHUNK",
    "FrameReader",
    "decode_record",
    "encode_frame",
    "encode_record",
    "error_from_record",
    "error_record",
)

MAX_FRAME = 256 << 20  # one frame's msgpack body, at most
READ_CHUNK = 256 << 10  # bytes read from the socket at a time, into a buffer kept for it
_LENGTH = struct.Struct(">I")


def encode_frame(records: Any) -> bytes:
    """One frame: its length, then the msgpack of `records`."""
    body: bytes = msgpack.packb(records, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


def encode_record(record: Any) -> bytes:
    """One record, packed on its own (a ring record), so that a record that cannot be packed
    fails alone, before it is queued with others.

    :raises ConfigError: a value msgpack cannot carry (an integer past 64 bits, a lone surrogate).
    """
    try:
        packed: bytes = msgpack.packb(record, use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot send {record[:3]!r:.200} to the engine process: {exc}") from None
    return packed


def decode_record(packed: bytes) -> Any:
    """What `encode_record` (or a frame's body) packed.

    :raises ValueError: not msgpack, or more than one value.
    :raises msgpack.UnpackException: the bytes end inside a value.
    """
    return msgpack.unpackb(packed, raw=False, use_list=True, strict_map_key=False)


class FrameReader:
    """Cuts a byte stream into frames and unpacks each (`feed` returns the complete ones)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._chunk = bytearray(READ_CHUNK)
        self._view = memoryview(self._chunk)

    def read(self, sock: socket.socket, inbox: FdInbox | None = None) -> tuple[int, list[Any]]:
        """Read what `sock` has (up to `READ_CHUNK`) into the kept buffer, with no allocation
        of its own (``recv(n)`` allocates n bytes on every call, 1 MiB cost 50-100 µs): the
        bytes read (0: the peer closed) and the frames now complete.  Descriptors that come
        attached join `inbox` (without one, none may come).

        :raises BlockingIOError: nothing to read (a non-blocking socket).
        :raises OSError: the socket failed.
        :raises KVFlowError: see `feed`.
        """
        count = sock.recv_into(self._view) if inbox is None else inbox.read(sock, self._view)
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
            frames.append(decode_record(body))
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
