"""Values that enter through the local API are bounded by what the wire carries.

Why a module of its own: a key the engine accepted but cannot encode does its harm later and
elsewhere (the registration cannot be sent, and every heartbeat that lists the key fails, so
the association dies at its lease), so the bound is checked where the key enters, and a
message that cannot be encoded all the same fails its own transfer, never the association.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from kvflow.errors import ConfigError, PeerProtocolError, UnsendableMessage
from kvflow.protocol.core import CoreConfig
from kvflow.protocol.messages import (
    MAX_EPOCH,
    MAX_TRANSFER_ID,
    ControlMessage,
    Heartbeat,
    Registration,
    TransferKey,
)
from kvflow.protocol.state import Mode, Outcome, Role
from kvflow.runtime.engine import EngineConfig
from kvflow.transports.loopback import LoopbackFabric
from kvflow_tools.testing import EnginePair, same_kv
from tests.waiting import eventually

FAST = EngineConfig(core=CoreConfig(fence_timeout=0.5, retention=5.0), transfer_timeout=5.0, drain_timeout=2.0)
BAD_KEYS = [
    ("t", MAX_EPOCH + 1, "epoch"),  # msgpack carries it in a heartbeat's uint64, not as an int64
    ("t", 2**64, "epoch"),  # nothing carries it
    ("t", -1, "epoch"),
    ("t", True, "epoch"),
    ("x" * (MAX_TRANSFER_ID + 1), 1, "transfer id"),
    ("", 1, "transfer id"),
    ("a\ud800", 1, "lone surrogate"),  # what JSON's "\ud800" decodes to
]


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[EnginePair]:
    engines = await EnginePair(LoopbackFabric(), config=FAST).start()
    yield engines
    await engines.close()


async def one_transfer_works(pair: EnginePair, transfer_id: str) -> None:
    """A genuine push transfer between the pair completes and moves the bytes."""
    pair.p_kv.fill([3], seed=7)
    waiting = await pair.d.expect(transfer_id, 1, peer="P", block_ids=[4])
    sending = await pair.p.kv_ready(transfer_id, 1, block_ids=[3])
    assert (await sending.wait(5)).ok and (await waiting.wait(5)).ok
    assert same_kv(pair.p_kv, [3], pair.d_kv, [4])


@pytest.mark.asyncio
@pytest.mark.parametrize(("transfer_id", "epoch", "what"), BAD_KEYS)
async def test_the_local_api_refuses_a_key_the_wire_cannot_carry_and_changes_nothing(
    pair: EnginePair, transfer_id: str, epoch: Any, what: str
) -> None:
    calls = [
        pair.d.expect(transfer_id, epoch, peer="P", block_ids=[1]),
        pair.d.expect(transfer_id, epoch, peer="P", block_ids=[1], mode=Mode.PULL),
        pair.p.kv_ready(transfer_id, epoch, block_ids=[1]),
        pair.p.promise(transfer_id, epoch, peer="D"),
        pair.p.abort(transfer_id, epoch, Role.PREFILL),
        pair.d.abort(transfer_id, epoch, Role.DECODE, peer="P"),
    ]
    for call in calls:
        with pytest.raises(ConfigError, match=what):
            await call
    for engine in (pair.p, pair.d):
        assert engine.core.machines() == [] and engine.core.ledger.held_blocks == 0
    assert pair.d.peers() == ["P"] and pair.p.peers() == ["D"]
    await one_transfer_works(pair, "genuine")


@pytest.mark.asyncio
async def test_a_message_that_cannot_be_encoded_fails_its_transfer_and_nothing_else(pair: EnginePair) -> None:
    # Whatever slips past the bounds (a frame over the limit, say): D's registration for one
    # transfer cannot be encoded.  That transfer fails, naming why; the association and the
    # next transfer are untouched.
    send = pair.d.control.send

    def refusing(peer: str, message: ControlMessage) -> None:
        if isinstance(message, Registration) and message.key.transfer_id == "poisoned":
            raise UnsendableMessage("control frame of 1048577 bytes exceeds 1048576")
        send(peer, message)

    pair.d.control.send = refusing  # type: ignore[method-assign]
    waiting = await pair.d.expect("poisoned", 1, peer="P", block_ids=[1, 2])
    result = await waiting.wait(5)
    assert result.outcome is Outcome.ABORTED and "its Registration: control frame of 1048577" in result.reason
    await eventually(lambda: pair.d.core.ledger.held_blocks == 0, "D's blocks come back")
    assert pair.d.peers() == ["P"] and pair.p.peers() == ["D"]  # no teardown
    assert pair.d.stats()["crashed"] == 0
    await one_transfer_works(pair, "next")


@pytest.mark.asyncio
async def test_the_in_process_channel_refuses_what_the_wire_would(pair: EnginePair) -> None:
    # LocalControl encodes as ZmqControl does, so in-process tests meet the wire's limits too.
    with pytest.raises(UnsendableMessage, match="Heartbeat"):
        pair.d.control.send("P", Heartbeat((TransferKey("t", 2**64),)))


@pytest.mark.asyncio
async def test_any_exception_of_the_transport_adding_a_peer_refuses_the_peer_and_crashes_nothing() -> None:
    # What a Hello advertises reaches the transport's own code (a NUL byte in a file name made
    # the shared-memory transport raise ValueError): whatever it raises refuses that peer only.
    pair = await EnginePair(LoopbackFabric(), config=FAST).start(connect=False)
    add_peer = pair.p.transport.add_peer

    def broken(*args: Any) -> None:
        raise ValueError("embedded null byte")

    pair.p.transport.add_peer = broken  # type: ignore[method-assign,assignment]
    try:
        with pytest.raises(PeerProtocolError, match="ValueError: embedded null byte"):
            await pair.d.connect("P", timeout=5)
        assert pair.p.stats()["peers_refused"] == 1 and not pair.p.crashed and pair.p.peers() == []
        pair.p.transport.add_peer = add_peer  # type: ignore[method-assign]
        await pair.d.connect("P", timeout=5)
        await one_transfer_works(pair, "after")
    finally:
        await pair.close()
