"""Test-wide settings: keep UCX (inside NIXL) on loopback, and NIXL's log quiet.

Set before any test imports NIXL, and inherited by the engine processes tests start.  Also the
fixtures more than one module uses.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest_asyncio

if TYPE_CHECKING:
    from tests.test_hostile_peers import Zmq

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


@pytest_asyncio.fixture
async def zmq_p() -> AsyncIterator[Zmq]:
    """A running engine "P" over authenticated ZeroMQ (`tests.test_hostile_peers.Zmq`)."""
    from tests.test_hostile_peers import Zmq

    engine = Zmq()
    await engine.p.start()
    yield engine
    await engine.close()
