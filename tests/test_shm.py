"""The shared-memory transport against real processes: forged notifications, the files a killed
process leaves, removing a peer while copies run, and a process out of file descriptors."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest

from kvflow.errors import TransportError
from kvflow.layout import Region
from kvflow.layout.buffers import region_of
from kvflow.protocol.actions import OpKind
from kvflow.transports.base import Completion, Notification
from kvflow.transports.shm import SHM_DIR, ShmTransport
from tests.transport_ends import whole

ROOT = Path(__file__).resolve().parent.parent
SIZE = 1 << 16
Pair = tuple[ShmTransport, ShmTransport, np.ndarray, np.ndarray]


def until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll `condition` until it holds; the timeout only guards against a hang."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.001)


def python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a child Python process (one that may crash without taking pytest along)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], env=env, text=True, capture_output=True, timeout=600
    )


@pytest.fixture
def prefix() -> Iterator[str]:
    tag = f"kvflow-shmtest-{uuid.uuid4().hex[:8]}"
    yield tag
    assert not list(SHM_DIR.glob(f"{tag}*")), "an endpoint left files behind"


@pytest.fixture
def pair() -> Iterator[Pair]:
    tag = uuid.uuid4().hex[:8]
    a, b = ShmTransport(f"a{tag}"), ShmTransport(f"b{tag}")
    a_mem, b_mem = a.allocate(SIZE), b.allocate(SIZE)
    a.register_regions([region_of(a_mem)])
    b.register_regions([region_of(b_mem)])
    a.add_peer(b.name, b.local_metadata(), [region_of(b_mem)])
    b.add_peer(a.name, a.local_metadata(), [region_of(a_mem)])
    yield a, b, a_mem, b_mem
    a.close()
    b.close()


def collect(endpoint: ShmTransport, completions: int, notes: int) -> tuple[list[Completion], list[Notification]]:
    got_c: list[Completion] = []
    got_n: list[Notification] = []

    def enough() -> bool:
        c, n = endpoint.poll()
        got_c.extend(c)
        got_n.extend(n)
        return len(got_c) >= completions and len(got_n) >= notes

    until(enough, f"{completions} completions and {notes} notifications")
    return got_c, got_n


def test_a_notification_forged_by_another_process_is_dropped(pair: Pair) -> None:
    a, b = pair[0], pair[1]
    notify = msgpack.unpackb(a.local_metadata())["notify"]
    forger = python(
        f"""
        import socket, msgpack
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.sendto(msgpack.packb([{b.name!r}, b"forged done"], use_bin_type=True), {notify!r})
        """
    )
    assert forger.returncode == 0, forger.stderr  # the datagram is queued on a's socket before b's below
    b.send_notification(a.name, b"genuine")
    _, notes = collect(a, completions=0, notes=1)
    assert notes == [Notification(b.name, b"genuine")]
    assert a.poll() == ([], [])
    assert a.rejected_notifications == 1


def test_notifications_from_a_removed_peer_are_dropped(pair: Pair) -> None:
    a, b = pair[0], pair[1]
    a.remove_peer(b.name)
    b.send_notification(a.name, b"late")
    until(lambda: a.rejected_notifications == 1, "the late notification is rejected")
    assert a.poll() == ([], [])


ENDPOINT = """
    import sys
    from kvflow.transports.shm import ShmTransport
    from kvflow.layout.buffers import region_of
    t = ShmTransport("P", prefix=sys.argv[1])
    memory = t.allocate(4096)
    t.allocate(4096)
    t.register_regions([region_of(memory)])
    print(t.local_metadata().hex(), region_of(memory).base, flush=True)
    sys.stdin.read()
"""


def start_endpoint(prefix: str) -> tuple[subprocess.Popen[str], bytes, Region]:
    """A child process with endpoint "P" of `prefix`: the child, its metadata and its region."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(ENDPOINT), prefix],
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None
    metadata, base = child.stdout.readline().split()
    return child, bytes.fromhex(metadata), Region(int(base), 4096)


def entries(prefix: str) -> list[Path]:
    return sorted(SHM_DIR.glob(f"{prefix}*"))


def test_files_of_a_sigkilled_endpoint_are_reclaimed_and_its_name_restarts(prefix: str) -> None:
    killed, _, _ = start_endpoint(f"{prefix}-a")
    alive, _, _ = start_endpoint(f"{prefix}-b")
    try:
        killed.send_signal(signal.SIGKILL)
        assert killed.wait(timeout=60) == -signal.SIGKILL
        assert entries(f"{prefix}-a"), "a killed endpoint leaves its files"
        restarted = ShmTransport("P", prefix=f"{prefix}-a")  # the same prefix and name as the dead one
        try:
            assert restarted.reclaimed >= 1
            assert [p.name for p in entries(f"{prefix}-a")] == [f"{prefix}-a-P.kvflow"]
            assert entries(f"{prefix}-b"), "a live endpoint's files are not reclaimed"
            with pytest.raises(TransportError, match="a live endpoint owns"):
                ShmTransport("P", prefix=f"{prefix}-b")
        finally:
            restarted.close()
        assert entries(f"{prefix}-a") == []
    finally:
        for child in (killed, alive):
            assert child.stdin is not None and child.stdout is not None
            child.stdin.close()
            assert child.wait(timeout=60) in (0, -signal.SIGKILL)
            child.stdout.close()
    ShmTransport("P", prefix=f"{prefix}-c").close()  # reclaims nothing alive, removes its own
    assert entries(prefix) == []


