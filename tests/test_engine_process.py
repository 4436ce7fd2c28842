"""An engine in a process of its own (`kvflow.runtime.process`), and host memory it can reach.

Real processes, real NIXL over UCX, real shared memory: the host's numpy buffers are moved
onto memory files in place, P's engine process WRITEs into D's, and the host reads the bytes
where it always had them.  Failures cross the socket by class; a dead child fails what was
pending, and a dead host takes its engine process with it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

import kvflow
from kvflow.errors import ConfigError, EngineClosed, EngineCrashed, InvalidBatch, KVFlowError, UsageError
from kvflow.layout import MemoryType, Region
from kvflow.protocol.actions import ReleaseBlocks
from kvflow.protocol.requests import Abort, Expect, KvReady
from kvflow.protocol.state import Outcome, Role
from kvflow.runtime.frames import FrameReader, encode_frame, error_from_record
from kvflow.runtime.host_memory import MappedSpans, share_in_place
from kvflow.runtime.process import STALL_LIMIT, EngineProcess, ProcessSpec
from kvflow.runtime.ring import HEADER, RECORD_HEADER

SPEC = kvflow.KVSpec(num_layers=4, block_size=16, num_kv_heads=8, head_dim=128, dtype="float16")
NUM_BLOCKS = 16


def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll `condition` until it holds; the deadline only guards against a hang."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.002)


def engine(name: str, caches: list[np.ndarray], transport: str = "nixl") -> EngineProcess:
    regions = [kvflow.region_of(a) for a in caches]
    spans = share_in_place(regions)
    try:
        layout = kvflow.KVLayout.per_layer_regions(SPEC, NUM_BLOCKS, regions)
        return EngineProcess(ProcessSpec(name, layout, transport=transport, transport_options={"cuda": False}), spans)
    finally:
        for span in spans:
            os.close(span.fd)


def cache() -> list[np.ndarray]:
    return [np.zeros((2, NUM_BLOCKS, SPEC.block_len), np.uint8) for _ in range(SPEC.num_layers)]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[EngineProcess, EngineProcess, list[np.ndarray], list[np.ndarray]]]:
    p_cache, d_cache = cache(), cache()
    p = engine("prefill-0", p_cache)
    d = engine("decode-0", d_cache)
    connected = d.call("connect", "prefill-0", p.address)
    answered(d, connected)
    connected.result()
    yield p, d, p_cache, d_cache
    d.close()
    p.close()


def answered(process: EngineProcess, *futures: concurrent.futures.Future[Any]) -> None:
    """Until the engine process has answered every one of `futures`."""

    def done() -> bool:
        process.pump()
        return all(future.done() for future in futures)

    until(done, "the engine process's answers")


def released(process: EngineProcess, count: int) -> list[ReleaseBlocks]:
    """The next `count` releases the engine process reports."""
    got: list[ReleaseBlocks] = []

    def enough() -> bool:
        got.extend(process.poll_released())
        return len(got) >= count

    until(enough, "blocks to come back")
    return got


def test_a_push_between_engine_processes_lands_in_the_hosts_own_memory(pair) -> None:  # type: ignore[no-untyped-def]
    p, d, p_cache, d_cache = pair
    rng = np.random.default_rng(3)
    for layer in p_cache:
        layer[:, [0, 1, 2]] = rng.integers(0, 256, layer[:, [0, 1, 2]].shape, np.uint8)
    expected = d.submit(Expect(kvflow.TransferKey("req-1", 1), "prefill-0", [4, 9, 10]))
    ready = p.submit(KvReady(kvflow.TransferKey("req-1", 1), [0, 1, 2]))
    (d_release,) = released(d, 1)
    (p_release,) = released(p, 1)
    assert (expected.result(), ready.result()) == (None, None)
    assert (d_release.role, d_release.block_ids, d_release.outcome) == (Role.DECODE, (4, 9, 10), Outcome.SUCCEEDED)
    assert (p_release.role, p_release.block_ids, p_release.outcome) == (Role.PREFILL, (0, 1, 2), Outcome.SUCCEEDED)
    for p_layer, d_layer in zip(p_cache, d_cache, strict=True):
        assert np.array_equal(p_layer[:, [0, 1, 2]], d_layer[:, [4, 9, 10]])
    reading = p.meter_take()
    assert [sample.nbytes for sample in reading.samples] == [3 * SPEC.block_len * 2 * SPEC.num_layers]


def test_a_refused_call_fails_its_future_with_the_engines_own_error(pair) -> None:  # type: ignore[no-untyped-def]
    p, _, _, _ = pair
    bad = p.submit(KvReady(kvflow.TransferKey("bad", 1), [-1]))  # no such block
    unknown = p.call("shutdown_everything")
    answered(p, bad, unknown)
    with pytest.raises(InvalidBatch):
        bad.result()
    with pytest.raises(UsageError, match="no command 'shutdown_everything'"):
        unknown.result()
    stats = p.call("stats")
    answered(p, stats)
    assert stats.result()["crashed"] == 0 and stats.result()["live_transfers"] == 0


def test_calls_in_a_batch_go_out_together_and_in_order(pair) -> None:  # type: ignore[no-untyped-def]
    p, d, _, _ = pair
    with d.batch():
        first = d.submit(Expect(kvflow.TransferKey("b-1", 1), "prefill-0", [5]))
        second = d.submit(Abort(kvflow.TransferKey("b-1", 1), Role.DECODE, "changed our mind"))
        assert not first.done() and not second.done()
    answered(d, first, second)
    assert (first.result(), second.result()) == (None, None)
    (release,) = released(d, 1)
    assert release.outcome is Outcome.ABORTED
    # P was told; nothing left on it
    leftover = p.submit(Abort(kvflow.TransferKey("b-1", 1), Role.PREFILL, "P never got the KV"))
    answered(p, leftover)


def test_a_lazy_call_goes_with_the_next_call_or_the_next_pump(pair) -> None:  # type: ignore[no-untyped-def]
    p, _, _, _ = pair
    promised = p.call("promise", "lazy-1", 1, "decode-0", lazy=True)
    stats = p.call("stats")  # sent now, with the lazy call ahead of it
    answered(p, promised, stats)
    assert promised.result() is None and stats.result()["live_transfers"] == 0
    alone = p.call("stats", lazy=True)
    answered(p, alone)  # pumping sends it
    assert alone.result()["crashed"] == 0


def test_a_host_asleep_on_its_answers_is_woken_by_its_engine_process_when_blocks_come_back(pair) -> None:  # type: ignore[no-untyped-def]
    """A decode step with nothing to do sleeps on the ring of answers (`wait_for_answers`) instead
    of stepping again at once; the KV landing ends the sleep, by the engine process's eventfd,
    not by the sleep's deadline (with no wake-up this waits out its 30 s and `woken` stays)."""
    p, d, _, _ = pair
    expected = d.submit(Expect(kvflow.TransferKey("asleep-1", 1), "prefill-0", [7]))
    answered(d, expected)
    d.poll_released()
    woken = d.woken
    p.submit(KvReady(kvflow.TransferKey("asleep-1", 1), [3]))
    got: list[ReleaseBlocks] = []
    for _ in range(10):  # the engine process may say something else first (its figures)
        assert d.wait_for_answers(30.0)
        got += d.poll_released()
        if got:
            break
    assert [(r.block_ids, r.outcome) for r in got] == [((7,), Outcome.SUCCEEDED)]
    assert d.woken > woken
    released(p, 1)


