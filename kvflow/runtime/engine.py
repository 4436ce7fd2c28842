"""The asyncio engine: a thin driver that feeds one pure `Endpoint` and executes what it decides.

Why thin: every decision about transfers, peers, blocks and deadlines lives in the endpoint
(`kvflow.protocol.endpoint`, over the transfer core, the associations and their teardowns).
This module only (as aioquic's `asyncio/protocol.py`) turns events into endpoint inputs with
the loop's clock, has the effects it returns performed by one interpreter
(`kvflow.runtime.interpreter`), and re-arms one timer for the endpoint's `next_deadline`,
clamped so that a timer the loop fires early still runs what was due:

* control messages go out through a `ControlChannel`;
* data-plane ops are planned and submitted on a dedicated writer thread (never on the loop, so
  a slow `postXfer` cannot stall the loop or the host engine's main thread), and the
  transport's completions and notifications arrive through a listener that schedules one drain
  on the loop (`kvflow.runtime.dataplane`, which also seals and checks WRITEs, off the loop);
* released blocks go to `on_release` and to a queue any thread may poll (`released`; finished
  transfers go to `finished`); both keep the newest `config.results_kept` entries, dropping and
  counting the oldest when nobody polls;
* peer effects (routes, transport peers, Hellos, removals) are performed by
  `kvflow.runtime.peering`, which returns the endpoint's answer to each synchronous outcome.

Every callback runs under a guard: an exception is recorded in `crashed`, logged, and surfaced
by the next API call and by `aclose` as `EngineCrashed`; it never dies silently in a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from typing import Any, overload

from kvflow.control.channel import ControlChannel
from kvflow.errors import EngineClosed, EngineCrashed, LedgerError, UsageError
from kvflow.layout import KVLayout, fingerprint
from kvflow.protocol.actions import ReleaseBlocks
from kvflow.protocol.association import Associations
from kvflow.protocol.core import TransferCore
from kvflow.protocol.endpoint import Effect, Endpoint
from kvflow.protocol.lifecycle import Do, Event, Life, Lifecycle
from kvflow.protocol.messages import ControlMessage, TransferKey, require_engine_id, transfer_key
from kvflow.protocol.requests import Abort, Expect, KvReady, Request
from kvflow.protocol.state import Mode, Role
from kvflow.protocol.teardown import HoldReport
from kvflow.runtime.config import EngineConfig
from kvflow.runtime.dataplane import DataPlane
from kvflow.runtime.interpreter import Interpreter
from kvflow.runtime.meter import TransferMeter
from kvflow.runtime.peering import EngineHooks, PeerExecutor
from kvflow.runtime.results import EngineCounters, Outcomes, TransferHandle, TransferResult
from kvflow.runtime.sleep import ASLEEP, MemoryRegistration
from kvflow.runtime.timer import DeadlineTimer
from kvflow.runtime.writer import Submitter, WriterThread
from kvflow.transports.base import Transport

__all__ = ("Engine", "EngineConfig", "TransferHandle", "TransferResult")

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        engine_id: str,
        layout: KVLayout,
        transport: Transport,
        control: ControlChannel,
        *,
        config: EngineConfig | None = None,
        submitter: Submitter | None = None,
        peer_worker: Submitter | None = None,
        clock: Callable[[], float] | None = None,
        on_release: Callable[[ReleaseBlocks], None] | None = None,
        on_end: Callable[[TransferResult], None] | None = None,
    ) -> None:
        """`on_release` is called (on the engine's loop) with each batch of blocks given back,
        `on_end` with each side's outcome as its transfer ends.

        :raises ConfigError: `engine_id` is not a valid engine id, or the config is unusable."""
        self.engine_id = require_engine_id(engine_id)
        self.layout = layout
        self.transport = transport
        self.control = control
        self.config = config or EngineConfig()
        core = TransferCore(engine_id, layout.spec.num_layers, self.config.core, layout.spec.groups)
        self.crashed: list[BaseException] = []
        self.meter = TransferMeter()  # per-transfer time, bytes and outcomes, for metrics
        self.counters = EngineCounters()
        kept = self.config.results_kept
        self.outcomes = Outcomes(engine_id, kept, self.meter, self.counters, on_release, self._guard, on_end)
        self.released, self.finished = self.outcomes.released, self.outcomes.finished  # any thread may poll
        self._submitter = submitter or WriterThread(
            f"kvflow-writer-{engine_id}", self._record_crash, thread_setup=self.config.thread_setup
        )
        self._clock = clock
        cfg, interval = self.config, self.config.heartbeat_interval or self.config.lease / 6
        peering = (cfg.lease, interval, cfg.max_peers, cfg.suspect_timeout, cfg.allowed_peers)
        grace = 0.0 if transport.capabilities.fences_inbound else cfg.unfenced_grace
        assoc = Associations(engine_id, fingerprint(layout.spec), *peering, grace=grace, hold=cfg.unfenced_hold)
        self.endpoint = Endpoint(core, assoc, layout, auto_deliver=cfg.auto_deliver)
        hooks = EngineHooks(self._execute, self._now, self._running_loop, self._soon, lambda: self._life.closed)
        peer_thread = peer_worker or WriterThread(
            f"kvflow-peers-{engine_id}", self._record_crash, thread_setup=self.config.thread_setup
        )
        executing = (self.config, self.endpoint, self.counters, hooks, peer_thread)
        self._peers = PeerExecutor(engine_id, layout, transport, control, *executing)
        # ops planned and posted off the loop; P seals and D checks WRITEs there (opt-in)
        parts = (self.endpoint, self.counters, self.meter)
        self.data = DataPlane(engine_id, layout, transport, self._submitter, parts, self.config, hooks, self._guard)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer = DeadlineTimer()
        self._life = Lifecycle()
        performers = (self._peers, self.data, self.outcomes, transport)
        self.interpreter = Interpreter(self.endpoint, *performers, self._now, self._arm_timer)
        run, now, idle = self._execute, self._now, self.interpreter.wait_idle
        self.memory = MemoryRegistration(layout, transport, self.endpoint, self._peers, run, now, idle)

    @property
    def core(self) -> TransferCore:
        """The transfer core, to read: its inputs go through `endpoint`."""
        return self.endpoint.core

    @property
    def assoc(self) -> Associations:
        """The associations, to read: their inputs go through `endpoint`."""
        return self.endpoint.associations

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Register memory with the transport and start receiving.

        :raises TransportError: the transport refused the regions, or cannot describe itself (the
            engine is then closed, with its transport and control channel).
        :raises UsageError: the engine was started before.
        """
        if Do.REFUSE in self._life.feed(Event.START):
            raise UsageError(f"engine {self.engine_id!r} was already started")
        self._loop = asyncio.get_running_loop()
        try:
            self.transport.register_regions(self.layout.regions)
            self._peers.start()
            self.transport.set_listener(self.data.wake)
            self.control.set_link_listener(self._guarded_link)
            self.control.start(self._loop, self._guarded_control, self._record_crash)
        except BaseException:
            if Do.CLOSE_OWNED in self._life.feed(Event.START_FAILED):  # all or nothing: nothing left open
                for exc in self._close_owned():
                    log.error("%s: closing an engine whose start failed: %r", self.engine_id, exc)
            raise
        self._life.feed(Event.STARTED)
        self.interpreter.started()

    def _close_owned(self) -> list[Exception]:
        """Stop the threads (if a job started them), unhook and close the transport, close the
        control channel: each whatever the others did.  What they raised, in order."""
        failed: list[Exception] = []
        steps = (
            partial(self._submitter.close, 5.0),
            partial(self._peers.worker.close, 5.0),
            partial(self.transport.set_listener, None),
            self.transport.close,
            self.control.close,
        )
        for step in steps:
            try:
                step()
            except Exception as exc:
                failed.append(exc)
        return failed

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def connect(self, peer: str, address: str = "", timeout: float | None = None) -> None:
        """Handshake with `peer` (reached at `address` when the channel needs one): exchange
        layouts and transport metadata, and start heartbeats.

        :raises LayoutMismatch: the peer's KV layout differs (the message names the field).
        :raises PeerProtocolError: the peer refused us (for instance, another protocol version).
        :raises HandshakeTimeout: no answer within `timeout` (default: the config's).
        :raises PeerUnknown: the control channel has no route to the peer.
        :raises PeerUnreachable: the control channel cannot send to the peer now.
        :raises PeerNotAllowed: `peer` or `address` is not on the config's `allowed_peers`.
        :raises ConfigError: `peer` is not a valid engine id, or the control channel refuses
            `address` (for instance, unauthenticated off loopback).
        :raises EngineClosed: the engine is not running, or closed during the handshake.
        :raises EngineCrashed: the engine crashed.
        """
        self._check_open()
        require_engine_id(peer, "peer")
        limit = timeout if timeout is not None else self.config.handshake_timeout
        if not self._peers.handshakes.under_way(peer):
            self._execute(self.endpoint.connect(peer, address, self._now()))
        await self._peers.handshakes.wait(peer, limit)

    def peer_layout(self, peer: str) -> KVLayout | None:
        """The KV layout `peer` announced in its handshake (None: not associated).  Never raises."""
        return self.endpoint.peer_layout(peer)

    def peers(self) -> list[str]:
        """The engines associated with this one now.  Never raises."""
        return self.endpoint.peers()

    def send_first_token(self, peer: str, key: TransferKey, token: int) -> None:
        """Tell the associated `peer` the first token of transfer `key`'s request (best effort: a
        failed send is counted and logged); `outcomes.tokens` keeps what peers send this engine.
        :raises PeerUnknown, EngineClosed, EngineCrashed: not associated; not running."""
        self._check_open()
        self._execute(self.endpoint.first_token(peer, key, token))

    def drop_peer(self, peer: str, reason: str) -> None:
        """Tell `peer` why (best effort), end the association and remove the peer: its live
        transfers fail once the transport confirms nothing of it can land any more.

        :raises EngineClosed, EngineCrashed: the engine is not running.
        """
        self._check_open(asleep=True)
        self._execute(self.endpoint.tear_down(peer, reason, self._now()))

    async def peers_settled(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until every peer addition and removal has returned.
        Never raises; False when some are still running."""
        return await self._peers.settled(timeout)

    async def aclose(self, drain_timeout: float | None = None) -> None:
        """Let transfers finish (up to `drain_timeout`), abort the rest, wait for their fences,
        tear peers down if a fence never comes, release every block, close the transport.

        :raises EngineCrashed: a background callback raised at some point in the engine's life.
        """
        steps = self._life.feed(Event.CLOSE)
        if Do.CLOSE_OWNED in steps:  # never ran: its threads (if a job started them), transport, channel
            for exc in self._close_owned():
                log.error("%s: closing an engine that never ran: %r", self.engine_id, exc)
        if Do.WIND_DOWN not in steps:
            return
        self.endpoint.closing()
        limit = drain_timeout if drain_timeout is not None else self.config.drain_timeout
        await self.memory.wind_down("engine closing", limit, self.config.core.fence_timeout)
        self._execute(self.endpoint.goodbye_all("engine closing", self._now()))
        self._peers.handshakes.close(self.engine_id)
        self._timer.cancel()
        for exc in self._close_owned():
            self._record_crash(exc)
        self._life.feed(Event.WOUND_DOWN)
        unremoved = self.endpoint.unremoved()
        if unremoved:  # their blocks stay quarantined: no op of theirs was fenced
            log.error("%s: closed without removing peers %s", self.engine_id, sorted(unremoved))
        elif self.core.ledger.held_blocks or self.core.live():
            self._record_crash(LedgerError(f"engine closed holding {self.core.ledger.held_blocks} blocks"))
        self.outcomes.closed()
        if self.crashed:
            raise EngineCrashed(self.crashed)

    async def unregister_memory(self, reason: str = ASLEEP) -> None:
        """Before the KV memory is freed (vLLM's sleep mode): live transfers fail for `reason`,
        peers get a Goodbye, the memory is deregistered; until `restore_memory` transfers and
        handshakes are refused (`kvflow.runtime.sleep`).  Idempotent.
        :raises EngineClosed, EngineCrashed, TransportError: not running; crashed; not deregistered."""
        self._check_open(asleep=True)
        await self.memory.unregister(reason, self.config.core.fence_timeout)

    async def restore_memory(self) -> None:
        """The same KV memory (same addresses) registered again, handshakes accepted; peers
        associate again on their next transfer.  Idempotent.
        :raises EngineClosed, EngineCrashed, TransportError: see `unregister_memory`."""
        self._check_open(asleep=True)
        self.memory.restore()

    # ------------------------------------------------------------------ transfers

    @overload
    async def submit(self, request: Expect | KvReady) -> TransferHandle: ...

    @overload
    async def submit(self, request: Abort) -> None: ...

    async def submit(self, request: Request) -> TransferHandle | None:
        """Run `request` (`kvflow.protocol.requests`).  D's `Expect` and P's `KvReady` open or
        feed a transfer and return its handle; the transfer's deadline is the request's
        `timeout` (default: the config's `transfer_timeout`) from now.  An `Abort` gives up on a
        transfer (while the engine sleeps or closes too); its blocks come back once no op can
        touch them.  In push mode D's registration is sent as soon as the peer is connected, and
        P's KV written as soon as that registration is here; in pull mode a `KvReady` tells its
        `peer` (without one, the KV waits for the first peer to claim the transfer).

        :raises InvalidBatch, BlockConflict, StaleEpoch, InvalidTransition, UnknownTransfer,
            ConfigError: see `TransferCore.expect`, `kv_ready`, `abort`; a key the wire cannot
            carry (`transfer_key`).
        :raises EngineClosed, EngineCrashed: the engine is not running.
        """
        if isinstance(request, Abort):
            self._check_open(asleep=True, closing=True)
            transfer_key(request.key.transfer_id, request.key.epoch)
            self._execute(self.endpoint.abort(request, self._now()))
            return None
        self._check_open()
        key, now = transfer_key(request.key.transfer_id, request.key.epoch), self._now()
        deadline = self._deadline(now, request.timeout)
        if isinstance(request, Expect):
            effects, role = self.endpoint.expect(request, now, deadline), Role.DECODE
        else:
            effects, role = self.endpoint.kv_ready(request, now, deadline), Role.PREFILL
        handle = self._handle(key, role)
        self._execute(effects)
        return handle

    async def expect(
        self,
        transfer_id: str,
        epoch: int,
        *,
        peer: str,
        block_ids: Sequence[int],
        mode: Mode = Mode.PUSH,
        expected_batches: int = 1,
        timeout: float | None = None,
        first_position: int = 0,
        share: str = "",
        layers: tuple[int, int] | None = None,
    ) -> TransferHandle:
        """`submit` of an `Expect` of these fields (its key: `transfer_id` at `epoch`).
        :raises KVFlowError: see `submit`."""
        key = TransferKey(transfer_id, epoch)
        request = Expect(key, peer, block_ids, mode, expected_batches, first_position, share, layers, timeout)
        return await self.submit(request)

    async def kv_ready(
        self,
        transfer_id: str,
        epoch: int,
        *,
        block_ids: Sequence[int],
        final: bool = True,
        first_position: int = 0,
        layers: tuple[int, int] | None = None,
        mode: Mode = Mode.PUSH,
        peer: str | None = None,
        timeout: float | None = None,
    ) -> TransferHandle:
        """`submit` of a `KvReady` of these fields (its key: `transfer_id` at `epoch`).
        :raises KVFlowError: see `submit`."""
        key = TransferKey(transfer_id, epoch)
        return await self.submit(KvReady(key, block_ids, final, first_position, layers, mode, peer, timeout))

    async def abort(
        self,
        transfer_id: str,
        epoch: int,
        role: Role,
        reason: str = "aborted by caller",
        *,
        peer: str | None = None,
        mode: Mode = Mode.PUSH,
    ) -> None:
        """`submit` of an `Abort` of these fields (its key: `transfer_id` at `epoch`).  P may
        abort a transfer D has not registered yet: a later registration is refused at once.
        D may abort a transfer it never registered by naming its `peer` (and `mode`): P is told.
        :raises KVFlowError: see `submit`."""
        await self.submit(Abort(TransferKey(transfer_id, epoch), role, reason, peer, mode))

    async def promise(self, transfer_id: str, epoch: int, *, peer: str) -> None:
        """P: this engine holds the request of the transfer, queued or prefilling, for `peer`;
        heartbeats say so, which keeps `peer`'s wait for it alive (see `TransferCore.promise`).

        :raises ConfigError, EngineCrashed, EngineClosed: not a key the wire carries; crashed; closed.
        """
        self._check_open(asleep=True, closing=True)
        self.endpoint.promise(transfer_key(transfer_id, epoch), peer, self._now())

    async def delivered(self, transfer_id: str, epoch: int) -> None:
        """D (with `auto_deliver` off): the consumer took the blocks of a finished transfer.

        :raises UnknownTransfer, InvalidTransition: not a finished D transfer here.
        :raises ConfigError, EngineCrashed, EngineClosed: not a key the wire carries; crashed; closed.
        """
        self._check_open(asleep=True, closing=True)
        self._execute(self.endpoint.delivered(transfer_key(transfer_id, epoch), self._now()))

    def stats(self) -> dict[str, Any]:
        """Counters of the core, the engine and the ledger.  Never raises."""
        return {
            **asdict(self.core.stats),
            **asdict(self.counters),
            "live_transfers": self.core.live_count(),
            "held_blocks": self.core.ledger.held_blocks,
            "quarantined_blocks": self.core.ledger.quarantined_blocks,
            # peers whose removal has not succeeded yet: their blocks stay held
            "unfenced_peers": len(self.endpoint.unremoved()),
            "crashed": len(self.crashed),
        }

    def hold_report(self) -> HoldReport:
        """Where the teardowns under way stand and when their held blocks go back, on the engine's
        clock (`Teardowns.report`).

        :raises EngineClosed: the engine was never started and has no injected clock.
        """
        return self.endpoint.hold_report(self._now())

    def poke(self) -> None:
        """Run due deadlines now (tests driving an injected clock call this).

        :raises EngineClosed: the engine was never started and has no injected clock.
        """
        self._timer.cancel()
        self._execute(self.endpoint.timer(self._now()))

    # ------------------------------------------------------------------ executing effects

    def _execute(self, effects: list[Effect]) -> None:
        self.interpreter.execute(effects)

    # ------------------------------------------------------------------ inbound events

    def _guarded_control(self, sender: str, incarnation: int, message: ControlMessage) -> None:
        self._guard(self._on_control, sender, incarnation, message)

    def _on_control(self, sender: str, incarnation: int, message: ControlMessage) -> None:
        if not self._life.drives_inputs:
            return
        self._execute(self.endpoint.receive(sender, incarnation, message, self._now()))

    def _guarded_link(self, peer: str, up: bool) -> None:
        self._guard(self._on_link, peer, up)

    def _on_link(self, peer: str, up: bool) -> None:
        """The control connection to `peer` dropped or came back: a dropped one makes the peer
        suspect, lost within `config.suspect_timeout` unless it comes back."""
        if self._life.drives_inputs:
            self._execute(self.endpoint.link_changed(peer, up, self._now()))

    # ------------------------------------------------------------------ time

    def _deadline(self, now: float, timeout: float | None) -> float:
        return now + (timeout if timeout is not None else self.config.transfer_timeout)

    def _now(self) -> float:
        return self._clock() if self._clock is not None else self._running_loop().time()

    def _arm_timer(self) -> None:
        self._timer.arm(self._loop, self.endpoint.next_deadline(), self._now, partial(self._guard, self._on_timer))

    def _on_timer(self) -> None:
        """The loop's timer went off.  On the loop's clock, `now` is at least the instant it was
        armed for: a loop may fire a timer a hair early, and what was due must run now rather
        than re-arm for the same instant.  An injected clock is the truth as it reads."""
        armed_for, now = self._timer.fired(), self._now()
        if self._clock is None and armed_for is not None:
            now = max(now, armed_for)
        self._execute(self.endpoint.timer(now))

    # ------------------------------------------------------------------ plumbing

    def _handle(self, key: TransferKey, role: Role) -> TransferHandle:
        return self.outcomes.handle(self.endpoint.machine(key, role), self._running_loop())

    def _guard(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._life.closed:
            return  # a late callback (a completion, a message) after close: nothing to drive
        try:
            fn(*args)
        except Exception as exc:
            self._record_crash(exc)

    def _record_crash(self, exc: BaseException) -> None:
        log.error("%s: background failure: %r", self.engine_id, exc, exc_info=exc)
        self.crashed.append(exc)

    def _check_open(self, *, asleep: bool = False, closing: bool = False) -> None:
        """:raises EngineCrashed, EngineClosed, EngineAsleep: crashed; neither running nor `closing`; `asleep`."""
        if self.crashed:
            raise EngineCrashed(self.crashed)
        if not self._life.accepts_calls and not (closing and self._life.state is Life.CLOSING):
            raise EngineClosed(f"engine {self.engine_id!r} is {self._life.state.value}")
        if not asleep:
            self.memory.check_awake(self.engine_id)

    def _soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """From any thread."""
        if self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to drive any more
            self._loop.call_soon_threadsafe(self._guard, fn, *args)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise EngineClosed(f"engine {self.engine_id!r} was not started")
        return self._loop
