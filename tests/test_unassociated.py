"""A peer that still speaks to an engine that ended their association without it hearing (its
Goodbye lost, or never sent: a link cut, a process restarted) is told so at once, and fails what
it started with that engine now instead of at each transfer's deadline.

Real ZeroMQ channels, authenticated, on loopback.  D tears P down while its Goodbye is lost;
P, still associated in its own eyes, hands D a pull transfer's KV.  Its Ready reaches D, which
has no association with P and no route to it any more: before, D counted the message and said
nothing, and P's transfer waited its whole deadline (60 s here).  Now D answers on the
connection the message came in on with a Goodbye (at most once a second per peer), P tears D
down, and P's transfer fails naming why; the next transfer associates anew and moves its KV."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from kvflow.control.auth import Secret
from kvflow.control.zeromq import ZmqControl
from kvflow.protocol.messages import ControlMessage, Goodbye
from kvflow.protocol.state import Mode, Outcome
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.transports.loopback import LoopbackFabric
from kvflow_tools.testing import SMALL_SPEC, KVBuffers, same_kv
from tests.waiting import eventually

SECRET = Secret(b"a shared secret of some length")
DEADLINE = 60.0  # what P's transfer would wait, unanswered
CONFIG = EngineConfig(transfer_timeout=DEADLINE, drain_timeout=1.0)


@pytest_asyncio.fixture
async def engines() -> AsyncIterator[tuple[Engine, Engine, KVBuffers, KVBuffers]]:
    fabric = LoopbackFabric()
    p_kv, d_kv = KVBuffers(SMALL_SPEC, 16), KVBuffers(SMALL_SPEC, 16)
    p = Engine("P", p_kv.layout, fabric.endpoint("P"), ZmqControl("P", secret=SECRET), config=CONFIG)
    d = Engine("D", d_kv.layout, fabric.endpoint("D"), ZmqControl("D", secret=SECRET), config=CONFIG)
    await p.start()
    await d.start()
    await d.connect("P", p.control.address, timeout=5)
    yield p, d, p_kv, d_kv
    await d.aclose()
    await p.aclose()


def tear_down_unheard(d: Engine, peer: str) -> None:
    """D ends its association with `peer` and its Goodbye is lost on the way."""
    send = d.control.send

    def losing_goodbyes(to: str, message: ControlMessage) -> None:
        if not isinstance(message, Goodbye):
            send(to, message)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(d.control, "send", losing_goodbyes)
        d.drop_peer(peer, "its link went down here")


@pytest.mark.asyncio
async def test_a_peer_speaking_after_an_unheard_teardown_is_told_and_fails_its_transfer_at_once(
    engines: tuple[Engine, Engine, KVBuffers, KVBuffers],
) -> None:
    p, d, p_kv, d_kv = engines
    tear_down_unheard(d, "P")
    assert d.peers() == [] and p.peers() == ["D"]  # P has not heard
    before = d.stats()["messages_from_unknown_peers"]
    p_kv.fill([4], seed=1)
    sending = await p.kv_ready("r", 1, block_ids=[4], mode=Mode.PULL, peer="D")
    result = await asyncio.wait_for(sending.wait(DEADLINE), DEADLINE / 2)  # (unanswered: at DEADLINE)
    assert result.outcome is Outcome.FAILED and "not associated" in result.reason, result
    assert p.peers() == [] and d.stats()["messages_from_unknown_peers"] > before
    # the next transfer associates anew (as the connector does: D connects to the P its request
    # names) and moves the KV
    await d.connect("P", p.control.address, timeout=20)
    p_kv.fill([5], seed=2)
    waiting = await d.expect("s", 1, peer="P", block_ids=[6], timeout=30)
    sent = await p.kv_ready("s", 1, block_ids=[5], peer="D", timeout=30)
    got, done = await waiting.wait(30), await sent.wait(30)
    assert got.ok and done.ok, (got, done)
    assert same_kv(p_kv, [5], d_kv, [6])


@pytest.mark.asyncio
async def test_a_goodbye_from_a_peer_with_no_association_is_never_answered(
    engines: tuple[Engine, Engine, KVBuffers, KVBuffers],
) -> None:
    """Two sides that each forgot the other do not answer each other's Goodbyes for ever."""
    p, d, _, _ = engines
    tear_down_unheard(d, "P")
    assert isinstance(d.control, ZmqControl)
    sent_before = d.control.counters["frames_sent"]
    p.control.send("D", Goodbye("closing"))
    await eventually(lambda: d.stats()["messages_from_unknown_peers"] >= 1, "D got P's Goodbye")
    await asyncio.sleep(0.2)
    assert d.control.counters["frames_sent"] == sent_before and p.peers() == ["D"]
