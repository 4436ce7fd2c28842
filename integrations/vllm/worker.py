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
rule for delayed frees).

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
from kvflow.integrations.vllm.gpu_export import GpuExport
from kvflow.integrations.vllm.kv_caches import CacheDescription
from kvflow.integrations.vllm.links import EngineLink, ProcessLink, failed_future, send_request
from kvflow.integrations.vllm.mapping import Order, Orders
from kvflow.integrations.vllm.notices import PeerNotices
from kvflow.integrations.vllm.producer import ProducerSide, StepMemo
from kvflow.integrations.vllm.rank_agent import Reach
from kvflow.integrations.vllm.ranks import PairBook, rank_name, ranked_layout, tp_sizes, transfer_parts
from kvflow.integrations.vllm.settings import Settings, layer_groups
from kvflow.integrations.vllm.supervision import ProcessStart, RestartPolicy, start_process, start_thread
from kvflow.layout import KVLayout, MemoryType
from kvflow.layout.groups import KVGroup
from kvflow.protocol.actions import ReleaseBlocks
from kvflow.protocol.core import CoreConfig
from kvflow.protocol.messages import OPEN_BATCHES, TransferKey
from kvflow.protocol.requests import Abort, Expect
from kvflow.protocol.state import Mode, Outcome, Role
from kvflow.runtime import host_memory
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.runtime.threaded import EngineThread
from kvflow.transports.base import Transport

__all__ = ("Settings", "WorkerSide", "layer_groups")  # Settings, layer_groups: from settings.py

log = logging.getLogger("kvflow.vllm")

# At shutdown a rank's engine lets its transfers finish this long (a WRITE in flight, a
# registration on its way), then aborts the rest, telling their peers: one waiting for a peer
# that never comes must not hold vLLM's shutdown for the 30 s an engine drains by default.
SHUTDOWN_DRAIN = 2.0


