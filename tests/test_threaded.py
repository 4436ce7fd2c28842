"""The thread facade: engines on their own threads, driven from plain (non-async) threads."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvflow.control.channel import LocalControlHub
from kvflow.errors import EngineClosed, InvalidBatch
from kvflow.protocol.state import Mode, Role
from kvflow.runtime.engine import Engine, EngineConfig, TransferResult
from kvflow.runtime.threaded import EngineThread
from kvflow.transports.loopback import LoopbackFabric
from kvflow_tools.testing import SMALL_SPEC, KVBuffers, same_kv


def poll_until(thread: EngineThread, count: int, timeout: float = 5.0) -> list[TransferResult]:
    """What a host engine does every step: a non-blocking poll, until `count` outcomes came."""
    results: list[TransferResult] = []
    end = time.monotonic() + timeout
    while len(results) < count and time.monotonic() < end:
        results += thread.poll_finished()
        time.sleep(0.001)
    return results


def test_engines_on_their_own_threads_serve_calls_from_many_threads() -> None:
    fabric, hub = LoopbackFabric(), LocalControlHub()
    p_kv, d_kv = KVBuffers(SMALL_SPEC, 64), KVBuffers(SMALL_SPEC, 64)
    config = EngineConfig(transfer_timeout=10.0)
    prefill = EngineThread(lambda: Engine("P", p_kv.layout, fabric.endpoint("P"), hub.channel("P"), config=config))
    decode = EngineThread(lambda: Engine("D", d_kv.layout, fabric.endpoint("D"), hub.channel("D"), config=config))
    try:
        assert prefill.engine._loop is not None and decode.engine._loop is not prefill.engine._loop
        decode.connect("P").result(timeout=5)
        p_kv.fill(range(32), seed=7)

        def scheduler(worker: int) -> None:  # several host threads, each moving 8 transfers
            for i in range(8):
                n = worker * 8 + i
                decode.expect(f"r{n}", 1, peer="P", block_ids=[n], mode=Mode.PUSH if n % 2 else Mode.PULL)
                prefill.kv_ready(f"r{n}", 1, block_ids=[n], mode=Mode.PUSH if n % 2 else Mode.PULL, peer="D")

        threads = [threading.Thread(target=scheduler, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = poll_until(decode, 32)
        assert sorted(r.key.transfer_id for r in results) == sorted(f"r{n}" for n in range(32))
        assert all(r.ok and r.role is Role.DECODE for r in results)
        assert same_kv(p_kv, range(32), d_kv, range(32))
        released: list[int] = []
        end = time.monotonic() + 5
        while len(released) < 32 and time.monotonic() < end:
            released += [b for r in prefill.poll_released() for b in r.block_ids]
            time.sleep(0.001)
        assert sorted(released) == list(range(32))
        # a bad call fails its future, not the caller's thread, and leaves the engine running
        with pytest.raises(InvalidBatch):
            decode.expect("bad", 1, peer="P", block_ids=[]).result(timeout=5)
    finally:
        decode.close()
        prefill.close()
        fabric.close()
    with pytest.raises(EngineClosed):
        decode.expect("late", 1, peer="P", block_ids=[1])


def test_a_batch_starts_its_calls_together_in_order_when_it_ends() -> None:
    """What a host engine's hook does: its calls start with one wake-up, after the hook."""
    fabric, hub = LoopbackFabric(), LocalControlHub()
    kv = KVBuffers(SMALL_SPEC, 8)
    thread = EngineThread(lambda: Engine("P", kv.layout, fabric.endpoint("P"), hub.channel("P")))
    ran: list[str] = []

    def record(name: str) -> Any:
        async def run(_: Engine) -> str:
            ran.append(name)
            if name == "bad":
                raise InvalidBatch("refused")
            return name

        return run

    try:
        with thread.batch():
            first = thread.call(record("a"))
            with thread.batch():  # nested: joins the outer batch
                bad = thread.call(record("bad"))
            last = thread.call(record("b"))
            # another thread's call is not batched: it runs now, and the batch's have not
            elsewhere: list[Any] = []
            other = threading.Thread(target=lambda: elsewhere.append(thread.call(record("x")).result(timeout=5)))
            other.start()
            other.join()
            assert elsewhere == ["x"] and ran == ["x"]
        assert first.result(timeout=5) == "a" and last.result(timeout=5) == "b"
        with pytest.raises(InvalidBatch):
            bad.result(timeout=5)
        assert ran == ["x", "a", "bad", "b"]
    finally:
        thread.close()
        fabric.close()


@pytest.mark.parametrize("name", ["expect", "kv_ready", "abort"])
def test_the_thread_facade_takes_exactly_what_the_engine_takes(name: str) -> None:
    """A parameter added to the engine and not to its thread facade (D's `share`, an abort's
    `peer`) made callers route around the facade; a renamed one (`ttl`) made them guess."""
    import inspect

    def shape(function: Any) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    assert shape(getattr(EngineThread, name)) == shape(getattr(Engine, name))


def test_a_wait_that_runs_out_says_what_it_waited_for() -> None:
    """A thread that cannot start is an engine's timeout, not a transfer's; all of them are
    `Timeout`s and `TimeoutError`s, so one except clause still catches any."""
    from kvflow.errors import EngineTimeout, HandshakeTimeout, Timeout, TransferTimeout

    for kind in (EngineTimeout, HandshakeTimeout, TransferTimeout):
        assert issubclass(kind, Timeout) and issubclass(kind, TimeoutError)
    assert not issubclass(EngineTimeout, TransferTimeout) and not issubclass(HandshakeTimeout, TransferTimeout)

    def never_built() -> Engine:
        time.sleep(1.0)  # far past the start timeout below
        raise AssertionError("a factory that took too long")

    with pytest.raises(EngineTimeout, match="did not start within 0.2s"):
        EngineThread(never_built, start_timeout=0.2)
