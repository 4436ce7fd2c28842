"""Waiting for an observable condition instead of sleeping.

Why: a test that sleeps and then asserts passes or fails with the machine's load.  These helpers
poll a condition and fail only when it does not hold within `timeout`, which is generous and
guards against a hang; it is never the property under test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Yield to the loop until `condition()` holds.

    :raises AssertionError: it did not hold within `timeout` seconds.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not condition():
        if loop.time() > end:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.002)


async def quiesce(turns: int = 20) -> None:
    """Run `turns` rounds of the loop's ready callbacks: control messages between in-process
    engines are delivered with `call_soon`, so every reply to what was already sent lands."""
    for _ in range(turns):
        await asyncio.sleep(0)


def eventually_sync(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """`eventually` for a test with no loop of its own: poll `condition()` every 2 ms.

    :raises AssertionError: it did not hold within `timeout` seconds.
    """
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.002)
