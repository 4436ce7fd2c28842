"""A loop timer that fires a little early still runs what was due, once.

An event loop may run a `call_later` callback slightly before its instant (its clock's
resolution, a coarse selector timeout).  The engine's timer then reads a `now` just short of the
deadline: unclamped, nothing is due, and it re-arms for the same instant, again and again, until
the clock gets there (a busy loop on the engine's thread).  As aioquic does, the engine takes
`now` as at least the instant the timer was armed for.  Counted, not timed: here every timer
fires 50 ms early, and a transfer's expiry must take a handful of firings, not thousands.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvflow.control.channel import LocalControlHub
from kvflow.protocol.state import Outcome
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.transports.loopback import LoopbackFabric
from kvflow_tools.testing import SMALL_SPEC, KVBuffers

EARLY = 0.05


class EarlyLoop(asyncio.SelectorEventLoop):
    """Runs every timer `EARLY` seconds before its instant, and counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.timers = 0

    def call_later(  # type: ignore[override]  # (the stub types its arguments with a TypeVarTuple)
        self, delay: float, callback: Callable[..., Any], *args: Any, context: Any = None
    ) -> Any:
        self.timers += 1
        return super().call_later(max(delay - EARLY, 0.0), callback, *args, context=context)


async def expire_one(loop: EarlyLoop) -> tuple[Outcome, int]:
    """A D transfer from a peer that never comes, expiring after 0.3 s: its outcome, and the
    timers the loop ran meanwhile."""
    config = EngineConfig(transfer_timeout=0.3, drain_timeout=0.1)
    kv, fabric, hub = KVBuffers(SMALL_SPEC, 4), LoopbackFabric(), LocalControlHub()
    engine = Engine("D", kv.layout, fabric.endpoint("D"), hub.channel("D"), config=config)
    async with engine:
        before = loop.timers
        handle = await engine.expect("t", 1, peer="P", block_ids=[1])
        result = await handle.wait(10.0)
        return result.outcome, loop.timers - before


def test_a_timer_fired_early_runs_the_expiry_at_once() -> None:
    loop = EarlyLoop()
    try:
        outcome, timers = loop.run_until_complete(expire_one(loop))
    finally:
        loop.close()
    assert outcome is Outcome.EXPIRED
    assert timers <= 5, f"{timers} timers for one expiry: the engine re-armed for an instant it had reached"
