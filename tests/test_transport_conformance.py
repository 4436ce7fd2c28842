"""One contract, every transport: loopback, shared memory and NIXL (UCX, host memory)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import numpy as np
import pytest

from kvflow.errors import ConfigError, TransportError
from kvflow.layout import DescriptorPlan, plan_transfer
from kvflow.layout.buffers import region_of
from kvflow.protocol.actions import OpKind
from kvflow.transports.base import Completion, Transport
from kvflow.transports.loopback import LoopbackFabric, LoopbackTransport
from kvflow.transports.shm import SHM_DIR, ShmTransport
from tests.transport_ends import BLOCKS, SPEC, Ends, make_ends, wait

KINDS = ["loopback", "shm", "nixl-direct", "nixl-prepped"]


@pytest.fixture(params=KINDS)
def ends(request: pytest.FixtureRequest) -> Iterator[Ends]:
    made = make_ends(request.param)
    yield made
    for close in made.closers:
        close()


def kv_equal(ends: Ends, a_blocks: list[int], b_blocks: list[int]) -> bool:
    return all(
        np.array_equal(ends.a_mem[layer].reshape(2, BLOCKS, -1)[:, x], ends.b_mem[layer].reshape(2, BLOCKS, -1)[:, y])
        for layer in range(SPEC.num_layers)
        for x, y in zip(a_blocks, b_blocks, strict=True)
    )


def one_descriptor(
    local_region: int, local_offset: int, remote_region: int, remote_offset: int, n: int
) -> DescriptorPlan:
    def col(v: int) -> np.ndarray:
        return np.array([v], dtype=np.int64)

    return DescriptorPlan(col(local_region), col(local_offset), col(remote_region), col(remote_offset), col(n), 1)


def test_is_a_transport(ends: Ends) -> None:
    assert isinstance(ends.a, Transport)


@pytest.mark.parametrize("pattern", ["contiguous", "mostly", "scattered"])
def test_write_random_block_patterns_byte_exact_with_notification_after(ends: Ends, pattern: str) -> None:
    rng = np.random.default_rng(5)
    for m in ends.a_mem:
        m[:] = rng.integers(0, 256, m.size, dtype=np.uint8)
    if pattern == "contiguous":
        src, dst = list(range(10, 30)), list(range(30, 50))
    elif pattern == "mostly":
        src, dst = [*range(8), 20, *range(40, 50)], [*range(5, 13), 60, *range(14, 24)]
    else:
        src, dst = rng.permutation(BLOCKS)[:24].tolist(), rng.permutation(BLOCKS)[:24].tolist()
    plan = plan_transfer(ends.a_layout, ends.b_layout, src, dst)
    ends.a.submit(7, OpKind.WRITE, ends.b.name, plan, b"landed")
    completions, _ = wait(ends.a)
    assert completions == [Completion(7)]
    _, notes = wait(ends.b, completions=0, notes=1)
    assert notes == [b"landed"]
    assert kv_equal(ends, src, dst)


def test_read_pulls_the_peer_blocks(ends: Ends) -> None:
    for m in ends.b_mem:
        m[:] = np.random.default_rng(1).integers(0, 256, m.size, dtype=np.uint8)
    plan = plan_transfer(ends.a_layout, ends.b_layout, [3, 4, 9], [50, 51, 2])
    ends.a.submit(8, OpKind.READ, ends.b.name, plan, b"")
    assert wait(ends.a)[0] == [Completion(8)]
    assert kv_equal(ends, [3, 4, 9], [50, 51, 2])


def test_standalone_notification(ends: Ends) -> None:
    ends.b.send_notification(ends.a.name, b"ping")
    assert wait(ends.a, completions=0, notes=1)[1] == [b"ping"]


def test_unknown_peer_and_unregistered_memory_are_refused(ends: Ends) -> None:
    plan = plan_transfer(ends.a_layout, ends.b_layout, [0], [0])
    with pytest.raises(TransportError):
        ends.a.submit(1, OpKind.WRITE, "nobody", plan, b"")
    outside = one_descriptor(0, 0, 0, 10**9, 128)
    with pytest.raises(TransportError, match="outside region"):
        ends.a.submit(2, OpKind.WRITE, ends.b.name, outside, b"")
    unregistered = one_descriptor(5, 0, 0, 0, 128)
    with pytest.raises(TransportError, match="not registered"):
        ends.a.submit(3, OpKind.WRITE, ends.b.name, unregistered, b"")


def test_removed_peer_refuses_new_ops_and_close_is_idempotent(ends: Ends) -> None:
    plan = plan_transfer(ends.a_layout, ends.b_layout, [0], [0])
    ends.a.remove_peer(ends.b.name)
    with pytest.raises(TransportError):
        ends.a.submit(1, OpKind.WRITE, ends.b.name, plan, b"")
    ends.a.remove_peer(ends.b.name)  # unknown now: ignored
    ends.a.close()
    ends.a.close()


def test_unusable_peer_metadata_is_refused_with_a_transport_error(ends: Ends) -> None:
    own = ends.b.local_metadata()
    for metadata in (b"", b"\xc1 not msgpack", msgpack.packb(["a", "list"]), msgpack.packb({"name": ends.b.name})):
        with pytest.raises(TransportError):
            ends.a.add_peer(ends.b.name, metadata, ends.b_layout.regions)
    with pytest.raises(TransportError):
        ends.a.add_peer("someone else", own, ends.b_layout.regions)  # metadata of another endpoint


def test_shm_refuses_metadata_of_another_shape_or_a_vanished_segment() -> None:
    ends = make_ends("shm")
    try:
        meta = msgpack.unpackb(ends.b.local_metadata())
        (name, base, size), *_ = meta["segments"]
        shapes = {
            "names another endpoint": dict(meta, id=7),
            "lacks the notification socket": dict(meta, notify=None),
            "is not \\[name, base, size > 0\\]": dict(meta, segments=[[name, str(base), size]]),
            "is not the peer's": dict(meta, segments=[["../etc/passwd", base, size]]),
        }
        for refusal, changed in shapes.items():
            with pytest.raises(TransportError, match=refusal):
                ends.a.add_peer(ends.b.name, msgpack.packb(changed), ends.b_layout.regions)
        vanished = dict(meta, segments=[["seg-999", base, size]])
        with pytest.raises(TransportError, match="has no segment seg-999"):
            ends.a.add_peer(ends.b.name, msgpack.packb(vanished), ends.b_layout.regions)
    finally:
        for close in ends.closers:
            close()


def test_shm_names_never_leave_dev_shm() -> None:
    # Engine names become parts of lock and generation paths under /dev/shm.
    escape = SHM_DIR.parent / "kvflow-escape.lock"
    with pytest.raises(ConfigError, match="may hold only"):
        ShmTransport("../../kvflow-escape")
    a = ShmTransport(f"a{time.monotonic_ns()}")
    try:
        with pytest.raises(TransportError, match="its name may hold only"):
            a.add_peer("../../kvflow-escape", msgpack.packb({"name": "../../kvflow-escape"}), [])
    finally:
        a.close()
    assert not escape.exists()


def test_peer_changes_on_a_thread_race_safely_with_submits_and_polls(ends: Ends) -> None:
    # The engine adds and removes peers on a worker thread while its writer thread submits and its
    # loop polls.  Whatever the interleaving: no crash, one completion per accepted op, and once
    # remove_peer returns, no submission for the peer is accepted and nothing of it lands.
    a, b = ends.a, ends.b
    a_meta, b_meta = a.local_metadata(), b.local_metadata()
    src, dst = list(range(16)), list(range(32, 48))
    plan = plan_transfer(ends.a_layout, ends.b_layout, src, dst)
    stop = threading.Event()
    accepted: list[int] = []
    completed: list[Completion] = []
    failures: list[BaseException] = []

    def guarded(body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except BaseException as exc:
                failures.append(exc)
                stop.set()

        return run

    def writer() -> None:
        op_id = 0
        while not stop.is_set():
            op_id += 1
            for m in ends.a_mem:
                m[:] = op_id % 251  # every op carries other bytes, so a late landing shows
            try:
                a.submit(op_id, OpKind.WRITE, b.name, plan, b"n")
            except TransportError:
                continue
            accepted.append(op_id)

    def poller() -> None:
        while not stop.is_set():
            completed.extend(a.poll()[0])
            b.poll()
            time.sleep(0.0001)

    threads = [threading.Thread(target=guarded(f)) for f in (writer, poller)]
    for thread in threads:
        thread.start()
    snapshots: list[list[np.ndarray]] = []

    def manage() -> None:
        for round_ in range(15):
            assert a.local_metadata() == a_meta
            a.remove_peer(b.name)
            a.add_peer(b.name, b_meta, ends.b_layout.regions)
            if round_ % 5 == 4:  # let some ops through between removals
                landed = sum(c.error is None for c in list(completed))
                end = time.monotonic() + 30
                while sum(c.error is None for c in list(completed)) == landed and time.monotonic() < end:
                    time.sleep(0.001)
        if a.capabilities.fences_inbound:
            b.remove_peer(a.name)  # a keeps submitting to b: nothing of it may land in b now
            snapshots.append([m.copy() for m in ends.b_mem])
            fenced = len(accepted) + 3
            end = time.monotonic() + 30
            while len(accepted) < fenced and time.monotonic() < end and not stop.is_set():
                time.sleep(0.001)
        a.remove_peer(b.name)
        snapshots.append([m.copy() for m in ends.b_mem])
        with pytest.raises(TransportError):
            a.submit(10**9, OpKind.WRITE, b.name, plan, b"")

    manager = threading.Thread(target=guarded(manage))
    manager.start()
    manager.join(timeout=120)
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
    assert failures == []
    end = time.monotonic() + 30
    while len(completed) < len(accepted) and time.monotonic() < end:
        completed.extend(a.poll()[0])
        time.sleep(0.001)
    assert sorted(c.op_id for c in completed) == sorted(accepted)
    assert any(c.error is None for c in completed) and accepted
    assert all(np.array_equal(m, s) for m, s in zip(ends.b_mem, snapshots[0], strict=True))
    if a.capabilities.fences_inbound:
        assert any(c.error is not None for c in completed), "ops into b after it removed a were fenced"


def fabric_threads() -> int:
    return sum(t.name == "kvflow-loopback-fabric" for t in threading.enumerate())


def test_a_loopback_fabric_thread_ends_with_its_last_open_endpoint() -> None:
    before = fabric_threads()
    private = LoopbackTransport(f"solo{time.monotonic_ns()}")  # its own fabric
    assert fabric_threads() == before + 1
    private.close()
    assert fabric_threads() == before
    fabric = LoopbackFabric()
    a, b = fabric.endpoint("a"), fabric.endpoint("b")
    a.close()
    assert fabric_threads() == before + 1  # b still needs it
    b.close()
    assert fabric_threads() == before
    c, d = fabric.endpoint("c"), fabric.endpoint("d")  # a later endpoint gets a thread again
    mem = [np.zeros(256, np.uint8), np.arange(256, dtype=np.uint64).astype(np.uint8)]
    c.register_regions([region_of(mem[0])])
    d.register_regions([region_of(mem[1])])
    c.add_peer("d", d.local_metadata(), [region_of(mem[1])])
    d.add_peer("c", c.local_metadata(), [region_of(mem[0])])
    c.submit(1, OpKind.READ, "d", one_descriptor(0, 0, 0, 0, 256), b"")
    assert wait(c)[0] == [Completion(1)]
    assert np.array_equal(mem[0], mem[1])
    c.close()
    d.close()
    fabric.close()
    assert fabric_threads() == before


def test_memory_deregistered_and_registered_again_takes_a_write_after(ends: Ends) -> None:
    """What an engine put to sleep does (`Engine.unregister_memory`, `restore_memory`): peers
    removed, the memory deregistered (twice: harmless), nothing posted meanwhile, the same
    regions registered again, peers added with the new metadata, and a WRITE lands."""
    rng = np.random.default_rng(11)
    src, dst = list(range(4, 12)), list(range(40, 48))
    for attempt in range(2):  # before the sleep, and after it
        for m in ends.a_mem:
            m[:] = rng.integers(0, 256, m.size, dtype=np.uint8)
        plan = plan_transfer(ends.a_layout, ends.b_layout, src, dst)
        ends.a.submit(20 + attempt, OpKind.WRITE, ends.b.name, plan, b"after" if attempt else b"before")
        assert wait(ends.a)[0] == [Completion(20 + attempt)]
        assert wait(ends.b, completions=0, notes=1)[1] == [b"after" if attempt else b"before"]
        assert kv_equal(ends, src, dst)
        if attempt:
            break
        ends.a.remove_peer(ends.b.name)
        ends.b.remove_peer(ends.a.name)
        for end in (ends.a, ends.b):
            end.deregister_regions()
            end.deregister_regions()
        with pytest.raises(TransportError):
            ends.a.submit(30, OpKind.WRITE, ends.b.name, plan, b"")
        ends.a.register_regions(ends.a_layout.regions)
        ends.b.register_regions(ends.b_layout.regions)
        ends.a.add_peer(ends.b.name, ends.b.local_metadata(), ends.b_layout.regions)
        ends.b.add_peer(ends.a.name, ends.a.local_metadata(), ends.a_layout.regions)


def test_deregistered_memory_is_refused_as_local_memory() -> None:
    """While deregistered, an op naming local memory is refused, never posted."""
    for kind in ("shm", "nixl-direct"):
        made = make_ends(kind)
        try:
            made.a.deregister_regions()
            plan = plan_transfer(made.a_layout, made.b_layout, [0], [0])
            with pytest.raises(TransportError, match="not registered"):
                made.a.submit(1, OpKind.WRITE, made.b.name, plan, b"")
        finally:
            for close in made.closers:
                close()
