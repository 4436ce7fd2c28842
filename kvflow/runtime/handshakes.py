"""The futures a local `connect` awaits while its handshake is decided.

Why apart from the engine: deciding a handshake is pure (`kvflow.protocol.association`); waiting
for one is the only part that needs the loop.  One future per peer, shared by every `connect`
to that peer, settled once with the association's verdict.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvflow.errors import EngineClosed, HandshakeTimeout, KVFlowError

__all__ = ("Handshakes",)


class Handshakes:
    def __init__(self, unanswered: Callable[[str], None] = lambda peer: None) -> None:
        """`unanswered(peer)` runs when a wait for `peer` ran out with nothing else waiting (so
        that what was opened for the handshake, a connection and a route, can go)."""
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._unanswered = unanswered

    def begin(self, peer: str, loop: asyncio.AbstractEventLoop) -> None:
        """A handshake with `peer` is under way (a second `connect` joins the first)."""
        waiter = self._waiters.get(peer)
        if waiter is None or waiter.done():
            self._waiters[peer] = loop.create_future()

    def settle(self, peer: str, error: KVFlowError | None) -> None:
        """The handshake with `peer` succeeded (`error` None) or failed with `error`.  The
        verdict stays for the `wait` of the `connect` that began it, which may come after: a
        handshake refused at once (a peer not permitted, the peer limit) settles before it."""
        waiter = self._waiters.get(peer)
        if waiter is not None and not waiter.done():
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(error)

    def under_way(self, peer: str) -> bool:
        """Whether a handshake with `peer` is under way (a `connect` then joins it instead of
        sending a second Hello, which the peer would take for a restart of this engine)."""
        waiter = self._waiters.get(peer)
        return waiter is not None and not waiter.done()

    async def wait(self, peer: str, timeout: float) -> None:
        """Wait for the handshake with `peer`, if one is under way.

        :raises HandshakeTimeout: no verdict within `timeout` seconds.
        :raises KVFlowError: the error the handshake failed with.
        """
        waiter = self._waiters.get(peer)
        if waiter is None:
            return  # already associated
        if waiter.done():
            del self._waiters[peer]
            waiter.result()  # raises the error it failed with
            return
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            if self._waiters.get(peer) is waiter:  # unanswered: the next connect starts over
                del self._waiters[peer]
                self._unanswered(peer)
            raise HandshakeTimeout(f"handshake with {peer!r} got no answer within {timeout}s") from None
        finally:
            if self._waiters.get(peer) is waiter and waiter.done():
                del self._waiters[peer]

    def close(self, engine_id: str) -> None:
        """The engine closes: every handshake still under way fails with `EngineClosed`.  The
        error is marked seen: a `connect` that failed before it waited (its Hello could not be
        sent) left a handshake nobody awaits, and asyncio would log its error as lost."""
        for peer, waiter in list(self._waiters.items()):
            self.settle(peer, EngineClosed(f"engine {engine_id!r} closed during the handshake with {peer!r}"))
            if waiter.done() and not waiter.cancelled():
                waiter.exception()
