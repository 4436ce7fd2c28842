"""A peer lost for silence, on a transport that cannot fence its writes: when D's blocks go back.

A WRITE the peer posted before the link died may land whenever the link returns, so D fails the
transfer at the end of the unfenced grace but keeps its blocks quarantined until the peer has
associated again (and TCP's backoff had time to deliver), or until `unfenced_hold` when it never
comes back.  In-process engines: a control hub whose link can be cut (messages vanish both ways,
as on a dead link) and a loopback transport that, like NIXL, reports it cannot fence inbound ops.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import pytest
import pytest_asyncio

from kvflow.control.channel import LocalControlHub
from kvflow.errors import KVFlowError
from kvflow.protocol.core import CoreConfig
from kvflow.protocol.messages import ControlMessage
from kvflow.protocol.state import Outcome
from kvflow.protocol.teardown import HoldReport
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.transports.base import TransportCapabilities
from kvflow.transports.loopback import LoopbackFabric, LoopbackTransport
from kvflow_tools.testing import SMALL_SPEC, KVBuffers, ManualClock
from tests.waiting import eventually, quiesce

CONFIG = EngineConfig(
    core=CoreConfig(fence_timeout=1.0, retention=30.0),
    transfer_timeout=30.0,
    drain_timeout=0.5,
    lease=0.4,
    unfenced_grace=0.1,
    unfenced_hold=60.0,
)


class CuttableHub(LocalControlHub):
    """A control hub whose one link can be cut: what is sent meanwhile is lost, silently."""

    cut = False

    def route(self, sender: str, incarnation: int, peer: str, message: ControlMessage) -> None:
        if not self.cut:
            super().route(sender, incarnation, peer, message)


class Unfenced(LoopbackTransport):
    """Loopback that reports, as NIXL does, that it cannot stop a removed peer's writes."""

    @property
    def capabilities(self) -> TransportCapabilities:
        return replace(super().capabilities, fences_inbound=False)


@dataclass
class Pair:
    p: Engine
    d: Engine
    hub: CuttableHub


async def pair(config: EngineConfig, clock: ManualClock | None = None) -> AsyncIterator[Pair]:
    fabric, hub = LoopbackFabric(), CuttableHub()
    kv = {name: KVBuffers(SMALL_SPEC, 8) for name in "PD"}
    p = Engine("P", kv["P"].layout, fabric.endpoint("P"), hub.channel("P"), config=config, clock=clock)
    d = Engine("D", kv["D"].layout, Unfenced("D", fabric=fabric), hub.channel("D"), config=config, clock=clock)
    await p.start()
    await d.start()
    await d.connect("P", timeout=5)
    yield Pair(p, d, hub)
    hub.cut = False
    await d.aclose()
    await p.aclose()
    fabric.close()


@pytest_asyncio.fixture
async def engines() -> AsyncIterator[Pair]:
    async for made in pair(CONFIG):
        yield made


@dataclass
class Timed:
    engines: Pair
    clock: ManualClock

    async def at(self, now: float) -> None:
        """Move the clock to `now`, run what is due, and let D's removals return."""
        self.clock.now = now
        for engine in (self.engines.p, self.engines.d):
            engine.poke()
        await quiesce()
        # a removal runs on D's peer thread: wait for it however long a busy machine takes
        assert await self.engines.d.peers_settled(120.0), "D's peer thread never returned"
        await quiesce()


@pytest_asyncio.fixture
async def timed() -> AsyncIterator[Timed]:
    clock = ManualClock(1000.0)
    config = replace(CONFIG, lease=40.0, unfenced_grace=10.0, unfenced_hold=600.0, transfer_timeout=900.0)
    async for made in pair(config, clock):
        yield Timed(made, clock)


@pytest_asyncio.fixture
async def short_hold() -> AsyncIterator[Pair]:
    async for made in pair(replace(CONFIG, unfenced_hold=1.0)):
        yield made


