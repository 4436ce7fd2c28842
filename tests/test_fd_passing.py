"""File descriptors from a host to a running child over their Unix socket (`kvflow.runtime.fd_passing`).

What an engine process maps arrives as descriptors; GPU chunks vLLM remaps after start come
back while the engine process runs, over the socket with ``SCM_RIGHTS``.  Real memory files,
real sockets, real processes: a descriptor that arrives is checked by writing through it and
reading the bytes through the sender's own; in an engine process, by its ``/proc`` entry.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from kvflow.errors import ConfigError, UsageError
from kvflow.runtime.fd_passing import MAX_FDS, FdInbox, send_fds
from kvflow.runtime.frames import FrameReader, encode_frame
from tests.test_engine_process import answered, cache, engine, until


def memory_file(name: str, text: bytes = b"") -> int:
    fd = os.memfd_create(name)
    os.ftruncate(fd, 4096)
    os.pwrite(fd, text, 0)
    return fd


def test_descriptors_cross_a_socket_in_order_and_reach_the_same_memory() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    first, second = memory_file("first", b"one"), memory_file("second", b"two")
    try:
        send_fds(ours, encode_frame([["fds", 1]]), [first], timeout=5.0)
        send_fds(ours, encode_frame([["fds", 1]]), [second], timeout=5.0)
        inbox, reader = FdInbox(), FrameReader()
        frames: list[object] = []
        while len(frames) < 2:
            frames += reader.read(theirs, inbox)[1]
        assert frames == [[["fds", 1]], [["fds", 1]]] and len(inbox) == 2
        got = inbox.take(2)
        assert [os.pread(fd, 3, 0) for fd in got] == [b"one", b"two"]  # in the order sent
        os.pwrite(got[0], b"ONE", 0)
        assert os.pread(first, 3, 0) == b"ONE"  # the same memory, not a copy
        for fd in got:
            os.close(fd)
    finally:
        for fd in (first, second):
            os.close(fd)
        ours.close()
        theirs.close()


def test_take_reads_descriptors_still_in_the_socket_and_refuses_too_few() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setblocking(False)
    inbox, reader = FdInbox(), FrameReader()
    view = memoryview(bytearray(1 << 16))

    def refill() -> None:
        with contextlib.suppress(BlockingIOError):
            inbox.read(theirs, view)

    fd = memory_file("late", b"late")
    try:
        send_fds(ours, encode_frame([["fds", 1]]), [fd], timeout=5.0)
        with pytest.raises(ConfigError, match="2 descriptors expected from the host, 1 came"):
            inbox.take(2, refill, timeout=0.05)
        assert len(inbox) == 1  # none taken
        (got,) = inbox.take(1)
        assert os.pread(got, 4, 0) == b"late"
        os.close(got)
        with pytest.raises(ConfigError, match="at most 252"):
            send_fds(ours, b"x", [fd] * (MAX_FDS + 1), timeout=1.0)
        with pytest.raises(ConfigError, match="0 bytes"):
            send_fds(ours, b"", [fd], timeout=1.0)
        del reader
    finally:
        os.close(fd)
        inbox.close()
        ours.close()
        theirs.close()


def test_a_running_child_receives_memory_files_and_writes_into_them() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import os, socket, sys
                from kvflow.runtime.fd_passing import FdInbox
                sock, inbox = socket.socket(fileno=int(sys.argv[1])), FdInbox()
                view = memoryview(bytearray(4096))
                while len(inbox) < 3:
                    if not inbox.read(sock, view):
                        sys.exit(3)
                for index, fd in enumerate(inbox.take(3)):
                    os.pwrite(fd, b"child %d" % index, 0)
                """
            ),
            str(theirs.fileno()),
        ],
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    files = [memory_file(f"sent-{i}") for i in range(3)]
    try:
        send_fds(ours, encode_frame([["fds", 3]]), files, timeout=5.0)  # after the child started
        assert child.wait(timeout=30) == 0
        assert [os.pread(fd, 7, 0) for fd in files] == [b"child 0", b"child 1", b"child 2"]
    finally:
        child.kill()
        for fd in files:
            os.close(fd)
        ours.close()


def _memory_files_of(pid: int, name: str) -> int:
    count = 0
    for entry in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/{pid}/fd/{entry}").startswith(f"/memfd:{name}")
    return count


def test_an_engine_process_takes_descriptors_beside_its_calls_and_refuses_gpu_chunks_it_does_not_map() -> None:
    process = engine("fds-0", cache())
    fd = memory_file("kvflow-sent")
    try:
        process.send_fds([fd])
        until(lambda: _memory_files_of(process.pid, "kvflow-sent") == 1, "the descriptor in the engine process")
        # host memory, no exported GPU chunk mapped there: chunks coming back are refused by name
        refused = process.call("restore_memory", [[0, 0x7F00_0000_0000, 4096]])
        answered(process, refused)
        with pytest.raises(ConfigError, match="come back to the engine process that maps them"):
            refused.result()
        # the "fds" record is no order to refuse, and the memory's own commands still serve host memory
        asleep = process.call("unregister_memory")
        answered(process, asleep)
        asleep.result()
        woken = process.call("restore_memory")
        stats = process.call("stats")
        answered(process, woken, stats)
        woken.result()
        assert stats.result()["crashed"] == 0
        unknown = process.call("no_such_command")
        answered(process, unknown)
        with pytest.raises(UsageError, match="no command"):
            unknown.result()
    finally:
        os.close(fd)
        process.close(timeout=20.0)
