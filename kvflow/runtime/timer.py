"""The engine's one timer: armed for the earliest deadline the pure layer reports.

Why apart: the core and the associations say *when* something is due (`next_deadline`); the
driver only keeps one loop timer at that instant, re-armed when the instant changes, and calls
back when it passes.  Keeping that bookkeeping here keeps the engine a list of event handlers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ("DeadlineTimer",)


class DeadlineTimer:
    """A loop timer for one instant at a time (the clock's, not necessarily the loop's)."""

    def __init__(self) -> None:
        self._handle: asyncio.TimerHandle | None = None
        self._at: float | None = None

    def arm(
        self,
        loop: asyncio.AbstractEventLoop | None,
        when: float | None,
        clock: Callable[[], float],
        fire: Callable[[], None],
    ) -> None:
        """Call `fire` on `loop` once `clock` reads `when` (None: no deadline; no loop: not
        running, nothing armed).  An instant already armed is left as it is.

        :raises Exception: what `clock` raises.
        """
        if when == self._at:
            return
        self.cancel()
        if when is None or loop is None:
            return
        self._at = when
        self._handle = loop.call_later(max(when - clock(), 0.0), fire)

    def fired(self) -> float | None:
        """The timer went off: nothing is armed any more.  The instant it was armed for."""
        at, self._handle, self._at = self._at, None, None
        return at

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle, self._at = None, None
