"""`Handshakes`: a handshake nobody waits for any more leaves no error for asyncio to report lost."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from kvflow.errors import EngineClosed
from kvflow.runtime.handshakes import Handshakes


@pytest.mark.asyncio
async def test_closing_settles_an_unawaited_handshake_without_a_lost_error() -> None:
    """A `connect` whose Hello could not be sent raised before it waited: its handshake is
    still under way when the engine closes, and asyncio logged "Future exception was never
    retrieved" for it (seen with an insider's hundreds of names against a full control queue)."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        handshakes = Handshakes()
        handshakes.begin("P", loop)
        assert handshakes.under_way("P")
        handshakes.close("D")
        assert not handshakes.under_way("P")
        del handshakes
        gc.collect()
        await asyncio.sleep(0)
        assert reported == []
    finally:
        loop.set_exception_handler(None)


@pytest.mark.asyncio
async def test_a_connect_waiting_when_the_engine_closes_still_gets_engine_closed() -> None:
    loop = asyncio.get_running_loop()
    handshakes = Handshakes()
    handshakes.begin("P", loop)
    waiting = asyncio.ensure_future(handshakes.wait("P", 5.0))
    await asyncio.sleep(0)
    handshakes.close("D")
    with pytest.raises(EngineClosed, match="closed during the handshake with 'P'"):
        await waiting
