"""The shared-memory transport against a hostile peer or a same-user process: a Hello advertising
more memory than any engine has, files that are not what they should be (a FIFO blocks whoever
opens it), a fence lock held for ever, a peer shrinking memory the other side mapped (SIGBUS),
and a notification address that names somebody else's socket.  Whatever they do, the engine
refuses the peer (or fails the op) with a `TransportError` naming why, and neither hangs nor
dies."""

from __future__ import annotations

import errno
import fcntl
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest

from kvflow.errors import TransportError
from kvflow.layout.buffers import region_of
from kvflow.protocol.actions import OpKind
from kvflow.transports import shm_files, shm_peer
from kvflow.transports.base import Completion
from kvflow.transports.shm import SHM_DIR, ShmTransport
from tests.transport_ends import whole

ROOT = Path(__file__).resolve().parent.parent
SIZE = 1 << 16
HANG = 30.0  # how long a call that should return at once may take before it counts as hung


@pytest.fixture
def pair() -> Iterator[tuple[ShmTransport, ShmTransport]]:
    tag = uuid.uuid4().hex[:8]
    a, b = ShmTransport(f"a{tag}"), ShmTransport(f"b{tag}")
    b.register_regions([region_of(b.allocate(SIZE))])
    yield a, b
    a.close()
    b.close()


def held() -> tuple[int, int]:
    """Mappings of shared memory (kvflow's memfds, or files under /dev/shm) and descriptors this
    process holds, once what earlier tests left for the garbage collector is gone."""
    gc.collect()
    with open("/proc/self/maps") as lines:
        mappings = sum(1 for line in lines if "/memfd:" in line or "/dev/shm/" in line)
    return mappings, len(os.listdir("/proc/self/fd"))


def outcome(call: Callable[[], object]) -> BaseException | None:
    """Run `call` on a thread; what it raised (None: it returned).  A call still running after
    `HANG` fails the test instead of hanging it."""
    result: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            result.append(exc)
        else:
            result.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG)
    assert result, f"still blocked after {HANG}s"
    return result[0]


