"""The engine's `TransferMeter`: what each transfer's posting side records, and when, over the
loopback transport with real bytes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from kvflow.protocol.core import CoreConfig
from kvflow.protocol.messages import Done, TransferKey
from kvflow.protocol.state import Mode, Outcome, Role
from kvflow.runtime.engine import EngineConfig
from kvflow.runtime.meter import TransferMeter
from kvflow.transports.loopback import FaultPlan, LoopbackFabric
from kvflow_tools.testing import EnginePair
from tests.waiting import eventually

FAST = EngineConfig(core=CoreConfig(fence_timeout=0.5, retention=5.0), transfer_timeout=5.0, drain_timeout=2.0)
BLOCKS = [1, 2, 3]


def _bytes(pair: EnginePair, blocks: int) -> int:
    """What moving `blocks` blocks of every layer and array takes."""
    layout = pair.p.layout
    return blocks * layout.block_len * layout.spec.num_layers * layout.spec.arrays_per_layer


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[EnginePair]:
    engines = await EnginePair(LoopbackFabric(), config=FAST).start()
    yield engines
    await engines.close()


def _hold_dones(pair: EnginePair) -> list[tuple[Any, ...]]:
    """D's verdicts to P are held (returned) instead of delivered."""
    held: list[tuple[Any, ...]] = []
    route = pair.hub.route

    def holding(sender: str, incarnation: int, peer: str, message: Any) -> None:
        if isinstance(message, Done):
            held.append((sender, incarnation, peer, message))
        else:
            route(sender, incarnation, peer, message)

    pair.hub.route = holding  # type: ignore[method-assign]
    return held


@pytest.mark.asyncio
async def test_a_pushing_prefill_times_its_transfer_once_its_writes_completed(pair: EnginePair) -> None:
    """P's sample is there when its blocks come back (the step vLLM hears of them), before
    D's verdict; the verdict is counted when it arrives; D, which posted nothing, times nothing."""
    held = _hold_dones(pair)
    pair.p_kv.fill(BLOCKS, seed=3)
    waiting = await pair.d.expect("t1", 1, peer="P", block_ids=[5, 6, 7])
    await pair.p.kv_ready("t1", 1, block_ids=BLOCKS)
    await eventually(lambda: bool(pair.p.released) and bool(held), "P's blocks back, D's verdict held")
    reading = pair.p.meter.take()
    [sample] = reading.samples
    assert sample.nbytes == _bytes(pair, len(BLOCKS))
    assert sample.descriptors >= 1 and sample.seconds >= 0 and sample.post_seconds > 0
    assert reading.outcomes == {}  # D has not said yet
    pair.hub.route = type(pair.hub).route.__get__(pair.hub)  # type: ignore[method-assign]
    for message in held:
        pair.hub.route(*message)
    (await waiting.wait(5)).raise_for_outcome()
    await eventually(lambda: not pair.p.core.live(), "P hears D's verdict")
    assert pair.p.meter.take().outcomes == {"succeeded": 1}
    d_reading = pair.d.meter.take()
    assert d_reading.samples == [] and d_reading.outcomes == {"succeeded": 1}


@pytest.mark.asyncio
async def test_a_pulling_decode_times_its_reads(pair: EnginePair) -> None:
    pair.p_kv.fill(BLOCKS, seed=4)
    waiting = await pair.d.expect("t2", 1, peer="P", block_ids=[8, 9, 10], mode=Mode.PULL)
    await pair.p.kv_ready("t2", 1, block_ids=BLOCKS, mode=Mode.PULL, peer="D")
    (await waiting.wait(5)).raise_for_outcome()
    [sample] = pair.d.meter.take().samples
    assert sample.nbytes == _bytes(pair, len(BLOCKS))
    assert pair.p.meter.take().samples == []


@pytest.mark.asyncio
async def test_a_failed_write_is_counted_and_not_timed() -> None:
    pair = await EnginePair(LoopbackFabric(faults=FaultPlan(fail_ops={1})), config=FAST).start()
    try:
        waiting = await pair.d.expect("t3", 1, peer="P", block_ids=[5, 6])
        await pair.p.kv_ready("t3", 1, block_ids=[1, 2])
        result = await waiting.wait(5)
        assert not result.ok
        await eventually(lambda: not pair.p.core.live(), "P's side ends")
        reading = pair.p.meter.take()
        assert reading.samples == [] and reading.outcomes.get("failed") == 1
    finally:
        await pair.close()


def test_a_transfers_seconds_run_from_its_first_op_asked_to_its_outcome() -> None:
    """Given the times it is told, the meter samples a transfer from its first op asked for to
    its outcome, whatever clock drives it (the engine's loop clock has whole milliseconds)."""
    meter, key = TransferMeter(), TransferKey("t", 1)
    meter.op_asked(key, Role.PREFILL, now=10.0)
    meter.op_asked(key, Role.PREFILL, now=10.5)  # a later op does not restart the clock
    meter.op_posted(key, Role.PREFILL, nbytes=4096, descriptors=2, post_seconds=0.001)
    meter.resolved(key, Role.PREFILL, Outcome.SUCCEEDED, now=10.75)
    assert meter.take().samples == []  # one op is not reported posted yet
    meter.op_posted(key, Role.PREFILL, nbytes=4096, descriptors=1, post_seconds=0.002)
    [sample] = meter.take().samples
    assert (sample.seconds, sample.nbytes, sample.descriptors) == (0.75, 8192, 3)
    assert sample.post_seconds == pytest.approx(0.003)


def test_every_reading_is_the_takers_own_even_an_empty_one() -> None:
    """One caller adding to what it took must not show in another caller's reading."""
    meter = TransferMeter()
    first = meter.take()
    first.samples.append(None)  # type: ignore[arg-type]
    first.outcomes["succeeded"] = 99
    second = meter.take()
    assert second.samples == [] and second.outcomes == {} and second is not first


def test_one_quantile_for_every_figure_linear_between_closest_ranks() -> None:
    import math

    from kvflow.errors import ConfigError
    from kvflow.runtime.meter import quantile

    samples = list(range(1, 11))
    assert [quantile(samples, q) for q in (0.5, 0.9, 0.99)] == pytest.approx([5.5, 9.1, 9.91])
    assert quantile([7.0], 0.9) == 7.0 and quantile(reversed(samples), 0.0) == 1 and quantile(samples, 1.0) == 10
    assert math.isnan(quantile([], 0.5))
    for bad_q in (-0.1, 1.5, math.nan):
        with pytest.raises(ConfigError, match="between 0 and 1"):
            quantile(samples, bad_q)
    with pytest.raises(ConfigError, match="non-finite"):
        quantile([1.0, math.inf], 0.5)
