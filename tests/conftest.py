"""Test-wide settings: keep UCX (inside NIXL) on loopback, and NIXL's log quiet.

Set before any test imports NIXL, and inherited by the engine processes tests start.  Hypothesis
runs without its per-example deadline and its too-slow health check: both are wall-clock limits,
and tests share the machine with each other (pytest-xdist) and with whatever else runs.  Also the
fixtures more than one module uses.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

from kvflow_tools.children import import_path

if TYPE_CHECKING:
    from tests.hostile import Zmq

# the engine processes run this checkout's code (before whatever PYTHONPATH already names)
os.environ["PYTHONPATH"] = os.pathsep.join([import_path(), *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

settings.register_profile("kvflow", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvflow")


try:
    import pytest_asyncio
except ImportError:  # a GPU machine runs the hardware tests only, and has no pytest-asyncio
    pass
else:

    @pytest_asyncio.fixture
    async def zmq_p() -> AsyncIterator[Zmq]:
        """A running engine "P" over authenticated ZeroMQ (`tests.hostile.Zmq`)."""
        from tests.hostile import Zmq

        engine = Zmq()
        await engine.p.start()
        yield engine
        await engine.close()


@pytest.fixture
def prefix() -> Iterator[str]:
    """A unique prefix for an engine process's shared-memory names; what a SIGKILLed one left is removed."""
    tag = f"kvflow-test-{uuid.uuid4().hex[:8]}"
    yield tag
    for leftover in Path("/dev/shm").glob(f"{tag}*"):  # what a SIGKILLed process left behind
        if leftover.is_dir():
            for item in leftover.iterdir():
                item.unlink()
            leftover.rmdir()
        else:
            leftover.unlink()