HAMMER = """
    import random, sys, threading, time
    import numpy as np
    from kvflow.errors import TransportError
    from kvflow.layout import DescriptorPlan
    from kvflow.layout.buffers import region_of
    from kvflow.protocol.actions import OpKind
    from kvflow.transports.shm import ShmTransport

    rounds, seed = int(sys.argv[1]), int(sys.argv[2])
    rng = random.Random(seed)

    def preempt(frame, event, arg):
        # Stall the transport's threads right after they leave a lock, as a loaded machine may:
        # whatever runs meanwhile must not pull memory from under them.
        if event == "c_return" and getattr(arg, "__name__", "") == "__exit__":
            if threading.current_thread().name.startswith("kvflow-shm-a") and rng.random() < 0.3:
                time.sleep(0.001)

    threading.setprofile(preempt)
    a, b = ShmTransport(f"a{seed}"), ShmTransport(f"b{seed}")
    size = 1 << 16
    am, bm = a.allocate(size), b.allocate(size)
    a.register_regions([region_of(am)])
    b.register_regions([region_of(bm)])
    col = lambda v: np.array([v], dtype=np.int64)
    plan = DescriptorPlan(col(0), col(0), col(0), col(0), col(size), 1)
    meta = b.local_metadata()
    stop = False

    def submitter():
        i = 0
        while not stop:
            i += 1
            try:
                a.submit(i, OpKind.WRITE if i % 2 else OpKind.READ, b.name, plan, b"")
            except TransportError:
                time.sleep(0.0001)
                continue
            while not a.poll()[0] and not stop:
                time.sleep(0.00005)

    thread = threading.Thread(target=submitter)
    thread.start()
    for _ in range(rounds):
        a.add_peer(b.name, meta, [region_of(bm)])
        time.sleep(rng.random() * 0.002)
        a.remove_peer(b.name)
    stop = True
    thread.join()
    a.close()
    b.close()
    print("survived")
"""


@pytest.mark.parametrize("seed", [1, 2])
def test_remove_peer_hammered_against_copies_in_flight_never_crashes(seed: int) -> None:
    # In a child process, so that a SIGSEGV fails this test instead of killing pytest.
    child = python(HAMMER, "300", str(seed))
    assert (child.returncode, child.stdout) == (0, "survived\n"), child.stderr[-2000:]


def test_a_process_out_of_file_descriptors_still_writes(pair: Pair) -> None:
    a, b, a_mem, b_mem = pair
    a_mem[:] = np.arange(SIZE, dtype=np.uint64).astype(np.uint8)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hogs: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    try:
        with pytest.raises(OSError):
            while True:
                hogs.append(os.open(os.devnull, os.O_RDONLY))
        a.submit(1, OpKind.WRITE, b.name, whole(SIZE), b"landed")
        assert collect(a, completions=1, notes=0)[0] == [Completion(1)]
        assert collect(b, completions=0, notes=1)[1] == [Notification(a.name, b"landed")]
    finally:
        for fd in hogs:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert np.array_equal(a_mem, b_mem)


def test_metadata_without_the_process_id_is_refused(pair: Pair) -> None:
    a, b = pair[0], pair[1]
    meta = msgpack.unpackb(b.local_metadata())
    for pid in (None, 0, -3, "12", True):
        with pytest.raises(TransportError, match="process id"):
            a.add_peer(b.name, msgpack.packb(dict(meta, pid=pid)), [])
    assert socket.SO_PASSCRED  # the check relies on Linux's credentials passing


@pytest.mark.parametrize("peer_id", ["kvflow-a\x00b", "kvflow/../../etc", "kvflow-" + "x" * 80, "other", 7])
def test_metadata_whose_id_cannot_name_a_file_here_is_refused(pair: Pair, peer_id: object) -> None:
    # The id becomes part of the peer's directory name: a NUL made os.open raise ValueError,
    # which escaped as a crash of the engine adding the peer.
    a, b = pair[0], pair[1]
    meta = msgpack.unpackb(b.local_metadata())
    with pytest.raises(TransportError, match="names another endpoint"):
        a.add_peer(b.name, msgpack.packb(dict(meta, id=peer_id)), [])


def test_a_write_to_a_peer_whose_process_was_killed_fails(pair: Pair, prefix: str) -> None:
    a = pair[0]
    child, metadata, region = start_endpoint(prefix)
    assert child.stdin is not None and child.stdout is not None
    try:
        a.add_peer("P", metadata, [region])
        plan = whole(4096)
        a.submit(1, OpKind.WRITE, "P", plan, b"")
        assert collect(a, completions=1, notes=0)[0] == [Completion(1)]
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
        a.submit(2, OpKind.WRITE, "P", plan, b"")
        (done,), _ = collect(a, completions=1, notes=0)
        assert done.op_id == 2 and done.error is not None and "is gone" in done.error
    finally:
        child.stdin.close()
        child.stdout.close()
        child.wait(timeout=60)
        a.remove_peer("P")
        ShmTransport("P", prefix=prefix).close()  # reclaims what the killed process left
