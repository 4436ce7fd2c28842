"""Event-loop selection: uvloop when it is installed, the standard loop otherwise.

Why a helper: embedders create loops in several places (the engine thread, examples, the
benchmark), and all of them should get the faster loop without each importing uvloop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ("loop_name", "new_event_loop", "run")

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on the loop `new_event_loop` picks."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    return f"{type(loop).__module__}.{type(loop).__name__}"