def unblock(fifo: Path) -> None:
    """Give a FIFO a writer, so that a reader blocked opening it (the code before the fix) goes on."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as exc:
        assert exc.errno in (errno.ENXIO, errno.ENOENT)  # nobody is blocked on it


# ---------------------------------------------------------------------- what a Hello advertises


def test_a_hello_advertising_19000_segments_is_refused_before_anything_is_mapped(
    pair: tuple[ShmTransport, ShmTransport],
) -> None:
    a, b = pair
    meta = msgpack.unpackb(b.local_metadata())
    ((name, base, size),) = meta["segments"]
    hostile = msgpack.packb(dict(meta, segments=[[name, base, size]] * 19_000))
    before = held()
    with pytest.raises(TransportError, match="19000 segments"):
        a.add_peer(b.name, hostile, [])
    assert held() == before


def test_a_peer_advertising_more_bytes_than_the_bound_is_refused() -> None:
    tag = uuid.uuid4().hex[:8]
    a, b = ShmTransport(f"a{tag}", max_peer_bytes=3 * SIZE), ShmTransport(f"b{tag}")
    try:
        for _ in range(4):
            b.allocate(SIZE)
        with pytest.raises(TransportError, match=f"{4 * SIZE} bytes"):
            a.add_peer(b.name, b.local_metadata(), [])
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("shape", ["duplicate", "overlapping", "past the address space"])
def test_segments_that_cannot_be_a_peers_memory_are_refused(
    pair: tuple[ShmTransport, ShmTransport], shape: str
) -> None:
    a, b = pair
    meta = msgpack.unpackb(b.local_metadata())
    ((name, base, size),) = meta["segments"]
    b.allocate(SIZE)
    segments = {
        "duplicate": [[name, base, size], [name, base + size, size]],
        "overlapping": [[name, base, size], ["seg-1", base + size // 2, size]],
        "past the address space": [[name, (1 << 64) - size // 2, size]],
    }[shape]
    with pytest.raises(TransportError, match=shape):
        a.add_peer(b.name, msgpack.packb(dict(meta, segments=segments)), [])


@pytest.mark.parametrize("notify", ["/dev/log", "\0/dev/log", "\0kvflow-other-b-notify", "", "{own}", "{own}\0"])
def test_a_notification_address_not_the_peers_own_is_refused(
    pair: tuple[ShmTransport, ShmTransport], notify: str
) -> None:
    a, b = pair
    meta = msgpack.unpackb(b.local_metadata())
    notify = notify.replace("{own}", f"\0{meta['id']}-{a.name}-notify")  # the right form, another name
    with pytest.raises(TransportError, match="notification socket"):
        a.add_peer(b.name, msgpack.packb(dict(meta, notify=notify)), [])


# ---------------------------------------------------------------------- files that are not files


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["fifo", "symlink"])
@pytest.mark.parametrize("file", ["owner", "lock", "gen"])
def test_a_peer_file_that_is_not_a_regular_file_refuses_the_peer_without_blocking(
    pair: tuple[ShmTransport, ShmTransport], file: str, kind: str, tmp_path: Path
) -> None:
    a, b = pair
    path = b._files.directory / (f"gen-{a.name}" if file == "gen" else file)
    path.unlink(missing_ok=True)  # b keeps its own descriptors: only a newcomer sees the impostor
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    else:
        (tmp_path / "elsewhere").write_bytes(b"")
        path.symlink_to(tmp_path / "elsewhere")
    try:
        refused = outcome(lambda: a.add_peer(b.name, b.local_metadata(), []))
    finally:
        if kind == "fifo":
            unblock(path)
    assert isinstance(refused, TransportError), refused
    assert path.name in str(refused) and ("regular file" in str(refused) or "symbolic link" in str(refused))


def test_a_peer_directory_that_is_a_symbolic_link_refuses_the_peer(pair: tuple[ShmTransport, ShmTransport]) -> None:
    a, b = pair
    real = b._files.directory
    moved = real.with_name(f"{real.name}-moved")
    real.rename(moved)  # b keeps its descriptors; a newcomer finds a link where its directory was
    real.symlink_to(moved)
    try:
        before = held()
        with pytest.raises(TransportError, match="is a symbolic link") as refused:
            a.add_peer(b.name, b.local_metadata(), [])
        assert real.name in str(refused.value) and held() == before
    finally:
        real.unlink()
        moved.rename(real)


@pytest.fixture
def private_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A /dev/shm of this test's own: what is planted there cannot disturb another kvflow start."""
    monkeypatch.setattr(shm_files, "SHM_DIR", tmp_path)
    return tmp_path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_a_planted_owner_file_neither_blocks_nor_fails_a_start(private_shm: Path, kind: str) -> None:
    planted = private_shm / "kvflow-planted-P.kvflow"
    planted.mkdir(mode=0o700)
    owner = planted / "owner"
    {"fifo": lambda: os.mkfifo(owner, 0o600), "symlink": lambda: owner.symlink_to("/dev/null"),
     "directory": lambda: owner.mkdir()}[kind]()  # fmt: skip
    started: list[ShmTransport] = []
    try:
        failed = outcome(lambda: started.append(ShmTransport("Q", prefix=f"kvflow-{uuid.uuid4().hex[:8]}")))
    finally:
        if kind == "fifo":
            unblock(owner)
    assert failed is None, failed
    (endpoint,) = started
    try:
        assert endpoint.reclaimed == 1 and not planted.exists()  # it is nobody's: reclaimed
    finally:
        endpoint.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_planted_user_lock_refuses_a_start_naming_it(private_shm: Path, kind: str) -> None:
    lock = private_shm / f"kvflow-{os.getuid()}.reclaim"
    if kind == "fifo":
        os.mkfifo(lock, 0o600)
    else:
        lock.symlink_to(private_shm / "elsewhere")
    try:
        failed = outcome(lambda: ShmTransport("Q", prefix=f"kvflow-{uuid.uuid4().hex[:8]}").close())
    finally:
        if kind == "fifo":
            unblock(lock)
    assert isinstance(failed, TransportError), failed
    assert lock.name in str(failed)


@pytest.mark.timeout(120)
def test_a_planted_file_in_a_new_endpoints_place_is_named(private_shm: Path) -> None:
    prefix = f"kvflow-{uuid.uuid4().hex[:8]}"
    os.mkfifo(private_shm / f"{prefix}-Q.kvflow", 0o600)
    failed = outcome(lambda: ShmTransport("Q", prefix=prefix).close())
    assert isinstance(failed, TransportError) and "not an endpoint's directory" in str(failed), failed


