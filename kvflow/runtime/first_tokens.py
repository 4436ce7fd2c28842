"""First tokens peers sent for their transfers, kept until the engine's host asks for them.

Why apart from the transfer's outcomes: a first token (`kvflow.protocol.messages.FirstToken`)
is not part of a transfer's state.  P samples it when its prefill ends, which may be before or
after D's registration and before or after the KV lands; D's host (the vLLM connector) asks for
it once the KV has landed and holds the request until it comes, or until its own deadline.  So
a token may arrive before anyone asks (kept, bounded: the oldest goes first and is counted) and
a host may ask before it arrives (a waiter, bounded by the caller's timeout).  A token is kept
per (peer, transfer): only the peer a transfer names may say what its first token is.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from kvflow.errors import EngineClosed, UsageError
from kvflow.protocol.messages import TransferKey

__all__ = ("FirstTokens",)

_Slot = tuple[str, TransferKey]  # (the peer that sent it, its transfer)


class FirstTokens:
    """The first tokens that arrived and nobody took yet (at most `kept`), and who waits for which.
    Runs on the engine's loop."""

    def __init__(self, kept: int = 4096) -> None:
        self.kept = kept
        self.dropped = 0  # tokens let go of unclaimed, the oldest first, to stay within `kept`
        self._tokens: OrderedDict[_Slot, int] = OrderedDict()
        self._waiters: dict[_Slot, asyncio.Future[int]] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def arrived(self, peer: str, key: TransferKey, token: int) -> None:
        """`peer` says `token` is the first token of transfer `key`: for its waiter, or kept.
        The same slot said again keeps the last word.  Never raises."""
        waiter = self._waiters.pop((peer, key), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(token)
            return
        self._tokens[(peer, key)] = token
        self._tokens.move_to_end((peer, key))
        while len(self._tokens) > self.kept:
            self._tokens.popitem(last=False)
            self.dropped += 1

    async def take(self, peer: str, key: TransferKey, timeout: float) -> int | None:
        """The first token `peer` sent for `key`, waiting at most `timeout` seconds for it to
        arrive; None when it did not.  Taken: asked again, it is waited for again.

        :raises UsageError: someone waits for this token already.
        :raises EngineClosed: the engine closed while this waited.
        """
        slot = (peer, key)
        token = self._tokens.pop(slot, None)
        if token is not None:
            return token
        if slot in self._waiters:
            raise UsageError(f"the first token of {key} from {peer!r} is waited for already")
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters[slot] = waiter
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            return None
        finally:
            if self._waiters.get(slot) is waiter:
                del self._waiters[slot]

    def closed(self) -> None:
        """The engine closed: every waiter raises `EngineClosed`; nothing is kept."""
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(EngineClosed("engine closed while a first token was awaited"))
        self._waiters.clear()
        self._tokens.clear()
