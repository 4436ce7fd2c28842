"""The control channel's answer to idle connections when its process is short of descriptors
(kvflow/control/connections.py), driven through a real ROUTER and real DEALERs.

A peer's connection that carries nothing holds a descriptor for as long as its other end likes.
While the process is short, the channel closes such connections (after a second of silence)
and refuses new handshakes at ZAP, with or without a secret: without one, ZAP runs for NULL
connections only to say no when there is no room.  The flood against a process at 128
descriptors is `kvflow bench floods --attack idle_insiders` (tests/test_bench_floods.py).
"""

from __future__ import annotations

import asyncio

import pytest
import zmq

from kvflow.control import connections
from kvflow.control.zeromq import ZmqControl
from tests.waiting import eventually


async def _nothing(sender: str, message: object) -> None:
    return None


@pytest.mark.asyncio
async def test_without_a_secret_idle_connections_are_closed_and_new_ones_refused_while_short(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    control = ZmqControl("P", secret=None)
    control.start(asyncio.get_running_loop(), _nothing)  # type: ignore[arg-type]
    ctx = zmq.Context()
    dealers: list[zmq.Socket[bytes]] = []
    try:
        for _ in range(4):  # connected while there is room: admitted by ZAP, then idle
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RECONNECT_IVL, 60_000)  # closed, it stays away while the test looks
            dealer.connect(control.address)
            dealers.append(dealer)
        await eventually(lambda: control.counters["zap_admitted"] == 4, "ZAP admits the NULL handshakes")
        assert control.counters["connections_closed_short"] == 0
        assert connections.keep_free() == connections.KEEP_FREE  # under this process's limit
        monkeypatch.setattr(connections, "descriptors_left", lambda: 50)  # fewer than the 96 kept free
        await eventually(
            lambda: control.counters["connections_closed_short"] == 4, "the idle connections are closed", timeout=10
        )
        late = ctx.socket(zmq.DEALER)
        late.setsockopt(zmq.LINGER, 0)
        late.connect(control.address)
        dealers.append(late)
        await eventually(
            lambda: control.counters["connections_refused_short"] >= 1, "a new handshake is refused", timeout=10
        )
        assert control.counters["zap_refused"] >= 1
    finally:
        for dealer in dealers:
            dealer.close(linger=0)
        ctx.term()
        control.close()
