"""An engine put to sleep (vLLM's sleep mode) and woken: `Engine.unregister_memory` and
`Engine.restore_memory`, in this process over loopback and in engine processes over NIXL.

Before sleep a live transfer fails with the reason named, peers get a Goodbye, nothing is held;
while asleep transfers and handshakes are refused; after wake-up the peers associate again and
a push lands byte for byte.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import kvflow
from kvflow.errors import EngineAsleep, PeerProtocolError
from kvflow.integrations.vllm.device import HostDevice
from kvflow.integrations.vllm.links import ProcessLink
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.requests import Expect, KvReady
from kvflow.protocol.state import Outcome, Role
from kvflow.runtime.engine import EngineConfig
from kvflow.runtime.host_memory import share_in_place
from kvflow.runtime.process import EngineProcess, ProcessSpec
from kvflow.runtime.sleep import ASLEEP
from kvflow.transports.loopback import LoopbackFabric
from kvflow_tools.testing.pair import EnginePair, same_kv
from tests.waiting import eventually

# ---------------------------------------------------------------- in this process, over loopback


@pytest.mark.asyncio
async def test_a_live_transfer_fails_with_the_reason_and_the_peers_associate_again_after_wake_up() -> None:
    pair = await EnginePair(LoopbackFabric()).start()
    try:
        waiting = await pair.d.expect("live", 1, peer="P", block_ids=[1, 2])  # P never sends it
        await eventually(lambda: bool(pair.p.core.live()), "P holds D's registration")
        for _ in range(2):  # twice: harmless
            await pair.d.unregister_memory()
        result = await waiting.wait(5)
        assert not result.ok and result.reason == ASLEEP  # aborted here, for the reason named
        assert pair.d.peers() == [] and pair.d.core.ledger.held_blocks == 0
        await eventually(lambda: not pair.p.core.live() and pair.p.peers() == [], "P hears the Goodbye")
        with pytest.raises(EngineAsleep, match="asleep"):
            await pair.d.expect("asleep", 1, peer="P", block_ids=[3])
        with pytest.raises(EngineAsleep, match="asleep"):
            await pair.d.connect("P")
        await pair.p.unregister_memory()
        await pair.d.restore_memory()
        with pytest.raises(PeerProtocolError, match="accepts no handshake now: engine asleep"):
            await pair.d.connect("P")  # P, asleep, refuses the Hello
        for _ in range(2):
            await pair.p.restore_memory()
        await pair.d.connect("P")
        pair.p_kv.fill([5, 6], seed=3)
        waiting = await pair.d.expect("after", 1, peer="P", block_ids=[7, 8])
        sending = await pair.p.kv_ready("after", 1, block_ids=[5, 6])
        assert (await waiting.wait(5)).ok and (await sending.wait(5)).ok
        assert same_kv(pair.p_kv, [5, 6], pair.d_kv, [7, 8])
        await eventually(lambda: not pair.p.core.live() and not pair.d.core.live(), "both settle")
        assert pair.p.core.ledger.held_blocks == pair.d.core.ledger.held_blocks == 0
    finally:
        await pair.close()


# ---------------------------------------------------------------- engine processes, over NIXL

SPEC = kvflow.KVSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="float16")
NUM_BLOCKS = 8
# no grace after a teardown: each side may associate again at once (RDMA's grace is for late
# WRITEs of a peer gone silent, not for one that said Goodbye)
CONFIG = EngineConfig(unfenced_grace=0.0)


def _engine(name: str, caches: list[np.ndarray]) -> EngineProcess:
    regions = [kvflow.region_of(a) for a in caches]
    spans = share_in_place(regions)
    try:
        layout = kvflow.KVLayout.per_layer_regions(SPEC, NUM_BLOCKS, regions)
        spec = ProcessSpec(name, layout, transport="nixl", transport_options={"cuda": False}, config=CONFIG)
        return EngineProcess(spec, spans)
    finally:
        for span in spans:
            os.close(span.fd)


@pytest.fixture
def links() -> Iterator[tuple[ProcessLink, ProcessLink, list[np.ndarray], list[np.ndarray]]]:
    p_cache = [_pages((2, NUM_BLOCKS, SPEC.block_len)) for _ in range(SPEC.num_layers)]
    d_cache = [_pages((2, NUM_BLOCKS, SPEC.block_len)) for _ in range(SPEC.num_layers)]
    p = _engine("prefill-0", p_cache)
    try:
        d = _engine("decode-0", d_cache)
    except BaseException:
        p.close()
        raise
    yield ProcessLink(p, HostDevice()), ProcessLink(d, HostDevice()), p_cache, d_cache
    d.close()
    p.close()


def _pages(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed array on pages of its own.  (32 KiB arrays from numpy's allocator lie side by
    side on the heap: P's and D's would share a page, and whichever engine's memory file maps it
    last would take it from the other, whose engine then reads or writes a page the test no
    longer sees.)"""
    return np.frombuffer(mmap.mmap(-1, int(np.prod(shape))), np.uint8).reshape(shape)


