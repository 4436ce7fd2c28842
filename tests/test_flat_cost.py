"""Per-transfer cost stays flat: the machines the core hands out per transfer do not grow with
the finished transfers it keeps (for `retention`) nor with the transfers in flight.

Counted, not timed: `TransferStore.visited` counts every machine `live()` hands out, and the
engines run on a clock that stands still, so no heartbeat or retention timer runs meanwhile.
"""

from __future__ import annotations

import pytest

from kvflow.protocol.core import CoreConfig
from kvflow.protocol.messages import Done, TransferKey
from kvflow.runtime.engine import EngineConfig
from kvflow.transports.loopback import LoopbackFabric
from kvflow_tools.testing import EnginePair, ManualClock

CONFIG = EngineConfig(
    core=CoreConfig(max_peer_transfers=10_000, max_unstarted=10_000), transfer_timeout=60.0, drain_timeout=0.1
)


async def move(pair: EnginePair, tid: str) -> None:
    d = await pair.d.expect(tid, 1, peer="P", block_ids=[1])
    p = await pair.p.kv_ready(tid, 1, block_ids=[2], peer="D")
    assert (await d.wait(10.0)).ok and (await p.wait(10.0)).ok


def visited(pair: EnginePair) -> int:
    return pair.p.core.store.visited + pair.d.core.store.visited


async def cost_of_five(*, finished: int, in_flight: int) -> tuple[int, int]:
    """Machines visited by five transfers, and by one heartbeat's list, after `finished`
    transfers ended and with `in_flight` others registered (on blocks of their own) and open."""
    pair = await EnginePair(LoopbackFabric(), num_blocks=in_flight + 4, config=CONFIG, clock=ManualClock()).start()
    try:
        for i in range(finished):
            await move(pair, f"old{i}")
        for i in range(in_flight):
            await pair.d.expect(f"open{i}", 1, peer="P", block_ids=[i + 4])
        assert pair.d.core.live_count() == in_flight
        before = visited(pair)
        for i in range(5):
            await move(pair, f"new{i}")
        per_transfers = visited(pair) - before
        before = visited(pair)
        pair.d.core.heartbeat_keys("P", 0.0)
        return per_transfers, visited(pair) - before
    finally:
        await pair.close()


@pytest.mark.asyncio
async def test_transfers_visit_no_more_machines_when_many_finished_ones_are_kept() -> None:
    few = await cost_of_five(finished=2, in_flight=0)
    many = await cost_of_five(finished=200, in_flight=0)
    assert many == few, f"five transfers visited {many} machines after 200 finished, {few} after 2"


@pytest.mark.asyncio
async def test_transfers_visit_no_more_machines_when_many_are_in_flight() -> None:
    transfers_few, heartbeat_few = await cost_of_five(finished=0, in_flight=2)
    transfers_many, heartbeat_many = await cost_of_five(finished=0, in_flight=200)
    assert transfers_many == transfers_few, (
        f"{transfers_many} machines visited with 200 in flight, {transfers_few} with 2"
    )
    # a heartbeat lists what D waits on: it visits what is in flight, once per heartbeat
    assert (heartbeat_few, heartbeat_many) == (2, 200)


@pytest.mark.asyncio
async def test_finished_machines_are_kept_at_most_max_finished_and_retention() -> None:
    """Finished machines absorb late messages for `retention`, but no more than `max_finished`
    are kept, whatever the rate: the oldest goes first, so memory stays bounded with history."""
    config = EngineConfig(core=CoreConfig(max_finished=8, retention=30.0), transfer_timeout=60.0, drain_timeout=0.1)
    clock = ManualClock()
    pair = await EnginePair(LoopbackFabric(), config=config, clock=clock).start()
    try:
        for i in range(20):
            await move(pair, f"t{i}")
            clock.advance(1.0)
        for core in (pair.p.core, pair.d.core):
            kept = sorted(int(m.key.transfer_id[1:]) for m in core.machines())
            assert (core.finished_count(), kept) == (8, list(range(12, 20)))
        # a late message about a kept transfer is absorbed by its machine; one about a
        # forgotten transfer is one for no known transfer
        p = pair.p.core
        ignored, unknown = p.stats.ignored, p.stats.unknown_transfer
        assert p.receive("D", Done(TransferKey("t19", 1)), clock()) == []
        assert (p.stats.ignored, p.stats.unknown_transfer) == (ignored + 1, unknown)
        assert p.receive("D", Done(TransferKey("t0", 1)), clock()) == []
        assert (p.stats.ignored, p.stats.unknown_transfer) == (ignored + 1, unknown + 1)
        clock.advance(22.0)  # t12 ended 30 s ago (at 12: the clock is at 42), t13 29 s ago
        for core in (pair.p.core, pair.d.core):
            core.timer(clock())
            assert sorted(int(m.key.transfer_id[1:]) for m in core.machines()) == list(range(13, 20))
            assert core.next_deadline() == pytest.approx(clock() + 1.0)  # when t13 goes
            core.timer(clock() + 100.0)
            assert core.machines() == [] and core.finished_count() == 0
    finally:
        await pair.close()