def test_an_engine_that_cannot_start_raises_its_error_and_leaves_nothing_running() -> None:
    before = _children()
    with pytest.raises(kvflow.UnknownTransport, match="warp-drive"):
        engine("broken-0", cache(), transport="warp-drive")
    assert _children() == before


def test_a_killed_engine_process_fails_what_was_pending_and_refuses_more() -> None:
    p = engine("doomed-0", cache())
    try:
        os.kill(p.pid, signal.SIGSTOP)  # it cannot answer the call below before it dies
        pending = p.call("stats")
        os.kill(p.pid, signal.SIGKILL)
        answered(p, pending)
        with pytest.raises(EngineCrashed, match="gone"):
            pending.result()
        assert not p.alive
        with pytest.raises(EngineClosed):
            p.call("stats")
    finally:
        p.close()


def test_a_connection_reset_while_closing_is_the_engines_crash_not_an_os_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host stopped as a process group sees its engine process go under it: a reset read
    while closing ends the wait for the engine's goodbye (no OSError escapes), and the process
    is still reaped."""
    p = engine("reset-0", cache())

    def reset(sock: object) -> tuple[int, list[object]]:
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(p._reader, "read", reset)
    p.close(timeout=5.0)
    assert not p.alive and p.proc.poll() is not None


HOST = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import kvflow
    from kvflow.runtime.host_memory import share_in_place
    from kvflow.runtime.process import EngineProcess, ProcessSpec
    spec = kvflow.KVSpec(num_layers=1, block_size=16, num_kv_heads=1, head_dim=64)
    buffer = np.zeros((2, 4, spec.block_len), np.uint8)
    region = kvflow.region_of(buffer)
    layout = kvflow.KVLayout.per_layer_regions(spec, 4, [region])
    spec = ProcessSpec("orphan-0", layout, transport_options={"cuda": False})
    process = EngineProcess(spec, share_in_place([region]))
    print(process.pid, flush=True)
    sys.stdin.read()  # until killed
    """
)