async def lose_p_for_silence(engines: Pair) -> None:
    """D waits on a transfer from P when the link dies: it fails once the lease and grace ran out,
    and its block stays quarantined."""
    waiting = await engines.d.expect("r", 1, peer="P", block_ids=[4])
    await eventually(lambda: bool(engines.p.core.live()), "P has D's registration")
    engines.hub.cut = True
    result = await waiting.wait(10)
    assert result.outcome is Outcome.FAILED and "lost" in result.reason
    assert engines.d.core.ledger.quarantined_blocks == 1


@pytest.mark.asyncio
async def test_a_silent_peers_blocks_go_back_only_after_it_associated_again(timed: Timed) -> None:
    """On a manual clock, so every instant is exact: the teardown's grace, the refusal while D
    cools, the hold's end after the association (nothing runs on the loop's own time)."""
    engines, at = timed.engines, timed.at
    waiting = await engines.d.expect("r", 1, peer="P", block_ids=[4])
    await eventually(lambda: bool(engines.p.core.live()), "P has D's registration")
    engines.hub.cut = True
    await at(1040.0)  # a lease of silence: both tear down; D's removal returns at once
    assert engines.d.peers() == [] and engines.p.peers() == []
    # D's metrics say the rule: in its grace, then the whole hold unless P comes back
    assert engines.d.hold_report() == HoldReport({"grace": 1}, 10.0 + 600.0)
    assert waiting.done() is False  # D's grace: a write the link held may still land
    await at(1049.9)
    assert waiting.done() is False
    engines.hub.cut = False
    with pytest.raises(KVFlowError, match="tore 'P' down moments ago"):
        await engines.p.connect("D", timeout=60)  # D cools: no new association yet
    await at(1050.0)
    result = await waiting.wait(5)
    assert result.outcome is Outcome.FAILED and "lost" in result.reason
    assert engines.d.core.ledger.quarantined_blocks == 1
    assert engines.d.hold_report() == HoldReport({"holding": 1}, 600.0)
    timed.clock.now = 1060.0
    await engines.d.connect("P", timeout=60)
    assert engines.d.peers() == ["P"]
    assert engines.d.hold_report() == HoldReport({"holding": 1}, 10.0 + 40.0 + 20.0)  # shortened
    # associated 20 s after the teardown: a segment still retransmitted from before it has
    # waited at most the lease and those 20 s; it gets that, plus the grace, to land
    await at(1060.0 + 10.0 + 40.0 + 20.0 - 0.1)
    assert engines.d.core.ledger.quarantined_blocks == 1
    await at(1060.0 + 10.0 + 40.0 + 20.0)
    assert engines.d.core.ledger.held_blocks == 0 and engines.d.crashed == []
    # (the jump of 70 s on the manual clock was another lease of silence: a new teardown's grace)
    assert "holding" not in engines.d.hold_report().by_phase


@pytest.mark.asyncio
async def test_a_silent_peer_that_never_comes_back_holds_the_blocks_unfenced_hold_at_most(short_hold: Pair) -> None:
    await lose_p_for_silence(short_hold)
    await eventually(lambda: short_hold.d.core.ledger.held_blocks == 0, "D's block back after the hold", 10)
    assert short_hold.d.peers() == [] and short_hold.d.crashed == []


@pytest.mark.asyncio
async def test_a_silent_peer_with_nothing_of_it_quarantined_leaves_no_hold_behind(timed: Timed) -> None:
    engines, at = timed.engines, timed.at
    engines.hub.cut = True
    await at(1040.0)  # a lease of silence: torn down, with no transfer between them
    assert [r.phase.name for r in engines.d.assoc.teardowns.under_way()] == ["GRACE"]
    await at(1050.0)  # the grace is over: nothing is quarantined, so nothing is held
    assert engines.d.assoc.teardowns.under_way() == [] and engines.d.assoc.next_deadline() is None
    assert engines.d.core.ledger.held_blocks == 0 and engines.d.crashed == []
