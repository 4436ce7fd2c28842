"""Executing what `Associations` decides: routes, transport peers, Hellos, teardowns.

Why apart from the engine: the engine drives transfers; this drives *peers*.  Every decision
about who may associate, when a peer is lost and when a lost peer's blocks may go back is pure
(`kvflow.protocol.association`, `kvflow.protocol.teardown`), with its deadlines on the engine's
one timer; this module performs the effects in the order they were decided and feeds each
outcome that can fail (a route refused, a transport refusing a peer's memory or failing to
remove it, an answer that cannot be sent) back as an input.  The engine hands it the transfer
core's entry points as callbacks, so the core stays the engine's.

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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from kvflow.control.channel import ControlChannel
from kvflow.errors import EngineClosed, KVFlowError, TransportError
from kvflow.layout import KVLayout, layout_to_wire
from kvflow.protocol.actions import Action
from kvflow.protocol.association import Associations
from kvflow.protocol.core import TransferCore
from kvflow.protocol.messages import MAX_HEARTBEAT_KEYS, ControlMessage, Goodbye, Heartbeat, Hello
from kvflow.protocol.peer_actions import (
    AddRoute,
    AddTransportPeer,
    AnswerUnassociated,
    AssociationAction,
    AwaitHandshake,
    Deliver,
    HandshakeSettled,
    PeerConnected,
    Redeliver,
    Refused,
    RenewLeases,
    SendControl,
    SendHeartbeat,
    SendHello,
    TearDown,
    UnknownSender,
)
from kvflow.protocol.teardown import PeerFenced, PeerGone, RemovalFailed, RemovePeer
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
    """What the executor needs from its engine, as callbacks (the engine's loop and state)."""

    run: Callable[[list[Action]], None]  # execute the transfer core's actions
    now: Callable[[], float]
    loop: Callable[[], asyncio.AbstractEventLoop]  # :raises EngineClosed: not started
    rearm: Callable[[], None]  # the pure layer's next deadline may have changed
    soon: Callable[..., None]  # soon(fn, *args), from any thread: call fn on the loop, guarded
    closed: Callable[[], bool]


class PeerExecutor:
    """Executes association actions for one engine."""

    def __init__(
        self,
        engine_id: str,
        layout: KVLayout,
        transport: Transport,
        control: ControlChannel,
        config: EngineConfig,
        assoc: Associations,
        core: TransferCore,
        counters: EngineCounters,
        hooks: EngineHooks,
        worker: Submitter,
    ) -> None:
        self.engine_id = engine_id
        self.layout = layout
        self.transport = transport
        self.control = control
        self.config = config
        self.assoc = assoc
        self.core = core
        self.counters = counters
        self.hooks = hooks
        # a local connect waits on these; one left unanswered closes what it opened
        self.handshakes = Handshakes(lambda peer: self._forget({peer}))
        self.worker = worker  # runs add_peer / remove_peer, in order
        self.metadata = b""  # this endpoint's transport metadata, read once at start
        self.wire_layout = layout_to_wire(layout)  # what every Hello says of our layout
        self._loop_thread: int | None = None
        self._outstanding = 0  # peer jobs whose outcome the loop has not had yet
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

    def associate(self, actions: Sequence[AssociationAction]) -> None:
        """Execute, in order, what `Associations` decided.

        :raises PeerUnknown, PeerUnreachable, EngineClosed: a local connect's Hello cannot be sent.
        :raises ConfigError: the channel refused the address of a local connect.
        """
        queue = deque(actions)
        ended: set[str] = set()  # peers refused or torn down here: their connection goes at the end
        # whether a deadline of the associations or teardowns may have moved: not for a message
        # in from a peer (a Deliver re-arms through the core's actions, an unknown sender moves
        # nothing), so that the common and the hostile message pay for no re-arm of their own;
        # a teardown input with no action (a removal that returned into its grace) does re-arm
        moved = not queue
        while queue:
            action = queue.popleft()
            moved = moved or not isinstance(action, Deliver | UnknownSender | AnswerUnassociated)
            if isinstance(action, Refused | TearDown):
                ended.add(action.peer)
            if isinstance(action, Deliver):
                self.hooks.run(self.core.receive(action.peer, action.message, self.hooks.now()))
            elif isinstance(action, SendHeartbeat):
                keys = self.core.heartbeat_keys(action.peer, self.hooks.now())
                for start in range(0, max(len(keys), 1), MAX_HEARTBEAT_KEYS):  # what one frame may name
                    self.try_send(action.peer, Heartbeat(keys[start : start + MAX_HEARTBEAT_KEYS]))
            elif isinstance(action, SendControl):
                self.try_send(action.peer, action.message)
            elif isinstance(action, SendHello):
                queue.extendleft(reversed(self._send_hello(action)))
            elif isinstance(action, RenewLeases):
                self.hooks.run(self.core.renew(action.peer, action.keys, action.now, action.lease))
            elif isinstance(action, TearDown):
                level = logging.INFO if action.expected else logging.WARNING
                log.log(level, "%s: tearing down peer %s: %s", self.engine_id, action.peer, action.reason)
                now = self.hooks.now()
                gone = self.assoc.teardowns.torn_down(action.peer, action.reason, now, answered=action.answered)
                queue.extendleft(reversed(gone))
            elif isinstance(action, RemovePeer):
                self._off_loop(partial(self.transport.remove_peer, action.peer), self._removed, action)
            elif isinstance(action, RemovalFailed):
                self._removal_failed(action)
            elif isinstance(action, PeerGone):
                if action.failed_attempts:
                    failed = action.failed_attempts
                    log.warning("%s: peer %s removed after %d failed attempts", self.engine_id, action.peer, failed)
                now = self.hooks.now()
                self.hooks.run(self.core.peer_lost(action.peer, now, action.reason, unfenced=action.unfenced))
                if action.unfenced and not self.core.unfenced(action.peer):
                    queue.extendleft(reversed(self.assoc.teardowns.nothing_held(action.peer, now)))
            elif isinstance(action, PeerFenced):
                self.hooks.run(self.core.peer_fenced(action.peer))
            elif isinstance(action, AddTransportPeer):
                self._add_transport_peer(action)
            elif isinstance(action, Redeliver):
                now = self.hooks.now()
                queue.extendleft(reversed(self.assoc.receive(action.peer, action.incarnation, action.hello, now)))
            elif isinstance(action, PeerConnected):
                self.hooks.run(self.core.peer_connected(action.peer, action.now, self._block_ratio(action.peer)))
            elif isinstance(action, AddRoute):
                queue.extendleft(reversed(self._add_route(action)))
            elif isinstance(action, AwaitHandshake):
                self.handshakes.begin(action.peer, self.hooks.loop())
            elif isinstance(action, HandshakeSettled):
                self.handshakes.settle(action.peer, action.error)
            elif isinstance(action, Refused):
                self.counters.peers_refused += 1
                log.error("%s: refusing peer %s: %s", self.engine_id, action.peer, action.error)
                if action.abandon:
                    why = f"its handshake was refused: {action.error}"
                    self.hooks.run(self.core.peer_lost(action.peer, self.hooks.now(), why, refused=True))
            elif isinstance(action, UnknownSender):
                self.counters.messages_from_unknown_peers += 1
            elif isinstance(action, AnswerUnassociated):
                self.counters.messages_from_unknown_peers += 1
                self.control.answer(action.peer, action.incarnation, action.goodbye)
        self._forget(ended)
        self._update_settled()
        if moved:
            self.hooks.rearm()

    def _forget(self, peers: set[str]) -> None:
        """Close the connections of peers refused or torn down (once their Reject or Goodbye was
        queued, above): made-up names must not use up sockets.  A peer that is (again) associated
        or being added keeps its own."""
        for peer in sorted(peers):
            if peer not in self.assoc.layouts and peer not in self.assoc.adding:
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

    def tear_down(self, peer: str, reason: str) -> None:
        """Tell `peer` why (best effort), end the association, remove it (see `remove_peer`)."""
        self.associate(self.assoc.tear_down(peer, reason))

    def _block_ratio(self, peer: str) -> int:
        """The larger of our and `peer`'s block sizes over the smaller (1: equal, not multiples,
        or no layout known)."""
        remote = self.assoc.layouts.get(peer)
        if remote is None:
            return 1
        small, large = sorted((self.layout.spec.block_size, remote.spec.block_size))
        return large // small if large % small == 0 else 1

    def _removed(self, action: RemovePeer, error: TransportError | None) -> None:
        if self.hooks.closed():
            return  # nothing is left to release into
        now = self.hooks.now()
        if error is None:
            self.associate(self.assoc.teardowns.removed(action.number, now))
        else:
            self.associate(self.assoc.teardowns.removal_failed(action.number, now, error))

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

    def _add_route(self, action: AddRoute) -> list[AssociationAction]:
        """:raises ConfigError: the channel refused the address of a local connect."""
        try:
            self.control.add_route(action.peer, action.address)
        except KVFlowError as exc:
            if action.pending is None:
                raise
            return self.assoc.pending_refused(action.peer, action.pending, exc)
        return [] if action.pending is None else self.assoc.route_added(action.peer, action.pending, self.hooks.now())

    def _add_transport_peer(self, action: AddTransportPeer) -> None:
        """Add the peer on the peer thread; a transport refusing its metadata refuses the peer,
        and so does a process short of file descriptors."""
        pending = action.pending
        problem = headroom_problem()
        if problem is not None:
            self.associate(self.assoc.pending_refused(action.peer, pending, TransportError(problem)))
            return
        self._off_loop(
            lambda: self.transport.add_peer(action.peer, pending.hello.transport_metadata, pending.layout.regions),
            self._added,
            action,
        )

    def _added(self, action: AddTransportPeer, error: TransportError | None) -> None:
        if error is not None:
            self.associate(self.assoc.pending_refused(action.peer, action.pending, error))
        else:
            self.associate(self.assoc.transport_peer_added(action.peer, action.pending, self.hooks.now()))

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
        if self._outstanding == 0 and not self.assoc.teardowns.backing_off():
            self._settled.set()
        else:
            self._settled.clear()

    def _send_hello(self, action: SendHello) -> list[AssociationAction]:
        """Send our Hello; when it answers a peer's, its outcome is an input of the associations.

        :raises PeerUnknown, PeerUnreachable, EngineClosed: a local connect's Hello was not sent.
        """
        try:
            hello = Hello(
                self.engine_id,
                self.assoc.fingerprint,
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
                return self.assoc.hello_unsent(action.peer, exc)
            if not action.best_effort:
                raise
            log.warning("%s: cannot answer %s: %s", self.engine_id, action.peer, exc)
            return []
        return self.assoc.hello_sent(action.peer, self.hooks.now()) if action.associating else []