@contextlib.contextmanager
def host_running(script: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A host process running `script`, and the pid of the engine process it started (the
    script prints it); the host is killed and its pipes closed on the way out."""
    host = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        yield host, int(host.stdout.readline())
    finally:
        host.kill()
        host.wait(timeout=30)
        for stream in (host.stdin, host.stdout):
            if stream is not None:
                stream.close()


def test_an_engine_process_ends_when_its_host_dies() -> None:
    with host_running(HOST) as (host, child):
        assert _alive(child)
        host.kill()
        host.wait(timeout=30)
        until(lambda: not _alive(child), "the orphaned engine process to end")


def test_an_engine_process_ends_when_its_host_dies_even_if_its_socket_stays_open() -> None:
    """The host forks a process that inherits the host's end of the socket (a worker's own child,
    say), then dies: the socket never closes, and the engine process sees its parent change."""
    fork = "if os.fork() == 0:\n    import time\n    time.sleep(600)\n    os._exit(0)\n"  # before the pid is told
    keeper = HOST.replace("print(process.pid, flush=True)", fork + "print(process.pid, flush=True)")
    host_pid, child = 0, 0
    try:
        with host_running(keeper) as (host, child):
            host_pid = host.pid
            host.kill()
            host.wait(timeout=30)
            until(lambda: not _alive(child), "the engine process to see its host gone")
    finally:
        for pid in _children_of(child, parent_gone=host_pid) if host_pid else []:
            os.kill(pid, signal.SIGKILL)


def test_an_engine_process_whose_host_died_before_it_began_watching_still_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host killed between the engine process's ready and its first look at its parent: by
    then its parent is whoever adopted it, so it must compare with the host's pid it was told,
    not the parent it finds.  Here it is told of a host that is not its parent (one that has
    already exited), which is what it finds in that race."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    to_wire = ProcessSpec.to_wire
    monkeypatch.setattr(ProcessSpec, "to_wire", lambda spec, spans: {**to_wire(spec, spans), "host_pid": gone.pid})
    p = engine("adopted-0", cache())
    try:
        until(lambda: p.proc.poll() is not None, "the engine process to see its host gone")
    finally:
        p.close(timeout=5.0)


def _children_of(child: int, parent_gone: int) -> list[int]:
    """The keeper the dead host forked: a process whose command line is the host's script."""
    keepers = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in (os.getpid(), child, parent_gone):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"orphan-0" in f.read():
                        keepers.append(int(entry))
            except OSError:
                continue
    return keepers


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children() -> set[int]:
    me = os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                found.add(int(entry))
    return found


# ---------------------------------------------------------------- host memory


def test_memory_shared_in_place_keeps_its_addresses_and_bytes_and_a_child_writes_into_it() -> None:
    buffer = np.arange(3 << 20, dtype=np.uint8).reshape(3, -1)  # 3 MiB, bytes not all zero
    view = buffer[1]  # a view the host keeps, as vLLM keeps views of its caches
    before = buffer.copy()
    address = buffer.ctypes.data
    spans = share_in_place([kvflow.region_of(buffer)])
    try:
        assert buffer.ctypes.data == address and np.array_equal(buffer, before)
        code = textwrap.dedent(
            f"""
            import ctypes
            from kvflow.layout import Region
            from kvflow.runtime.host_memory import MappedSpans
            mapped = MappedSpans([({spans[0].fd}, {spans[0].base}, {spans[0].length})])
            local = mapped.translate(Region({address + (1 << 20)}, 16))
            (ctypes.c_char * 16).from_address(local.base)[:] = b"written by child"
            """
        )
        subprocess.run([sys.executable, "-c", code], pass_fds=[spans[0].fd], check=True, timeout=60)
    finally:
        for span in spans:
            os.close(span.fd)
    assert bytes(view[:16]) == b"written by child"
    assert np.array_equal(buffer[0], before[0]) and np.array_equal(buffer[2], before[2])


def test_regions_on_shared_pages_share_one_file() -> None:
    buffer = np.zeros(1 << 20, np.uint8)
    halves = [Region(buffer.ctypes.data, 1 << 19), Region(buffer.ctypes.data + (1 << 19), 1 << 19)]
    spans = share_in_place(halves)
    try:
        assert len(spans) == 1 and spans[0].length >= 1 << 20
    finally:
        for span in spans:
            os.close(span.fd)


def test_only_host_memory_is_shared() -> None:
    with pytest.raises(ConfigError, match="host"):
        share_in_place([Region(1 << 30, 4096, MemoryType.VRAM, 0)])


def test_a_mapping_refuses_a_region_outside_what_was_shared() -> None:
    buffer = np.zeros(8192, np.uint8)
    (span,) = share_in_place([kvflow.region_of(buffer)])
    mapped = MappedSpans([(os.dup(span.fd), span.base, span.length)])
    os.close(span.fd)
    inside = mapped.translate(Region(buffer.ctypes.data, 8192))
    ctypes.memset(inside.base, 7, 1)
    assert buffer[0] == 7
    with pytest.raises(ConfigError, match="outside the shared memory"):
        mapped.translate(Region(span.base + span.length - 16, 32))


