"""Executing the peer effects the `Endpoint` decides: routes, transport peers, Hellos, removals.

Why apart from the engine: the engine's interpreter executes transfer effects itself and hands
every peer effect here.  Every decision about who may associate, when a peer is lost and when a
lost peer's blocks may go back is pure (`kvflow.protocol.endpoint` over the associations and
teardowns), with its deadlines on the engine's one timer; this module performs the effects and
returns each outcome that can fail (a route refused, a Hello unsent, a transport refusing a
peer's memory) as the endpoint's answer to it, for the interpreter to execute next.  Outcomes
that come later (a peer added or removed on the peer thread) go to the engine as a new input.

Why a peer thread: a transport's `add_peer` and `remove_peer` may block (NIXL loads a remote
agent for up to 30 s; shared memory maps segments, waits for copies and takes an exclusive
lock).  They run, in order, on a thread of their own, and their outcome comes back to the loop
as an input, so the loop keeps serving every other peer meanwhile.  Not on the writer thread: a
30 s `add_peer` would hold up every other peer's submissions, and the order it would give (a
removal after the submissions queued before it) is already the transport's contract: a
submission racing with `remove_peer` is refused or fenced.  One FIFO thread keeps each peer's
additions and removals in the order decided.  From the moment of the teardown a peer's
notifications are ignored and no new submission to it is made (its layout is forgotten at once).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvflow.control.channel import ControlChannel
from kvflow.errors import EngineClosed, KVFlowError, TransportError
from kvflow.layout import KVLayout, layout_to_wire
from kvflow.protocol.endpoint import Effect, Endpoint, PeerEffect
from kvflow.protocol.messages import ControlMessage, Goodbye, Hello
from kvflow.protocol.peer_actions import (
    AddRoute,
    AddTransportPeer,
    AnswerUnassociated,
    AwaitHandshake,
    HandshakeSettled,
    Refused,
    SendControl,
    SendHello,
    TearDown,
    UnknownSender,
)
from kvflow.protocol.teardown import PeerGone, RemovalFailed, RemovePeer
from kvflow.runtime.config import EngineConfig
from kvflow.runtime.descriptors import headroom_problem
from kvflow.runtime.handshakes import Handshakes
from kvflow.runtime.results import EngineCounters
from kvflow.runtime.writer import Submitter
from kvflow.transports.base import Transport

__all__ = ("EngineHooks", "PeerExecutor")

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineHooks:
    """What the executors need from their engine, as callbacks (the engine's loop and state)."""

    run: Callable[[list[Effect]], None]  # execute what the endpoint answered to a later outcome
    now: Callable[[], float]
    loop: Callable[[], asyncio.AbstractEventLoop]  # :raises EngineClosed: not started
    soon: Callable[..., None]  # soon(fn, *args), from any thread: call fn on the loop, guarded
    closed: Callable[[], bool]


class PeerExecutor:
    """Executes peer effects for one engine."""

    def __init__(
        self,
        engine_id: str,
        layout: KVLayout,
        transport: Transport,
        control: ControlChannel,
        config: EngineConfig,
        endpoint: Endpoint,
        counters: EngineCounters,
        hooks: EngineHooks,
        worker: Submitter,
    ) -> None:
        self.engine_id = engine_id
        self.layout = layout
        self.transport = transport
        self.control = control
        self.config = config
        self.endpoint = endpoint
        self.counters = counters
        self.hooks = hooks
        # a local connect waits on these; one left unanswered closes what it opened
        self.handshakes = Handshakes(lambda peer: self._forget({peer}))
        self.worker = worker  # runs add_peer / remove_peer, in order
        self.metadata = b""  # this endpoint's transport metadata, read once at start
        self.wire_layout = layout_to_wire(layout)  # what every Hello says of our layout
        self._loop_thread: int | None = None
        self._outstanding = 0  # peer jobs whose outcome the loop has not had yet
        self._transport_adds = 0  # peers the transport is adding: their descriptors are not open yet
        self._ended: set[str] = set()  # peers refused or torn down: their connection goes at the end
        self._settled = asyncio.Event()
        self._settled.set()

    def start(self) -> None:
        """Read the transport's metadata once, on the loop's thread.

        :raises TransportError: the transport cannot describe itself.
        """
        self.metadata = self.transport.local_metadata()
        self._loop_thread = threading.get_ident()

    async def settled(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until every peer addition and removal has returned,
        retries of failed removals included.  Never raises; False when some are still running."""
        if self._settled.is_set():
            return True  # without yielding to the loop
        try:
            await asyncio.wait_for(self._settled.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def execute(self, effect: PeerEffect) -> list[Effect]:
        """Perform one peer effect; what the endpoint answers to its outcome, to execute next.

        :raises PeerUnknown, PeerUnreachable, EngineClosed: a local connect's Hello cannot be sent.
        :raises ConfigError: the channel refused the address of a local connect.
        """
        if isinstance(effect, Refused | TearDown):
            self._ended.add(effect.peer)
        if isinstance(effect, SendControl):
            self.try_send(effect.peer, effect.message)
        elif isinstance(effect, SendHello):
            return self._send_hello(effect)
        elif isinstance(effect, TearDown):
            level = logging.INFO if effect.expected else logging.WARNING
            log.log(level, "%s: tearing down peer %s: %s", self.engine_id, effect.peer, effect.reason)
        elif isinstance(effect, RemovePeer):
            self._off_loop(partial(self.transport.remove_peer, effect.peer), self._removed, effect)
        elif isinstance(effect, RemovalFailed):
            self._removal_failed(effect)
        elif isinstance(effect, PeerGone):
            if effect.failed_attempts:
                failed = effect.failed_attempts
                log.warning("%s: peer %s removed after %d failed attempts", self.engine_id, effect.peer, failed)
        elif isinstance(effect, AddTransportPeer):
            return self._add_transport_peer(effect)
        elif isinstance(effect, AddRoute):
            return self._add_route(effect)
        elif isinstance(effect, AwaitHandshake):
            self.handshakes.begin(effect.peer, self.hooks.loop())
        elif isinstance(effect, HandshakeSettled):
            self.handshakes.settle(effect.peer, effect.error)
        elif isinstance(effect, Refused):
            self.counters.peers_refused += 1
            log.error("%s: refusing peer %s: %s", self.engine_id, effect.peer, effect.error)
        elif isinstance(effect, UnknownSender):
            self.counters.messages_from_unknown_peers += 1
        elif isinstance(effect, AnswerUnassociated):
            self.counters.messages_from_unknown_peers += 1
            self.control.answer(effect.peer, effect.incarnation, effect.goodbye)
        return []

    def executed(self) -> None:
        """A batch of effects is done: close the connections of the peers it ended, and say
        whether every peer job has settled."""
        ended, self._ended = self._ended, set()
        self._forget(ended)
        self._update_settled()

    def _forget(self, peers: set[str]) -> None:
        """Close the connections of peers refused or torn down (once their Reject or Goodbye was
        queued): made-up names must not use up sockets.  A peer that is (again) associated or
        being added keeps its own."""
        for peer in sorted(peers):
            if not self.endpoint.keeps_connection(peer):
                self.control.forget(peer)

    def try_send(self, peer: str, message: ControlMessage) -> KVFlowError | None:
        """Send; a failure is counted, logged and returned, never raised."""
        try:
            self.control.send(peer, message)
        except KVFlowError as exc:
            self.counters.sends_failed += 1
            # A goodbye often races the peer's own: the peer may have left first.
            level = logging.DEBUG if isinstance(message, Goodbye) else logging.WARNING
            log.log(level, "%s: cannot send to %s: %s", self.engine_id, peer, exc)
            return exc
        return None

    def _removed(self, action: RemovePeer, error: TransportError | None) -> None:
        if self.hooks.closed():
            return  # nothing is left to release into
        now = self.hooks.now()
        if error is None:
            self.hooks.run(self.endpoint.removed(action.number, now))
        else:
            self.hooks.run(self.endpoint.removal_failed(action.number, now, error))

    def _removal_failed(self, action: RemovalFailed) -> None:
        """The transport could not remove the peer (it could not fence the peer's copies into our
        memory, as a stopped process's): nothing promises that its ops are over, so its transfers
        stay undecided or quarantined and it cools until a retry succeeds (`Teardowns`)."""
        self.counters.peer_removals_failed += 1
        log.log(
            logging.ERROR if action.attempt == 1 else logging.DEBUG,
            "%s: cannot remove peer %s (attempt %d): %s; its transfers' blocks stay quarantined, retrying in %.2gs",
            self.engine_id,
            action.peer,
            action.attempt,
            action.error,
            action.retry_in,
        )

    def _add_route(self, action: AddRoute) -> list[Effect]:
        """:raises ConfigError: the channel refused the address of a local connect."""
        try:
            self.control.add_route(action.peer, action.address)
        except KVFlowError as exc:
            if action.pending is None:
                raise
            return self.endpoint.pending_refused(action.peer, action.pending, exc, self.hooks.now())
        if action.pending is None:
            return []
        return self.endpoint.route_added(action.peer, action.pending, self.hooks.now())

    def _add_transport_peer(self, action: AddTransportPeer) -> list[Effect]:
        """Add the peer on the peer thread; a transport refusing its metadata refuses the peer,
        and so does a process short of file descriptors."""
        pending = action.pending
        problem = headroom_problem(adding=self._transport_adds)
        if problem is not None:
            return self.endpoint.pending_refused(action.peer, pending, TransportError(problem), self.hooks.now())
        self._transport_adds += 1
        self._off_loop(
            lambda: self.transport.add_peer(action.peer, pending.hello.transport_metadata, pending.layout.regions),
            self._added,
            action,
        )
        return []

    def _added(self, action: AddTransportPeer, error: TransportError | None) -> None:
        self._transport_adds -= 1
        now = self.hooks.now()
        if error is not None:
            self.hooks.run(self.endpoint.pending_refused(action.peer, action.pending, error, now))
        else:
            self.hooks.run(self.endpoint.transport_peer_added(action.peer, action.pending, now))

    def _off_loop(self, work: Callable[[], None], then: Callable[..., None], subject: object) -> None:
        """Run `work` on the peer thread, then `then(subject, error)` on the loop (at once when the
        worker runs jobs inline, as tests driving a manual clock do)."""
        self._begin()

        def job() -> None:
            error: TransportError | None = None
            try:
                work()
            except TransportError as exc:
                error = exc
            except Exception as exc:  # what a peer advertised broke the transport's code: refuse it
                log.exception("%s: the transport failed (%s)", self.engine_id, type(exc).__name__)
                error = TransportError(f"the transport failed: {type(exc).__name__}: {exc}")
            if threading.get_ident() == self._loop_thread:
                self._outcome(then, subject, error)
            else:
                self.hooks.soon(self._outcome, then, subject, error)

        try:
            self.worker.submit(job)
        except EngineClosed:
            self._outcome(then, subject, TransportError("the engine's peer thread is closed"))

    def _outcome(self, then: Callable[..., None], subject: object, error: TransportError | None) -> None:
        self._end()
        then(subject, error)

    def _begin(self) -> None:
        self._outstanding += 1
        self._settled.clear()

    def _end(self) -> None:
        self._outstanding -= 1
        self._update_settled()

    def _update_settled(self) -> None:
        """Settled: no peer job whose outcome the loop has not had, and no failed removal waiting
        for its retry."""
        if self._outstanding == 0 and not self.endpoint.backing_off():
            self._settled.set()
        else:
            self._settled.clear()

    def _send_hello(self, action: SendHello) -> list[Effect]:
        """Send our Hello; when it answers a peer's, its outcome is an input of the associations.

        :raises PeerUnknown, PeerUnreachable, EngineClosed: a local connect's Hello was not sent.
        """
        try:
            hello = Hello(
                self.engine_id,
                self.endpoint.fingerprint,
                self.wire_layout,
                self.metadata,
                action.reply,
                self.control.address,
                action.association,
            )
            self.control.send(action.peer, hello)
        except KVFlowError as exc:
            if action.associating:
                self.counters.sends_failed += 1
                return self.endpoint.hello_unsent(action.peer, exc, self.hooks.now())
            if not action.best_effort:
                raise
            log.warning("%s: cannot answer %s: %s", self.engine_id, action.peer, exc)
            return []
        return self.endpoint.hello_sent(action.peer, self.hooks.now()) if action.associating else []