class WorkerSide(ProducerSide):
    def __init__(
        self, engine_id: str, rank: int, settings: Settings, tp_size: int = 1, total_heads: int = 0, dp_rank: int = 0
    ) -> None:
        """`tp_size`: the engine's tensor parallelism; `total_heads`: the model's KV heads (1
        for MLA's latent cache; 0: this rank's heads times `tp_size`); `dp_rank`: the engine's
        data-parallel rank (its ranks bind ports after the ``dp_rank * tp_size`` before them)."""
        self.port = settings.port + dp_rank * tp_size if settings.port else 0
        self.base_engine_id = engine_id
        self.engine_id = rank_name(engine_id, rank)
        self.rank = rank
        self.tp_size = tp_size
        self.total_heads = total_heads
        self.settings = settings
        self.pairs = PairBook()  # each request's pair transfers on this rank
        self.link: EngineLink | None = None  # to this rank's engine, wherever it runs
        self._gpu = GpuExport("legacy-ipc")  # how GPU memory reached an engine process (none yet)
        self.thread: EngineThread | None = None  # the engine's thread, when it runs on one
        self.notices = PeerNotices(self.engine_id, tp_size, self._link, self._parts)
        self._requests: dict[tuple[TransferKey, Role], str] = {}
        self._aborted: set[str] = set()  # D requests aborted while their KV was coming
        # requests vLLM said finished whose KV kvflow may still give back (see `results`)
        self._finished_ids: set[str] = set()
        self._late_frees: set[str] = set()  # released, waiting for vLLM to say the request finished
        self._load_errors: set[int] = set()
        # D registrations handed to the engine: (future, request id, block ids, key)
        self._failed_starts: list[tuple[concurrent.futures.Future[Any], str, tuple[int, ...], TransferKey | None]] = []
        self._ready_starts: list[tuple[concurrent.futures.Future[Any], str, TransferKey]] = []
        self._connected: dict[str, concurrent.futures.Future[None]] = {}
        self.kv_groups: tuple[KVGroup, ...] = (KVGroup((0, 1)),)  # the model's KV cache groups
        self._run_order: tuple[int, ...] = (0,)  # kvflow layers in the forward's order
        self._page_bytes = 0  # one block of one layer
        # the (KV cache group, layers) parts a push chunk goes out in, by how many stretches of
        # the forward (see `_units`); at most ``push_layer_groups`` stretches
        self._unit_sets: dict[int, list[tuple[int, tuple[int, int]]]] = {}
        self.layer_of: dict[str, int] = {}  # vLLM layer name -> kvflow layer (execution order)
        self.device: Device = HostDevice()
        self._step = StepMemo()  # what this step's hooks worked out (the layers saved, each request's parts)
        self._groups_sent: dict[str, int] = {}  # push request -> parts of its chunk handed to the engine
        self._process_start: ProcessStart | None = None  # what the engine process started from
        self._restarts = RestartPolicy()
        self._lost: dict[tuple[TransferKey, Role], str] = {}  # the pairs a dead engine process held
        self._gave_up = False  # the restarts ran out: said once

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
        self._run_order = caches.run_order or tuple(range(layout.spec.num_layers))
        self._page_bytes = layout.spec.page_bytes
        self._unit_sets = {}
        self.layer_of = dict(caches.layer_of)
        self.device = device
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
            self._start_process(ProcessStart(self.engine_id, layout, config, bind, settings, device))
        elif settings.engine_process == "process":
            raise ConfigError(f"kvflow engine_process 'process' cannot serve rank {self.engine_id}: {why_not}")
        else:
            self.thread, self.link, self._where = start_thread(
                self.engine_id, layout, config, bind, settings, device, transport
            )
        groups = layout.spec.kv_groups
        if groups:  # vLLM's hybrid KV cache manager: each group's blocks move with its own layers
            log.info("kvflow engine %s: KV cache groups %s", self.engine_id, groups)
        log.info("kvflow engine %s up at %s (%s)", self.engine_id, self.address, self._where)

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
        self._step = StepMemo()  # a new step: its forward has saved no layer yet
        if orders.expect or orders.abort or orders.promise:
            with self._batch():
                self._start_load(orders)

    def _start_load(self, orders: Orders) -> None:
        for order in orders.expect:
            self._expect(order)
        for order in orders.abort:  # after the expects: a request may end in the step it was allocated
            self._abort(order)
        for order in orders.promise:
            self.notices.promise(order)

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
        except ConfigError as exc:
            self._failed_starts.append((failed_future(exc), order.request_id, every, None))
            return

        def wanted(group: int) -> bool:
            return group < len(order.blocks) and bool(order.blocks[group].ids)

        self.pairs.open(order.request_id, Role.DECODE, [key for _, group, key in parts if wanted(group)], every)
        p_tp = tp_sizes(params, Role.DECODE, self.tp_size)[0]
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
            self._requests[(key, Role.DECODE)] = order.request_id
            # push: P decides how many WRITEs (its token budget splits the prompt into chunks)
            batches = OPEN_BATCHES if params.mode is Mode.PUSH else 1
            share = f"{params.transfer_id}#{params.epoch}"  # several P ranks may fill the same blocks
            layers = self.kv_groups[group].layers if many else None
            expect = Expect(key, reach.name, blocks.ids, params.mode, batches, blocks.first, share, layers)
            future = send_request(self._link(), expect, reach)
            self._failed_starts.append((future, order.request_id, every, key))

    def _parts(self, params: Any, role: Role) -> list[tuple[int, int, TransferKey]]:
        """:raises ConfigError: see `ranks.transfer_parts`."""
        return transfer_parts(params, role, self.rank, self.tp_size, self.total_heads, self.kv_groups)

    def save_layer(self, orders: Orders, layer_name: str) -> None:
        """Push: a layer of this step's forward is saved.  Once every layer of a part (and of
        the parts before it) is saved, those parts are posted, each WRITE waiting for the
        device to have run the kernels enqueued so far.  A layer whose KV is another's, or that
        kvflow does not know, completes nothing."""
        completed = self._completed_by(orders, layer_name)
        if completed:
            with self._batch():
                self._post_completed(completed)

    def save(self, orders: Orders) -> None:
        """Ready orders, once the forward that computed their KV is enqueued: pull readiness,
        and every push part not posted yet, each waiting for the device (never this thread) to
        have run the forward."""
        if orders.ready:
            with self._batch():
                self._save(orders)

    def _abort(self, order: Order) -> None:
        role = Role.PREFILL if order.producer else Role.DECODE
        if role is Role.DECODE and not order.allocated:
            self.notices.abort_unallocated(order)
            return
        keys = self.pairs.still_open(order.request_id, role)
        if role is Role.DECODE:
            if not keys:
                return  # released already (reported as received), or it never started
            self._aborted.add(order.request_id)  # its release is then no load failure
        else:  # every part, handed over or not (a sliding window's may not have started yet)
            try:
                keys = [key for _, _, key in self._parts(order.params, role)]
            except ConfigError:
                return  # nothing was started with these params
        for key in keys:
            assert isinstance(key, TransferKey)
            self._abort_pair(key, role, order.reason)

    def _abort_pair(self, key: TransferKey, role: Role, reason: str) -> None:
        """Give up on one pair transfer (D: once its registration, if still under way, is done)."""
        send_request(self._link(), Abort(key, role, reason), always=True)

    # ---------------------------------------------------------------- results

    def results(self, finished_req_ids: set[str], idle_wait: float = 0.0) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call; with nothing
        to report, sleeps up to `idle_wait` seconds for the engine to give blocks back (a step
        with no work: see `Orders.idle_wait`)."""
        self._finished_ids |= finished_req_ids
        # first: whatever the engine said since the last step (an engine process's answers
        # settle the futures below)
        released = self.link.poll_released() if self.link is not None else []
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        if idle_wait > 0 and self.link is not None and not (released or self._late_frees):
            # instead of vLLM's engine core stepping again at once
            self.link.wait_for_engine(idle_wait, self._settled_start)
            released = self.link.poll_released()
        if not (released or self._failed_starts or self._ready_starts or self._late_frees or self._lost):  # most
            if self._finished_ids:
                self._finished_ids &= self._sending_ids()
            return sending, recving, failed
        for start in list(self._failed_starts):
            future, request_id, blocks, key = start
            if not future.done():
                continue
            self._failed_starts.remove(start)
            if future.exception() is not None:  # never registered: no block is held by kvflow
                log.error("%s: could not start receiving %s: %s", self.engine_id, request_id, future.exception())
                if key is None:  # no pair was opened
                    self._aborted.discard(request_id)
                    recving.add(request_id)
                    failed.add(request_id)
                    self._load_failed(blocks)
                    continue
                self._requests.pop((key, Role.DECODE), None)
                self._pair_ended(request_id, Role.DECODE, key, recving, failed, hard=True)
        for ready in list(self._ready_starts):
            future, request_id, key = ready
            if future.done():
                self._ready_starts.remove(ready)
                if future.exception() is not None:  # kvflow never took the blocks: vLLM frees them
                    log.error(
                        "%s: could not hand over the KV of %s: %s", self.engine_id, request_id, future.exception()
                    )
                    self._requests.pop((key, Role.PREFILL), None)
                    self._pair_ended(request_id, Role.PREFILL, key, recving, failed, hard=True)
        for (key, role), request_id in self._lost.items():  # what a dead engine process held
            if self._requests.get((key, role)) == request_id:
                del self._requests[(key, role)]
                self._pair_ended(request_id, role, key, recving, failed, hard=True)
        self._lost.clear()
        for release in released:
            self._on_release(release, recving, failed)
        for request_id in list(self._late_frees):
            if request_id in self._finished_ids:
                self._late_frees.discard(request_id)
                self._finished_ids.discard(request_id)
                sending.add(request_id)
        # Only a request whose prefill-side KV kvflow holds (or failed to take) can need its
        # finish later; vLLM reports a request finished after the step that saved its KV, so
        # every other finished id (every decode request, every request kvflow never sent) is
        # dropped here instead of kept for the life of the process.
        if self._finished_ids:
            self._finished_ids &= self._sending_ids()
        return sending, recving, failed

    def _supervise(self) -> None:
        """A dead engine process: the pairs it held end (at this step's `results`) and a new
        process starts, as far as the restart policy allows (supervision.py).  Never raises."""
        link, start = self.link, self._process_start
        if not isinstance(link, ProcessLink) or start is None or link.process.alive:
            return
        if not self._lost and self._gave_up:
            return
        with contextlib.suppress(KVFlowError):
            link.close(timeout=1.0)  # reaped: every command it had not answered fails
        self._lost.update(self._requests)
        if not self._restarts.allow(time.monotonic()):
            if not self._gave_up:
                log.error("%s: kvflow's engine process died again: no more restarts within %gs; "
                          "every transfer of this rank fails", self.engine_id, self._restarts.window)  # fmt: skip
            self._gave_up = True
            return
        process = link.process
        log.error("%s: kvflow's engine process (pid %d) died, exit status %s: its %d transfers fail; starting a "
                  "new one", self.engine_id, process.pid, process.proc.returncode, len(self._lost))  # fmt: skip
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

    def _settled_start(self) -> bool:
        """Whether a registration or hand-over the engine was given has an answer to act on."""
        return any(start[0].done() for start in self._failed_starts) or any(
            ready[0].done() for ready in self._ready_starts
        )

    @property
    def finished_waiting(self) -> int:
        """How many finished requests this worker still remembers, waiting for kvflow to give
        their KV back (bounded by the requests kvflow still sends).  Never raises."""
        return len(self._finished_ids)

    def _sending_ids(self) -> set[str]:
        ids = {request_id for (_, role), request_id in self._requests.items() if role is Role.PREFILL}
        return ids | self._late_frees | {request_id for _, request_id, _ in self._ready_starts}

    def _on_release(self, release: ReleaseBlocks, recving: set[str], failed: set[str]) -> None:
        request_id = self._requests.pop((release.key, release.role), None)
        if request_id is None:
            return
        failed_pair = release.role is Role.DECODE and release.outcome is not Outcome.SUCCEEDED
        if failed_pair and request_id not in self._aborted:  # vLLM answers it with a bare HTTP 500
            # a failed or expired transfer has the engine's line giving the cause; an aborted one
            # was ended on purpose, here after another of the request's transfers failed, or by P
            aborted = release.outcome is Outcome.ABORTED
            why = "ended on purpose" if aborted else "the kvflow engine's line for it says why"
            log.error("%s: the KV of %s did not load: transfer %s %s (%s)", self.engine_id, request_id, release.key,
                      release.outcome.value, why)  # fmt: skip
        self._pair_ended(request_id, release.role, release.key, recving, failed, failed=failed_pair)

    def _pair_ended(
        self,
        request_id: str,
        role: Role,
        key: TransferKey,
        recving: set[str],
        failed_ids: set[str],
        *,
        failed: bool = False,
        hard: bool = False,
    ) -> None:
        """One pair transfer of a request ended (released, or never started: `hard`)."""
        done = self.pairs.close(request_id, role, key, failed=failed, hard=hard)
        if done is None:
            if (failed or hard) and role is Role.DECODE:  # the request fails: end its other pairs now
                for other in self.pairs.still_open(request_id, role):
                    assert isinstance(other, TransferKey)
                    self._abort_pair(other, role, f"another rank's transfer of {request_id} failed")
            return
        if role is Role.PREFILL:
            self._late_frees.add(request_id)
            return
        # D: every rank reports the request once, in finished_recving, when all its pairs have
        # ended, whether its KV landed or failed or the request ended meanwhile: vLLM's
        # aggregator counts the ranks per set, and frees a finished request's blocks on
        # finished_recving.  (With load failures reported as invalid blocks, vLLM may fail the
        # request when the first rank fails; the others then abort, and report here too.)
        recving.add(request_id)
        aborted = request_id in self._aborted
        self._aborted.discard(request_id)
        if done.hard or (done.failed and not aborted):
            failed_ids.add(request_id)
            self._load_failed(done.blocks)

    def describe(self, timeout: float) -> str:
        """The engine's own account of what it waits on (at most `timeout` seconds), and this
        rank's: for a run that stalled, never for a hook."""
        link = self.link
        mine = f"open pairs {len(self.pairs)}, starts {len(self._failed_starts)}/{len(self._ready_starts)}"
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

    def _load_failed(self, blocks: tuple[int, ...]) -> None:
        """A failed load's blocks, for vLLM's load-failure policy.  Not with several KV cache
        groups: vLLM 0.32/0.33 cannot map block ids back to requests then (they are unique only
        within a group; it raises if given any), and takes the request's failure from
        ``failed_recving`` alone."""
        if len(self.kv_groups) == 1:
            self._load_errors.update(blocks)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

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