# ---------------------------------------------------------------- the wire


def test_frames_cut_anywhere_come_out_whole() -> None:
    stream = encode_frame([["call", 1, "stats", []]]) + encode_frame([["close"]])
    reader = FrameReader()
    frames = [frame for i in range(len(stream)) for frame in reader.feed(stream[i : i + 1])]
    assert frames == [[["call", 1, "stats", []]], [["close"]]]


def test_a_frame_longer_than_the_limit_is_refused() -> None:
    with pytest.raises(KVFlowError, match="exceeds"):
        FrameReader().feed((1 << 31).to_bytes(4, "big"))


def test_errors_cross_by_class_name_and_unknown_ones_stay_kvflow_errors() -> None:
    known = error_from_record(["InvalidBatch", "block 99 out of range"])
    assert type(known) is InvalidBatch and str(known) == "block 99 out of range"
    foreign = error_from_record(["ZeroDivisionError", "oops"])
    assert type(foreign) is KVFlowError and "ZeroDivisionError: oops" in str(foreign)


def _reserve(process: EngineProcess) -> tuple[int, concurrent.futures.Future[Any]]:
    """A sequence number and the future its answer settles, as `EngineProcess.call` makes them."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    with process._lock:
        process._seq += 1
        process._futures[process._seq] = future
        return process._seq, future


def test_hostile_records_in_the_ring_are_refused_and_the_engine_goes_on(pair) -> None:  # type: ignore[no-untyped-def]
    p, _, _, _ = pair
    bad_args, bad_args_future = _reserve(p)
    unknown, unknown_future = _reserve(p)
    for record in (
        b"\xc1",  # not msgpack
        msgpack.packb(["close"]),  # close comes on the socket only
        msgpack.packb(["call", "seven", "stats", []]),  # no sequence number: nobody to answer
        msgpack.packb({"call": 1}),
        msgpack.packb(["call", bad_args, "stats", "not a list"]),
        msgpack.packb(["call", unknown, "__init__", []]),
    ):
        assert p._rings.orders.write(record)
    p._rings.wake()
    answered(p, bad_args_future, unknown_future)
    with pytest.raises(UsageError, match="refused"):
        bad_args_future.result()
    with pytest.raises(UsageError, match="no command"):
        unknown_future.result()
    stats = p.call("stats")
    answered(p, stats)
    assert stats.result()["crashed"] == 0 and p.alive


def test_a_record_written_without_a_wake_up_is_still_answered(pair) -> None:  # type: ignore[no-untyped-def]
    """A wake-up the writer missed (its store of the ring's head and the reader's going to
    sleep passing each other) delays a record, never loses it."""
    p, _, _, _ = pair
    seq, future = _reserve(p)
    assert p._rings.orders.write(msgpack.packb(["call", seq, "stats", []]))  # and no eventfd write
    answered(p, future)
    assert future.result()["crashed"] == 0


def test_a_ring_record_that_stays_unreadable_closes_the_engine_and_fails_what_was_pending() -> None:
    p = engine("torn-0", cache())
    try:
        os.kill(p.pid, signal.SIGSTOP)  # it must not read the record before it is torn
        at = p._rings.orders._head % p._rings.orders.capacity
        pending = p.call("stats")
        p._rings._map[HEADER + at + RECORD_HEADER] ^= 0xFF  # the payload no longer matches its checksum
        os.kill(p.pid, signal.SIGCONT)

        def failed() -> bool:
            p.pump()
            return pending.done()

        until(failed, "the engine to give up on its ring", timeout=STALL_LIMIT + 30)
        with pytest.raises(EngineCrashed, match="gone"):
            pending.result()
        assert not p.alive
    finally:
        if p.alive:
            os.kill(p.pid, signal.SIGCONT)
        p.close()


def test_a_call_too_large_for_the_ring_is_refused_before_anything_is_sent(pair) -> None:  # type: ignore[no-untyped-def]
    p, _, _, _ = pair
    with pytest.raises(ConfigError, match="ring"):
        p.call("stats", "x" * (p._rings.orders.max_record + 1))
    stats = p.call("stats")
    answered(p, stats)
    assert stats.result()["crashed"] == 0


def test_an_unknown_scheduling_policy_is_refused_before_a_process_starts() -> None:
    before = _children()
    regions = [kvflow.region_of(a) for a in cache()]
    layout = kvflow.KVLayout.per_layer_regions(SPEC, NUM_BLOCKS, regions)
    with pytest.raises(ConfigError, match="scheduled"):
        EngineProcess(ProcessSpec("fifo-0", layout, scheduling="fifo"), [])
    assert _children() == before
