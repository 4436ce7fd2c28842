"""A peer lost for silence, on a transport that cannot fence its writes: when D's blocks go back.

A WRITE the peer posted before the link died may land whenever the link returns, so D fails the
transfer at the end of the unfenced grace but keeps its blocks quarantined until the peer has
associated again (and TCP's backoff had time to deliver), or until `unfenced_hold` when it never
comes back.  In-process engines: a control hub whose link can be cut (messages vanish both ways,
as on a dead link) and a loopback transport that, like NIXL, reports it cannot fence inbound ops.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import pytest
import pytest_asyncio

from kvflow.control.channel import LocalControlHub
from kvflow.errors import KVFlowError
from kvflow.protocol.core import CoreConfig
from kvflow.protocol.messages import ControlMessage
from kvflow.protocol.state import Outcome
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.testing import SMALL_SPEC, KVBuffers
from kvflow.transports.base import TransportCapabilities
from kvflow.transports.loopback import LoopbackFabric, LoopbackTransport
from tests.waiting import eventually

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


async def pair(config: EngineConfig) -> AsyncIterator[Pair]:
    fabric, hub = LoopbackFabric(), CuttableHub()
    kv = {name: KVBuffers(SMALL_SPEC, 8) for name in "PD"}
    p = Engine("P", kv["P"].layout, fabric.endpoint("P"), hub.channel("P"), config=config)
    d = Engine("D", kv["D"].layout, Unfenced("D", fabric=fabric), hub.channel("D"), config=config)
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
async def test_a_silent_peers_blocks_go_back_only_after_it_associated_again(engines: Pair) -> None:
    await lose_p_for_silence(engines)
    await eventually(lambda: engines.p.peers() == [], "P tore D down too")
    engines.hub.cut = False
    for _ in range(50):  # D refuses a new association until its grace is over
        try:
            await engines.d.connect("P", timeout=2)
            break
        except KVFlowError:  # refused while D's grace lasts: try again
            await asyncio.sleep(0.05)
    assert engines.d.peers() == ["P"]
    # just associated: what the link held may only now be on its way
    assert engines.d.core.ledger.quarantined_blocks == 1
    await eventually(lambda: engines.d.core.ledger.held_blocks == 0, "D's block back", 10)
    assert engines.d.crashed == []


@pytest.mark.asyncio
async def test_a_silent_peer_that_never_comes_back_holds_the_blocks_unfenced_hold_at_most(short_hold: Pair) -> None:
    await lose_p_for_silence(short_hold)
    await eventually(lambda: short_hold.d.core.ledger.held_blocks == 0, "D's block back after the hold", 10)
    assert short_hold.d.peers() == [] and short_hold.d.crashed == []
