"""The engine's one interpreter: what the `Endpoint` decides, performed in order.

Why apart from the engine: the engine turns events (calls, messages, completions, its timer)
into endpoint inputs; this performs the effects the endpoint answers, and nothing else.  It
decides nothing: transfer effects go to the data plane (ops), to the control channel (messages)
and to `Outcomes` (futures, queues); peer effects go to `PeerExecutor`.  An outcome the endpoint
answers at once (a send that failed, a route refused, an op with no peer) is performed next, in
the same pass; an outcome that comes later (a peer added on the peer thread) is a new input.
After each pass it re-arms the engine's one timer when a deadline may have moved, and tells the
transport whether traffic is expected.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

from kvflow.protocol.actions import ReleaseBlocks, Resolve, SendMessage, SubmitOp
from kvflow.protocol.endpoint import Effect, Endpoint
from kvflow.protocol.peer_actions import AnswerUnassociated, TokenArrived, UnknownSender
from kvflow.runtime.dataplane import DataPlane
from kvflow.runtime.peering import PeerExecutor
from kvflow.runtime.results import Outcomes
from kvflow.transports.base import Transport

__all__ = ("Interpreter",)


class Interpreter:
    """Performs one engine's effects.  `now` is the engine's clock; `rearm` re-arms its timer
    for the endpoint's next deadline."""

    def __init__(
        self,
        endpoint: Endpoint,
        peers: PeerExecutor,
        data: DataPlane,
        outcomes: Outcomes,
        transport: Transport,
        now: Callable[[], float],
        rearm: Callable[[], None],
    ) -> None:
        self.endpoint, self.peers, self.data, self.outcomes = endpoint, peers, data, outcomes
        self.transport, self.now, self.rearm = transport, now, rearm
        self._queue: deque[Effect] | None = None  # the pass under way
        self._moved = False  # whether the pass under way may have moved the next deadline
        self._traffic = True  # what the transport was last told (`Transport.expect_traffic`)
        self._idle = asyncio.Event()

    def started(self) -> None:
        """The engine runs, with no transfer yet."""
        self._idle.set()
        self._traffic = False
        self.transport.expect_traffic(False)

    def execute(self, effects: list[Effect]) -> None:
        """Perform `effects` in order.  Called during a pass (a peer job's outcome on an inline
        worker), they queue behind what is under way.

        :raises PeerUnknown, PeerUnreachable, EngineClosed, ConfigError: a local connect's Hello
            or route (see `PeerExecutor.execute`); the pass still ends its bookkeeping.
        """
        quiet = bool(effects) and all(isinstance(e, UnknownSender | AnswerUnassociated) for e in effects)
        self._moved = self._moved or not quiet  # a stranger's message moves no deadline: no re-arm for it
        if self._queue is not None:
            self._queue.extend(effects)
            return
        queue = self._queue = deque(effects)
        try:
            while queue:
                effect = queue.popleft()
                if isinstance(effect, SendMessage):
                    queue.extendleft(reversed(self._send(effect)))
                elif isinstance(effect, SubmitOp):
                    queue.extendleft(reversed(self.data.submit(effect)))
                elif isinstance(effect, ReleaseBlocks):
                    self.outcomes.release(effect, self.now())
                elif isinstance(effect, Resolve):
                    self.outcomes.resolve(effect, self.now())
                elif isinstance(effect, TokenArrived):
                    self.outcomes.tokens.arrived(effect.peer, effect.message.key, effect.message.token)
                else:
                    queue.extendleft(reversed(self.peers.execute(effect)))
        finally:
            self._queue = None
            self.peers.executed()
            self._passed()

    async def wait_idle(self, limit: float) -> None:
        """Wait, at most `limit` seconds, until no transfer is live.  Never raises."""
        if not self.endpoint.live_count():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), limit)

    def _send(self, action: SendMessage) -> list[Effect]:
        error = self.peers.try_send(action.peer, action.message)
        return [] if error is None else self.endpoint.send_failed(action.peer, action.message, error, self.now())

    def _passed(self) -> None:
        if self._moved:
            self._moved = False
            self.rearm()
        live = bool(self.endpoint.live_count())
        if live:
            self._idle.clear()
        else:
            self._idle.set()
        if live != self._traffic:
            self._traffic = live
            self.transport.expect_traffic(live)