@pytest.mark.timeout(120)
def test_a_peer_holding_its_fence_lock_fails_the_op_instead_of_wedging_the_writer() -> None:
    tag = uuid.uuid4().hex[:8]
    a, b = ShmTransport(f"a{tag}", fence_timeout=0.5), ShmTransport(f"b{tag}")
    held = os.open(b._files.directory / "lock", os.O_RDONLY)  # as a peer that never lets go would
    try:
        source, target = a.allocate(SIZE), b.allocate(SIZE)
        a.register_regions([region_of(source)])
        a.add_peer(b.name, b.local_metadata(), [region_of(target)])
        fcntl.flock(held, fcntl.LOCK_EX)
        a.submit(1, OpKind.WRITE, b.name, whole(SIZE), b"")
        done: list[Completion] = []
        assert outcome(lambda: done.extend(_completions(a))) is None
        ((op_id, error),) = [(c.op_id, c.error) for c in done]
        assert op_id == 1 and error is not None and "fence lock" in error
    finally:
        os.close(held)  # lets the writer of the code before the fix go on
        a.close()
        b.close()


# ---------------------------------------------------------------------- shrinking mapped memory

PEER = """
    import os, sys
    from pathlib import Path
    from kvflow.transports.shm import ShmTransport
    from kvflow.layout.buffers import region_of
    t = ShmTransport("P", prefix=sys.argv[1])
    memory = t.allocate(1 << 20)
    print(t.local_metadata().hex(), region_of(memory).base, flush=True)
    sys.stdin.readline()
    # Shrink everything that holds this memory: the files of its directory, and descriptors.
    tried, shrunk = 0, 0
    targets = [str(p) for p in Path("/dev/shm").glob(sys.argv[1] + "-P.kvflow/seg-*")]
    for fd in os.listdir("/proc/self/fd"):
        link = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        if "memfd:" in link or "/seg-" in link:
            targets.append(int(fd))
    for target in targets:
        tried += 1
        try:
            os.truncate(target, 0)
            shrunk += 1
        except OSError:
            pass
    print(tried, shrunk, flush=True)
    sys.stdin.read()
    t.close()
"""

VICTIM = """
    import sys, time
    import numpy as np
    from kvflow.layout import DescriptorPlan, Region
    from kvflow.layout.buffers import region_of
    from kvflow.protocol.actions import OpKind
    from kvflow.transports.shm import ShmTransport
    metadata, base = bytes.fromhex(sys.argv[1]), int(sys.argv[2])
    size = 1 << 20
    t = ShmTransport("V")
    memory = t.allocate(size)
    t.register_regions([region_of(memory)])
    t.add_peer("P", metadata, [Region(base, size)])
    col = lambda v: np.array([v], dtype=np.int64)
    plan = DescriptorPlan(col(0), col(0), col(0), col(0), col(size), 1)

    def write(op_id):
        t.submit(op_id, OpKind.WRITE, "P", plan, b"")
        deadline = time.monotonic() + 60
        while not (done := t.poll()[0]):
            assert time.monotonic() < deadline, "no completion"
            time.sleep(0.001)
        return done

    print("wrote", write(1), flush=True)
    sys.stdin.readline()
    print("wrote", write(2), flush=True)
    t.close()
"""


