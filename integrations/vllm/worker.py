"""The worker side of the vLLM connector: one kvflow engine per tensor-parallel rank.

Why a thread: vLLM calls its worker hooks from the model runner's thread and they must never
block on I/O.  Each rank runs a kvflow `Engine` on its own thread and loop (`EngineThread`); the
hooks only hand it orders and read its queues.

What vLLM learns, and when: a request's blocks belong to kvflow from its order until kvflow
*releases* them, which happens only when no op of the transfer can touch them any more (after
the peer's fence for a failed or aborted transfer).  So each rank of D reports the request once
in ``finished_recving`` on release (on failure also in ``failed_recving``, with its block ids
as load errors), also when the request was aborted meanwhile: vLLM counts every rank's report
per set before it acts, and frees a finished request's blocks then.  P reports a request in
``finished_sending`` on release, once vLLM has told the worker that request finished (vLLM's
rule for delayed frees).  Each rank keeps one record per request, moved by a table
(`request_book`); P's hooks are a collaborator of their own (`producer`).

Why the hooks never wait: they run on the model runner's thread, inside every step of the
batch, so each one only hands the engine its work (`RankAgent` commands, batched per hook) and
reads what came back; descriptor planning, posting and polling happen with the engine.

Where the engine runs (`links`): in a process of its own when the KV caches are host memory
and the transport is NIXL (``engine_process``: "auto", the default), so that none of its Python
runs in the host's interpreter; on a thread of this process otherwise (GPU memory, a transport
the host injected), or when asked (``engine_process: "thread"``).  Measured with `kvflow bench
host`, an engine thread in the host's interpreter took the GIL from the host's steps: at 100
transfers/s P's steps were 30 % fewer and 13 ms longer at p99.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from kvflow.errors import ConfigError, KVFlowError, UsageError
from kvflow.integrations.vllm.device import Device, HostDevice
from kvflow.integrations.vllm.first_token import FIRST_TOKEN_WAIT, FirstTokenWaits
from kvflow.integrations.vllm.gpu_export import GpuExport
from kvflow.integrations.vllm.kv_caches import CacheDescription
from kvflow.integrations.vllm.links import EngineLink, ProcessLink, failed_future, send_request
from kvflow.integrations.vllm.mapping import Order, Orders
from kvflow.integrations.vllm.notices import PeerNotices
from kvflow.integrations.vllm.producer import Forward, ProducerSide, StepMemo
from kvflow.integrations.vllm.rank_agent import Reach
from kvflow.integrations.vllm.ranks import rank_name, ranked_layout, tp_sizes, transfer_parts
from kvflow.integrations.vllm.request_book import RequestBook
from kvflow.integrations.vllm.settings import Settings, layer_groups
from kvflow.integrations.vllm.supervision import ProcessStart, RestartPolicy, start_process, start_thread
from kvflow.layout import KVLayout, MemoryType
from kvflow.layout.groups import KVGroup
from kvflow.protocol.core import CoreConfig
from kvflow.protocol.messages import OPEN_BATCHES, TransferKey
from kvflow.protocol.requests import Abort, Expect
from kvflow.protocol.state import Mode, Role
from kvflow.runtime import host_memory
from kvflow.runtime.bell import Bell
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.runtime.threaded import EngineThread
from kvflow.transports.base import Transport

__all__ = ("Settings", "WorkerSide", "layer_groups")  # Settings, layer_groups: from settings.py

log = logging.getLogger("kvflow.vllm")

# At shutdown a rank's engine lets its transfers finish this long (a WRITE in flight, a
# registration on its way), then aborts the rest, telling their peers: one waiting for a peer
# that never comes must not hold vLLM's shutdown for the 30 s an engine drains by default.
SHUTDOWN_DRAIN = 2.0


class WorkerSide:
    def __init__(
        self,
        engine_id: str,
        rank: int,
        settings: Settings,
        tp_size: int = 1,
        total_heads: int = 0,
        dp_rank: int = 0,
        bell: str = "",
    ) -> None:
        """`tp_size`: the engine's tensor parallelism; `total_heads`: the model's KV heads (1
        for MLA's latent cache; 0: this rank's heads times `tp_size`); `dp_rank`: the engine's
        data-parallel rank (its ranks bind ports after the ``dp_rank * tp_size`` before them);
        `bell`: where the rank's engine rings vLLM's engine core when it has news for it
        (`idle_sleep.py`; "": it does not)."""
        self.bell = bell
        self._greeting_owed = bool(bell)  # rung once, at the first step
        self.port = settings.port + dp_rank * tp_size if settings.port else 0
        self.base_engine_id = engine_id
        self.engine_id = rank_name(engine_id, rank)
        self.rank = rank
        self.tp_size = tp_size
        self.total_heads = total_heads
        self.settings = settings
        self.book = RequestBook(self.engine_id, self._abort_pair)  # each request this rank moves KV for
        self.link: EngineLink | None = None  # to this rank's engine, wherever it runs
        self._gpu = GpuExport("legacy-ipc")  # how GPU memory reached an engine process (none yet)
        self.thread: EngineThread | None = None  # the engine's thread, when it runs on one
        self.notices = PeerNotices(self.engine_id, tp_size, self._link, self._parts)
        self.kv_groups: tuple[KVGroup, ...] = (KVGroup((0, 1)),)  # the model's KV cache groups
        self.layer_of: dict[str, int] = {}  # vLLM layer name -> kvflow layer (execution order)
        self.device: Device = HostDevice()
        self.producer = self._producer(Forward())  # P's hooks
        self._process_start: ProcessStart | None = None  # what the engine process started from
        self._restarts = RestartPolicy()
        self._gave_up = False  # the restarts ran out: said once
        # D: requests held for P's first token; None unless D's sampler takes it (`first_token.PROCESSOR`)
        self.firsts: FirstTokenWaits | None = None

    # ---------------------------------------------------------------- setup

    def register(
        self, caches: CacheDescription, device: Device, transport: Callable[[str], Transport] | None = None
    ) -> None:
        """Start this rank's engine on its KV memory, in a process of its own or on a thread
        (see the module's header); every thread it starts here uses `device`.  `transport`, when
        given, makes the engine's transport from its engine id in place of NIXL's (on a thread).

        :raises ConfigError: ``engine_process: "process"`` where a process cannot serve, or
            the layout is not what this rank holds.
        :raises KVFlowError: the engine did not start (the transport refused the memory, the
            engine process failed, or did not say ready in time).
        """
        settings = self.settings
        layout = self._ranked(caches.layout)
        self.kv_groups = layout.spec.groups
        self.layer_of = dict(caches.layer_of)
        self.device = device
        run_order = caches.run_order or tuple(range(layout.spec.num_layers))
        self.producer = self._producer(Forward(self.kv_groups, run_order, layout.spec.page_bytes, self.layer_of))
        # vLLM 0.32/0.33 cannot map block ids back to requests with several KV cache groups (they
        # are unique only within a group; it raises if given any): the failure is in failed_recving
        self.book.block_errors = len(self.kv_groups) == 1
        config = EngineConfig(
            core=CoreConfig(fence_timeout=settings.fence_timeout),
            transfer_timeout=settings.transfer_timeout,
            lease=settings.lease,
            allowed_peers=settings.allow_list(ranks=True),
            drain_timeout=SHUTDOWN_DRAIN,
            integrity=settings.integrity,
            integrity_sample=settings.integrity_sample,
        )
        port = self.port + self.rank if self.port else 0
        bind = f"tcp://{settings.host}:{port}"
        why_not = self._why_not_a_process(layout, transport is not None)
        if why_not is None:
            self._start_process(ProcessStart(self.engine_id, layout, config, bind, settings, device, self.bell))
        elif settings.engine_process == "process":
            raise ConfigError(f"kvflow engine_process 'process' cannot serve rank {self.engine_id}: {why_not}")
        else:
            self.thread, self.link, self._where = start_thread(
                self.engine_id, layout, config, bind, settings, device, transport, self.bell
            )
        groups = layout.spec.kv_groups
        if groups:  # vLLM's hybrid KV cache manager: each group's blocks move with its own layers
            log.info("kvflow engine %s: KV cache groups %s", self.engine_id, groups)
        log.info("kvflow engine %s up at %s (%s)", self.engine_id, self.address, self._where)

    def _producer(self, forward: Forward) -> ProducerSide:
        return ProducerSide(self.engine_id, self.tp_size, self.settings, self.book, self._link, self._parts,
                            self.device, forward)  # fmt: skip

    def _why_not_a_process(self, layout: KVLayout, injected_transport: bool) -> str | None:
        """Why this rank's engine cannot run in a process of its own (None: it can)."""
        if self.settings.engine_process == "thread":
            return "asked for a thread"
        if injected_transport:
            return "the transport the host handed it does not cross processes"
        on_gpu = any(region.memory is MemoryType.VRAM for region in layout.regions)
        if on_gpu and self.settings.engine_process != "process":
            # built (legacy CUDA IPC, `kvflow.runtime.cuda_ipc`) but not yet run on a GPU: only when asked
            return "its KV caches are GPU memory (CUDA IPC into an engine process is taken only when asked)"
        if not host_memory.supported():
            return "this platform cannot share host memory (Linux memfd needed)"
        return None

    def _start_process(self, start: ProcessStart) -> None:
        """:raises KVFlowError: see `supervision.start_process`."""
        self.link, self._gpu, self._where = start_process(start)
        self._process_start = start

    def _ranked(self, layout: KVLayout) -> KVLayout:
        """:raises ConfigError: see `ranks.ranked_layout`."""
        self.total_heads = self.total_heads or layout.spec.num_kv_heads * self.tp_size
        port, host = self.port, self.settings.host
        table = tuple(f"tcp://{host}:{port + r}" for r in range(self.tp_size)) if port else ()
        return ranked_layout(layout, self.base_engine_id, self.rank, self.tp_size, self.total_heads, table)

    @property
    def address(self) -> str:
        return self.link.address if self.link is not None else ""

    @property
    def engine(self) -> Engine | None:
        """This rank's engine object, when it runs in this process (for inspection)."""
        return self.link.engine if self.link is not None else None

    # ---------------------------------------------------------------- orders

    def start_load(self, orders: Orders) -> None:
        """Expect and abort orders: handed to the engine, never waited on.  First, a dead engine
        process is seen to (vLLM calls this at every step, one with nothing scheduled too)."""
        self._supervise()
        if self._greeting_owed:  # the engine core exists now (it sends the steps): it hears its bell
            self._greeting_owed = False
            greeting = Bell(self.bell)
            greeting.ring()  # from here on it may sleep while requests wait (idle_sleep.py)
            greeting.close()
        self.producer.step = StepMemo()  # a new step: its forward has saved no layer yet
        if orders.expect or orders.abort or orders.promise or orders.first:
            with self._batch():
                self._start_load(orders)

    def _start_load(self, orders: Orders) -> None:
        for order in orders.expect:
            self._expect(order)
        for order in orders.abort:  # after the expects: a request may end in the step it was allocated
            self._abort(order)
        for order in orders.promise:
            self.notices.promise(order)
        for order in orders.first:
            self.notices.first_token(order)

    def _expect(self, order: Order) -> None:
        """D: register each KV cache group's blocks with every P rank feeding this one (a part
        transfer each); a failure to start is reported as a failed load by the next results()."""
        params, every = order.params, tuple(block for group in order.blocks for block in group.ids)
        if not every and not order.reason:  # D needs nothing (a full prefix hit): only P is told
            self.notices.nothing_wanted(order)
            return
        try:
            if order.reason:  # the scheduler side could not tell which blocks to register
                raise ConfigError(f"cannot register the KV of {order.request_id}: {order.reason}")
            parts = self._parts(params, Role.DECODE)
        except ConfigError as exc:  # reported as a failed load by the next results()
            self.book.refused(order.request_id, every, failed_future(exc))
            return

        def wanted(group: int) -> bool:
            return group < len(order.blocks) and bool(order.blocks[group].ids)

        self.book.expecting(order.request_id, [key for _, group, key in parts if wanted(group)], every)
        p_tp = tp_sizes(params, Role.DECODE, self.tp_size)[0]
        if self.firsts is not None and params.first_token and parts and not any(g.state for g in self.kv_groups):
            source, _, key = parts[0]  # the first P rank feeding this one sends it, naming its first part
            first_from = (params.transfer_id, Reach(params.prefill, p_tp, source).name, key, self._ask_first)
            self.firsts.expect(order.request_id, *first_from)
        many = len(self.kv_groups) > 1
        for source, group, key in parts:
            reach = Reach(params.prefill, p_tp, source)
            if not wanted(group):  # nothing of this group (none held): P releases its part at once
                first = order.blocks[group].first if group < len(order.blocks) else 0
                nothing = Expect(key, reach.name, (), expected_batches=0, first_position=first)
                send_request(self._link(), nothing, reach, always=True).add_done_callback(
                    partial(self.notices.log_failure, what=f"cannot tell P {order.request_id} needs no {key}")
                )
                continue
            blocks = order.blocks[group]
            # push: P decides how many WRITEs (its token budget splits the prompt into chunks)
            batches = OPEN_BATCHES if params.mode is Mode.PUSH else 1
            share = f"{params.transfer_id}#{params.epoch}"  # several P ranks may fill the same blocks
            layers = self.kv_groups[group].layers if many else None
            expect = Expect(key, reach.name, blocks.ids, params.mode, batches, blocks.first, share, layers)
            future = send_request(self._link(), expect, reach)
            self.book.awaiting(order.request_id, future, key)

    def _parts(self, params: Any, role: Role) -> list[tuple[int, int, TransferKey]]:
        """:raises ConfigError: see `ranks.transfer_parts`."""
        return transfer_parts(params, role, self.rank, self.tp_size, self.total_heads, self.kv_groups)

    def save_layer(self, orders: Orders, layer_name: str) -> None:
        """Push: a layer of this step's forward is saved.  Once every layer of a part (and of
        the parts before it) is saved, those parts are posted, each WRITE waiting for the
        device to have run the kernels enqueued so far.  A layer whose KV is another's, or that
        kvflow does not know, completes nothing."""
        completed = self.producer.completed_by(orders, layer_name)
        if completed:
            with self._batch():
                self.producer.post_completed(completed)

    def save(self, orders: Orders) -> None:
        """Ready orders, once the forward that computed their KV is enqueued: pull readiness,
        and every push part not posted yet, each waiting for the device (never this thread) to
        have run the forward."""
        if orders.ready:
            with self._batch():
                self.producer.save(orders)

    def _abort(self, order: Order) -> None:
        role = Role.PREFILL if order.producer else Role.DECODE
        if role is Role.DECODE and not order.allocated:
            self.notices.abort_unallocated(order)
            return
        if role is Role.DECODE:  # its pairs still open; their release is then no load failure
            self.book.abort(order.request_id, order.reason)
            return
        try:  # every part, handed over or not (a sliding window's may not have started yet)
            keys = [key for _, _, key in self._parts(order.params, role)]
        except ConfigError:
            return  # nothing was started with these params
        for key in keys:
            self._abort_pair(key, role, order.reason)

    def _abort_pair(self, key: TransferKey, role: Role, reason: str) -> None:
        """Give up on one pair transfer (D: once its registration, if still under way, is done)."""
        send_request(self._link(), Abort(key, role, reason), always=True)

    # ---------------------------------------------------------------- results

    def results(self, finished_req_ids: set[str], idle_wait: float = 0.0) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call; with nothing
        to report, sleeps up to `idle_wait` seconds for the engine to give blocks back (a step
        with no work: see `Orders.idle_wait`)."""
        # first: whatever the engine said since the last step (an engine process's answers
        # settle the futures the book waits on)
        released = self.link.poll_released() if self.link is not None else []
        if idle_wait > 0 and self.link is not None and not (released or self.book.waiting_for_finish()):
            # instead of vLLM's engine core stepping again at once
            self.link.wait_for_engine(idle_wait, self._answered)
            released = self.link.poll_released()
        sending, recving, failed = self.book.results(released, finished_req_ids)
        if self.firsts is None:
            return sending, recving, failed
        for request_id in failed:
            self.firsts.forget(request_id)
        held = self.firsts.hold(recving - failed, finished_req_ids)
        return sending, held | (recving & failed), failed

    def _answered(self) -> bool:
        return self.book.answered() or (self.firsts is not None and self.firsts.answered())

    def _ask_first(self, peer: str, key: TransferKey) -> concurrent.futures.Future[Any]:
        """D: P rank `peer`'s first token of pair transfer `key`, waited for on the engine (as
        long as the KV may take to land, and `FIRST_TOKEN_WAIT` more)."""
        wait = self.settings.transfer_timeout + FIRST_TOKEN_WAIT
        return self._link().command("first_token", peer, key.transfer_id, key.epoch, wait)

    def _supervise(self) -> None:
        """A dead engine process: the pairs it held end (at this step's `results`) and a new
        process starts, as far as the restart policy allows (supervision.py).  Never raises."""
        link, start = self.link, self._process_start
        if not isinstance(link, ProcessLink) or start is None or link.process.alive:
            return
        if self._gave_up and not self.book.lost_pending():
            return
        with contextlib.suppress(KVFlowError):
            link.close(timeout=1.0)  # reaped: every command it had not answered fails
        lost = self.book.engine_lost()
        if not self._restarts.allow(time.monotonic()):
            if not self._gave_up:
                log.error("%s: kvflow's engine process died again: no more restarts within %gs; "
                          "every transfer of this rank fails", self.engine_id, self._restarts.window)  # fmt: skip
            self._gave_up = True
            return
        process = link.process
        log.error("%s: kvflow's engine process (pid %d) died, exit status %s: its %d transfers fail; starting a "
                  "new one", self.engine_id, process.pid, process.proc.returncode, lost)  # fmt: skip
        try:  # at the address peers and routers know, where it can still be had
            self._start_process(dataclasses.replace(start, bind=link.address) if link.address else start)
        except KVFlowError as exc:
            log.error("%s: kvflow's engine process did not start again at %s: %s", self.engine_id, link.address, exc)
            try:
                self._start_process(start)
            except KVFlowError as again:
                log.error("%s: kvflow's engine process did not start again: %s", self.engine_id, again)
                return
        self._gave_up = False
        log.info("kvflow engine %s up again at %s (%s)", self.engine_id, self.address, self._where)

    @property
    def finished_waiting(self) -> int:
        """How many finished requests this worker still remembers, waiting for kvflow to give
        their KV back (bounded by the requests kvflow still sends).  Never raises."""
        return self.book.finished_waiting

    def describe(self, timeout: float) -> str:
        """The engine's own account of what it waits on (at most `timeout` seconds), and this
        rank's: for a run that stalled, never for a hook."""
        link = self.link
        mine = self.book.describe()
        if link is None:
            return f"{self.engine_id}: not started; {mine}"
        try:
            future = link.command("describe")
            deadline = time.monotonic() + timeout
            while not future.done() and time.monotonic() < deadline:
                link.poll_released()  # an engine process's answer comes with what it read
                time.sleep(0.01)
            said = future.result(timeout=0) if future.done() else f"no answer within {timeout}s"
        except (KVFlowError, concurrent.futures.TimeoutError) as exc:
            said = f"cannot tell: {exc}"
        return f"{self.engine_id}: {said}; {mine}"

    def sleep(self, asleep: bool) -> None:
        """vLLM's sleep mode: before the KV memory is freed (`asleep`), this rank's engine fails
        what is live, says Goodbye to its peers and deregisters the memory (an engine process
        also unmaps GPU chunks it imported); on wake-up it registers it again (GPU chunks
        exported anew and handed over first).  Blocks until done (bounded); idempotent; nothing
        before register.
        :raises KVFlowError: see `Engine.unregister_memory`, `EngineLink.wait`."""
        if self.link is None:
            return
        timeout = SHUTDOWN_DRAIN + self.settings.fence_timeout + 20
        if asleep:
            self.link.wait(self.link.command("unregister_memory"), timeout)
            return
        # GPU chunks an engine process maps come back as new descriptors: vLLM remapped them
        chunks = self._gpu.send_again(self.link.process) if isinstance(self.link, ProcessLink) else None
        args = () if chunks is None else (chunks,)
        self.link.wait(self.link.command("restore_memory", *args), timeout)

    def load_errors(self) -> set[int]:
        return self.book.take_load_errors()

    def close(self) -> None:
        if self.link is not None:
            try:
                # the drain, fences of WRITEs aborted then, peers' removals: bounded, and below this
                self.link.close(timeout=SHUTDOWN_DRAIN + self.settings.fence_timeout + 20)
            except KVFlowError as exc:
                log.error("%s: engine closed with errors: %s", self.engine_id, exc)
            self.link = self.thread = None

    def _batch(self) -> contextlib.AbstractContextManager[None]:
        """A hook's commands to the engine, sent together when the hook ends."""
        return self.link.batch() if self.link is not None else contextlib.nullcontext()

    def _link(self) -> EngineLink:
        if self.link is None:
            raise UsageError("kvflow worker used before register_kv_caches")
        return self.link
