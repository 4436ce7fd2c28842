"""The engine's data plane: ops planned and posted off the loop, and what the transport reports fed to the endpoint.

Why its own module: this is the part of the driver that touches bytes.  Planning descriptors,
posting an op and (with the integrity check on) hashing what a WRITE carries or what landed
can each take milliseconds for a long prompt, so they run on the engine's writer thread, not
on the event loop (a small op, when nothing is queued before it, runs on the loop: two thread
hand-overs cost more).  P seals a WRITE where it posts it; D checks a sealed WRITE's
notification on the writer thread too, and feeds the notification to the core, with what the
check found, once it is done.  What the endpoint answers goes to the engine's interpreter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from kvflow.errors import EngineClosed, KVFlowError
from kvflow.layout import KVLayout, plan_transfer
from kvflow.protocol.actions import OpKind, SubmitOp
from kvflow.protocol.endpoint import Effect, Endpoint
from kvflow.protocol.state import Role
from kvflow.runtime.config import EngineConfig
from kvflow.runtime.integrity import Integrity, PendingCheck
from kvflow.runtime.meter import TransferMeter
from kvflow.runtime.peering import EngineHooks
from kvflow.runtime.results import EngineCounters
from kvflow.runtime.writer import Submitter
from kvflow.transports.base import Notification, Transport

__all__ = ("DataPlane",)


class DataPlane:
    """Posts one engine's ops and drains its transport's completions and notifications."""

    def __init__(
        self,
        engine_id: str,
        layout: KVLayout,
        transport: Transport,
        submitter: Submitter,
        parts: tuple[Endpoint, EngineCounters, TransferMeter],
        config: EngineConfig,
        hooks: EngineHooks,
        guard: Callable[..., None],
    ) -> None:
        """`guard(fn, *args)` runs a callback on the loop, recording what it raises."""
        self.layout, self.transport, self.submitter = layout, transport, submitter
        self.endpoint, self.counters, self.meter = parts
        self.config, self.hooks, self.guard = config, hooks, guard
        self.integrity = Integrity(engine_id, layout, config.integrity_sample) if config.integrity else None
        self._drain_scheduled = False

    def submit(self, op: SubmitOp) -> list[Effect]:
        """Plan and post `op` (sealed, for a checked WRITE) on the writer thread, or here; what
        the endpoint answers when the op cannot even be planned (its peer is gone)."""
        remote = self.endpoint.peer_layout(op.peer)
        if remote is None:
            return self.endpoint.op_finished(op.op_id, self.hooks.now(), f"peer {op.peer!r} not connected")
        loop = self.hooks.loop()
        role = Role.PREFILL if op.kind is OpKind.WRITE else Role.DECODE
        self.meter.op_asked(op.key, role, self.hooks.now())
        inline = self._inline(self.layout.bytes_of(len(op.local_blocks), op.layers))
        after = loop.call_soon if inline else loop.call_soon_threadsafe

        def job() -> None:
            error: str | None = None
            started, size = time.perf_counter(), (0, 0)
            try:
                plan = plan_transfer(
                    self.layout, remote, op.local_blocks, op.remote_blocks, op.layers, fine_start=op.fine_start
                )
                note = op.notification
                if self.integrity is not None and op.kind is OpKind.WRITE:
                    note = self.integrity.seal(op, remote)
                self.transport.submit(op.op_id, op.kind, op.peer, plan, note)
                size = (plan.total_bytes, len(plan))
            except KVFlowError as exc:
                error = f"{type(exc).__name__}: {exc}"
            posted = (*size, time.perf_counter() - started)
            after(self.guard, self._after_submit, op, role, error, posted)

        self._run_job(job, inline)
        return []

    def _after_submit(self, op: SubmitOp, role: Role, error: str | None, posted: tuple[int, int, float]) -> None:
        """On the loop, once the writer has posted `op` (or failed to): the meter, then the core."""
        self.meter.op_posted(op.key, role, *posted)
        now = self.hooks.now()
        if error is None:
            self.counters.posted(op.kind is OpKind.WRITE, posted[0])
            self.hooks.run(self.endpoint.op_submitted(op.op_id, now))
        else:
            self.hooks.run(self.endpoint.op_finished(op.op_id, now, error))

    def wake(self) -> None:
        """The transport has something to report: one drain on the loop.  From any thread."""
        if self._drain_scheduled:
            return
        self._drain_scheduled = True
        try:
            self.hooks.loop().call_soon_threadsafe(self.guard, self._drain)
        except (RuntimeError, EngineClosed):
            self._drain_scheduled = False  # the loop is closed, or not there yet: nothing to drain into

    def _drain(self) -> None:
        self._drain_scheduled = False
        completions, notifications = self.transport.poll()
        now = self.hooks.now()
        for completion in completions:
            self.hooks.run(self.endpoint.op_finished(completion.op_id, now, completion.error))
        check, registered = self.integrity, self.endpoint.registered
        for note in notifications:
            if (layout := self.endpoint.peer_layout(note.peer)) is None:
                self.counters.notifications_from_unknown += 1
                continue
            pending = check.prepare(note.peer, note.payload, layout, registered) if check is not None else None
            if pending is None:
                self.hooks.run(self.endpoint.notification(note.peer, note.payload, now, None))
                continue
            inline = self._inline(pending.size)
            self._run_job(partial(self._check, note, pending, inline), inline)

    def _check(self, note: Notification, pending: PendingCheck, inline: bool) -> None:
        """On the writer thread (or the loop, for a small one): D's check of what a WRITE put here."""
        problem = pending.run()
        if inline:
            self._checked(note, pending, problem)
        else:
            self.hooks.soon(self._checked, note, pending, problem)

    def _checked(self, note: Notification, pending: PendingCheck, problem: str | None) -> None:
        """On the loop: the notification, with what the check found, goes to the core.  A
        transfer gone meanwhile (aborted, expired: its blocks may hold another's KV by now) is
        the inbox's to count, not a mismatch."""
        if pending.size:  # hashed (not a problem found from the seal alone)
            self.counters.integrity_checks += 1
        if problem is not None and self.endpoint.registered(pending.key):
            self.counters.integrity_mismatches += 1
        self.hooks.run(self.endpoint.notification(note.peer, note.payload, self.hooks.now(), problem))

    def _inline(self, size: int) -> bool:
        return size <= self.config.inline_op_bytes and self.submitter.idle()

    def _run_job(self, job: Callable[[], Any], inline: bool) -> None:
        if inline:
            job()
        else:
            self.submitter.submit(job)