def child(code: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


@pytest.mark.timeout(180)
def test_a_peer_shrinking_its_memory_cannot_kill_the_engine_that_mapped_it() -> None:
    prefix = f"kvflow-shmtest-{uuid.uuid4().hex[:8]}"
    peer = child(PEER, prefix)
    assert peer.stdin is not None and peer.stdout is not None
    metadata, base = peer.stdout.readline().split()
    victim = child(VICTIM, metadata, base)
    assert victim.stdin is not None and victim.stdout is not None
    try:
        assert victim.stdout.readline().startswith("wrote")  # mapped, and written once
        peer.stdin.write("shrink\n")
        peer.stdin.flush()
        tried, shrunk = map(int, peer.stdout.readline().split())
        victim.stdin.write("again\n")
        victim.stdin.flush()
        second = victim.stdout.readline()
        victim.stdin.close()
        code = victim.wait(timeout=60)
        assert code != -signal.SIGBUS, "the peer's truncation killed the engine that mapped its memory"
        assert (code, shrunk) == (0, 0) and tried >= 1 and second.startswith("wrote"), second
    finally:
        for process in (victim, peer):
            if process.poll() is None:
                process.kill()
            process.wait(timeout=60)
            for pipe in (process.stdin, process.stdout):
                if pipe is not None and not pipe.closed:
                    pipe.close()


def test_a_segment_that_is_not_sealed_against_shrinking_is_refused(pair: tuple[ShmTransport, ShmTransport]) -> None:
    a, b = pair
    (segment,) = b._segments
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    try:
        os.ftruncate(unsealed, SIZE)
        os.dup2(unsealed, segment.fd)  # b hands out an unsealed file for its segment from now on
    finally:
        os.close(unsealed)
    before = held()
    with pytest.raises(TransportError, match="not sealed against shrinking"):
        a.add_peer(b.name, b.local_metadata(), [])
    assert held() == before


def test_a_write_still_lands_in_a_sealed_segment(pair: tuple[ShmTransport, ShmTransport]) -> None:
    a, b = pair
    source = a.allocate(SIZE)
    source[:] = np.arange(SIZE, dtype=np.uint64).astype(np.uint8)
    a.register_regions([region_of(source)])
    (target,) = b._segments
    a.add_peer(b.name, b.local_metadata(), [region_of(target.view)])
    a.submit(1, OpKind.WRITE, b.name, whole(SIZE), b"")
    done: list[Completion] = []
    assert outcome(lambda: done.extend(_completions(a))) is None
    assert done == [Completion(1)] and np.array_equal(target.view, source)
    with pytest.raises(OSError):
        os.ftruncate(target.fd, 0)


def _completions(endpoint: ShmTransport) -> list[Completion]:
    while not (done := endpoint.poll()[0]):
        threading.Event().wait(0.001)
    return list(done)


def test_segments_leave_nothing_in_dev_shm(pair: tuple[ShmTransport, ShmTransport]) -> None:
    b = pair[1]
    assert not list(b._files.directory.glob("seg-*"))
    assert not [p for p in SHM_DIR.glob(f"{b._files.directory.name.removesuffix('.kvflow')}*") if p.is_file()]


# ---------------------------------------------------------------------- mappings and descriptors


def test_a_peers_segments_cost_a_mapping_each_and_no_descriptor() -> None:
    """Python's mmap keeps a duplicate of each descriptor it maps: a peer advertising many
    segments cost as many descriptors (4 names x 1,000 segments: 4,085)."""
    tag = uuid.uuid4().hex[:8]
    a, b = ShmTransport(f"a{tag}"), ShmTransport(f"b{tag}")
    try:
        for _ in range(40):
            b.allocate(4096)
        mappings, descriptors = held()
        a.add_peer(b.name, b.local_metadata(), [])
        # the 40 mappings, and the peer's 4 files (owner, fence lock, its generation and ours)
        assert held() == (mappings + 40, descriptors + 4)
        assert a.mappings.held == 40
        a.remove_peer(b.name)
        assert held() == (mappings, descriptors) and a.mappings.held == 0
    finally:
        a.close()
        b.close()


def test_the_peers_mappings_are_bounded_in_all_not_only_per_name() -> None:
    tag = uuid.uuid4().hex[:8]
    a = ShmTransport(f"a{tag}", max_mapped_segments=5)
    peers = [ShmTransport(f"p{index}{tag}") for index in range(2)]
    try:
        for peer in peers:
            for _ in range(3):
                peer.allocate(4096)
        first, second = peers
        a.add_peer(first.name, first.local_metadata(), [])
        before = held()
        with pytest.raises(TransportError, match="take the peers' mappings to 6, over max_mapped_segments 5"):
            a.add_peer(second.name, second.local_metadata(), [])
        assert held() == before and a.mappings.held == 3  # nothing mapped, nothing kept
        a.add_peer(first.name, first.local_metadata(), [])  # a new association of the first replaces its own
        assert a.mappings.held == 3
        a.remove_peer(first.name)
        a.add_peer(second.name, second.local_metadata(), [])  # room again
        assert a.mappings.held == 3
    finally:
        a.close()
        for peer in peers:
            peer.close()


@pytest.mark.parametrize(("max_map_count", "budget"), [("200000", 50_000), ("1000", 1024), (None, 16_382)])
def test_the_default_mapping_budget_is_a_quarter_of_the_kernels_map_count(
    tmp_path: Path, max_map_count: str | None, budget: int
) -> None:
    path = tmp_path / "max_map_count"
    if max_map_count is not None:
        path.write_text(max_map_count + "\n")
    assert shm_peer.mapping_budget(1024, path) == budget  # at least one peer's bound; 65,530 if unread
    tag = uuid.uuid4().hex[:8]
    endpoint = ShmTransport(f"a{tag}")
    try:
        assert endpoint.mappings.limit == shm_peer.mapping_budget(1024)  # this kernel's, by default
    finally:
        endpoint.close()