def _call(link: ProcessLink, name: str, *args: Any) -> Any:
    return link.wait(link.command(name, *args), 30.0)


def _push(p: ProcessLink, d: ProcessLink, p_cache: list[np.ndarray], d_cache: list[np.ndarray], tid: str) -> None:
    rng = np.random.default_rng(len(tid))
    for layer in p_cache:
        layer[:, [0, 1, 2]] = rng.integers(0, 256, layer[:, [0, 1, 2]].shape, np.uint8)
    _call(d, "connect", "prefill-0", p.address)
    expected = d.command("submit", Expect(TransferKey(tid, 1), "prefill-0", [4, 5, 7]).to_wire())
    ready = p.command("submit", KvReady(TransferKey(tid, 1), [0, 1, 2]).to_wire())
    assert (d.wait(expected, 30.0), p.wait(ready, 30.0)) == (None, None)
    got: list[Any] = []

    def released() -> bool:
        got.extend(d.poll_released() + p.poll_released())
        return len(got) == 2

    _until(released)
    assert {(r.role, r.outcome) for r in got} == {(Role.DECODE, Outcome.SUCCEEDED), (Role.PREFILL, Outcome.SUCCEEDED)}
    for p_layer, d_layer in zip(p_cache, d_cache, strict=True):
        assert np.array_equal(p_layer[:, [0, 1, 2]], d_layer[:, [4, 5, 7]])


def _until(condition: Callable[[], bool]) -> None:
    """Poll `condition` until it holds; the deadline only guards against a hang."""
    end = time.monotonic() + 30.0
    while not condition():
        assert time.monotonic() < end, "not within 30 s"
        time.sleep(0.002)


def test_engine_processes_over_nixl_sleep_and_wake_and_a_push_lands_after(links: Any) -> None:
    p, d, p_cache, d_cache = links
    _push(p, d, p_cache, d_cache, "before")
    for link in (p, d):
        for _ in range(2):  # twice: harmless
            _call(link, "unregister_memory")
    with pytest.raises(EngineAsleep, match="asleep"):
        _call(d, "submit", Expect(TransferKey("asleep", 1), "prefill-0", [1]).to_wire())
    for link in (p, d):
        for _ in range(2):
            _call(link, "restore_memory")
    _push(p, d, p_cache, d_cache, "after-wake")
    for link in (p, d):  # a side's transfer retires a moment after its blocks came back
        stats: dict[str, Any] = {}

        def settled(link: ProcessLink = link, stats: dict[str, Any] = stats) -> bool:
            stats.update(_call(link, "stats"))
            return bool(stats["held_blocks"] == stats["live_transfers"] == 0)

        _until(settled)
        assert stats["crashed"] == 0, stats
