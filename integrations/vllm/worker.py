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
runs in the host's interpreter; on a thread of this process otherwise (GPU memory, the loopback
fabric of tests), or when asked (``engine_process: "thread"``).  Measured with `kvflow bench
host`, an engine thread in the host's interpreter took the GIL from the host's steps: at 100
transfers/s P's steps were 30 % fewer and 13 ms longer at p99.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import time
from typing import Any

from kvflow.control.channel import ControlChannel
from kvflow.control.zeromq import ZmqControl
from kvflow.errors import ConfigError, KVFlowError, UsageError
from kvflow.integrations.vllm.device import Device, Gate, HostDevice
from kvflow.integrations.vllm.kv_caches import CacheDescription
from kvflow.integrations.vllm.links import EngineLink, ProcessLink, ThreadLink
from kvflow.integrations.vllm.mapping import Order, Orders
from kvflow.integrations.vllm.notices import PeerNotices
from kvflow.integrations.vllm.rank_agent import peer_wire
from kvflow.integrations.vllm.ranks import PairBook, pair_keys, rank_name, ranked_layout, tp_sizes
from kvflow.integrations.vllm.settings import Settings, layer_groups
from kvflow.layout import KVLayout
from kvflow.protocol.actions import ReleaseBlocks
from kvflow.protocol.core import CoreConfig
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Mode, Outcome, Role
from kvflow.runtime import host_memory
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.runtime.process import EngineProcess, ProcessSpec
from kvflow.runtime.threaded import EngineThread
from kvflow.transports.base import Transport

__all__ = ("Settings", "WorkerSide", "layer_groups")  # Settings, layer_groups: from settings.py

log = logging.getLogger("kvflow.vllm")

_LOOPBACK_FABRICS: dict[str, Any] = {}  # in-process fabrics by name, for tests and simulation
INLINE_OP_BYTES = 1 << 20  # in an engine process, ops of up to 1 MiB are posted from its loop
# At shutdown a rank's engine lets its transfers finish this long (a WRITE in flight, a
# registration on its way), then aborts the rest, telling their peers: one waiting for a peer
# that never comes must not hold vLLM's shutdown for the 30 s an engine drains by default.
SHUTDOWN_DRAIN = 2.0


def _failed(exc: BaseException) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_exception(exc)
    return future


class WorkerSide(PeerNotices):
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
        self.thread: EngineThread | None = None  # the engine's thread, when it runs on one
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
        self.layer_groups: list[tuple[int, int]] = [(0, 1)]  # the most a chunk goes out in (see `_groups`)
        self._num_layers = 1
        self._block_bytes = 0
        self._group_sets: dict[int, list[tuple[int, int]]] = {}
        self.layer_of: dict[str, int] = {}  # vLLM layer name -> kvflow layer (execution order)
        self.device: Device = HostDevice()
        self._saved: set[int] = set()  # kvflow layers saved in this step's forward
        self._groups_sent: dict[str, int] = {}  # push request -> layer groups handed to the engine

    # ---------------------------------------------------------------- setup

    def register(self, caches: CacheDescription, device: Device) -> None:
        """Start this rank's engine on its KV memory, in a process of its own or on a thread
        (see the module's header); every thread it starts here uses `device`.

        :raises ConfigError: ``engine_process: "process"`` where a process cannot serve, or
            the layout is not what this rank holds.
        :raises KVFlowError: the engine did not start (the transport refused the memory, the
            engine process failed, or did not say ready in time).
        """
        settings = self.settings
        layout = self._ranked(caches.layout)
        self.layer_groups = layer_groups(layout.spec.num_layers, settings.push_layer_groups)
        self._num_layers = layout.spec.num_layers
        self._block_bytes = layout.block_len * len(layout.arrays)  # one block, every layer
        self._group_sets = {len(self.layer_groups): self.layer_groups}
        self.layer_of = dict(caches.layer_of)
        self.device = device
        config = EngineConfig(
            core=CoreConfig(fence_timeout=settings.fence_timeout),
            transfer_timeout=settings.transfer_timeout,
            lease=settings.lease,
            allowed_peers=settings.allow_list(ranks=True),
            drain_timeout=SHUTDOWN_DRAIN,
        )
        port = self.port + self.rank if self.port else 0
        bind = f"tcp://{settings.host}:{port}"
        why_not = self._why_not_a_process(device)
        if why_not is None:
            self._start_process(layout, config, bind)
        elif settings.engine_process == "process":
            raise ConfigError(f"kvflow engine_process 'process' cannot serve rank {self.engine_id}: {why_not}")
        else:
            self._start_thread(layout, config, bind, device)
        log.info("kvflow engine %s up at %s (%s)", self.engine_id, self.address, self._where)

    def _why_not_a_process(self, device: Device) -> str | None:
        """Why this rank's engine cannot run in a process of its own (None: it can)."""
        if self.settings.engine_process == "thread":
            return "asked for a thread"
        if self.settings.transport != "nixl":
            return f"the {self.settings.transport} transport does not cross processes"
        if not isinstance(device, HostDevice):
            return "its KV caches are device memory (sharing them through CUDA IPC is not built)"
        if not host_memory.supported():
            return "this platform cannot share host memory (Linux memfd needed)"
        return None

    def _start_process(self, layout: KVLayout, config: EngineConfig, bind: str) -> None:
        # the engine process's loop is kvflow's alone: a small op is posted there (see EngineConfig)
        config = dataclasses.replace(config, inline_op_bytes=INLINE_OP_BYTES)
        spans = host_memory.share_in_place(layout.regions)
        spec = ProcessSpec(
            self.engine_id,
            layout,
            transport="nixl",
            transport_options={
                "backends": list(self.settings.nixl_backends),
                "granule": layout.block_len,
                "cuda": False,
            },
            bind=bind,
            config=config,
            agent="kvflow.integrations.vllm.rank_agent:RankAgent",
            agent_options={"transfer_timeout": self.settings.transfer_timeout},
            log_level=log.getEffectiveLevel(),
            cpus=self.settings.engine_cpus,
        )
        try:
            process = EngineProcess(spec, spans)
        finally:
            for span in spans:  # the child has its own; this process's mapping keeps the memory
                os.close(span.fd)
        self.link = ProcessLink(process)
        self._where = f"engine process pid {process.pid}"

    def _start_thread(self, layout: KVLayout, config: EngineConfig, bind: str, device: Device) -> None:
        settings = self.settings
        config = dataclasses.replace(config, thread_setup=device.bind_thread)

        def factory() -> Engine:
            transport: Transport
            if settings.transport == "loopback":
                from kvflow.transports.loopback import LoopbackFabric

                fabric = _LOOPBACK_FABRICS.setdefault(settings.fabric, LoopbackFabric())
                transport = fabric.endpoint(self.engine_id)
            else:
                from kvflow.transports.nixl import NixlTransport

                transport = NixlTransport(
                    self.engine_id,
                    backends=settings.nixl_backends,
                    granule=layout.block_len,
                    thread_setup=device.bind_thread,
                )
            control: ControlChannel = ZmqControl(self.engine_id, bind=bind, thread_setup=device.bind_thread)
            return Engine(self.engine_id, layout, transport, control, config=config)

        self.thread = EngineThread(factory, name=f"kvflow-{self.engine_id}", thread_setup=device.bind_thread)
        self.link = ThreadLink(self.thread, settings.transfer_timeout, device)
        self._where = f"engine thread, pid {os.getpid()}"

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
        """Expect and abort orders: handed to the engine, never waited on."""
        with self._batch():
            self._start_load(orders)

    def _start_load(self, orders: Orders) -> None:
        self._saved.clear()  # a new step: its forward has saved no layer yet
        for order in orders.expect:
            params = order.params
            if not order.block_ids:  # D needs nothing (a full prefix hit): only P is told
                self._tell_nothing_wanted(order)
                continue
            try:
                pairs = pair_keys(params, Role.DECODE, self.rank, self.tp_size, self.total_heads)
            except ConfigError as exc:  # reported as a failed load by the next results()
                self._failed_starts.append((_failed(exc), order.request_id, order.block_ids, None))
                continue
            self.pairs.open(order.request_id, Role.DECODE, [key for _, key in pairs], order.block_ids)
            p_tp = tp_sizes(params, Role.DECODE, self.tp_size)[0]
            blocks = list(order.block_ids)
            for source, key in pairs:
                self._requests[(key, Role.DECODE)] = order.request_id
                future = self._link().command(
                    "expect_blocks",
                    peer_wire(params.prefill),
                    p_tp,
                    source,
                    key.transfer_id,
                    key.epoch,
                    blocks,
                    params.mode.value,
                    order.first_position,
                    f"{params.transfer_id}#{params.epoch}",  # several P ranks may fill the same blocks
                )
                self._failed_starts.append((future, order.request_id, order.block_ids, key))
        for order in orders.abort:  # after the expects: a request may end in the step it was allocated
            self._abort(order)
        for order in orders.promise:
            self._promise(order)

    def save_layer(self, orders: Orders, layer_name: str) -> None:
        """Push: a layer of this step's forward is saved.  Once every layer of a group (and of
        the groups before it) is saved, those groups are posted, each WRITE waiting for the
        device to have run the kernels enqueued so far.  A layer whose KV is another's, or that
        kvflow does not know, completes nothing."""
        with self._batch():
            self._save_layer(orders, layer_name)

    def _save_layer(self, orders: Orders, layer_name: str) -> None:
        layer = self.layer_of.get(layer_name)
        if layer is None or not orders.ready:
            return
        self._saved.add(layer)
        gate: Gate | None = None
        recorded = False
        for order in orders.ready:
            if order.params.mode is not Mode.PUSH:
                continue
            groups = self._groups(order)
            complete = self._groups_sent.get(order.request_id, 0)
            while complete < len(groups) and self._saved.issuperset(range(*groups[complete])):
                complete += 1
            if complete > self._groups_sent.get(order.request_id, 0):
                if not recorded:  # one device event for every group this layer completes
                    gate, recorded = self.device.record(), True
                self._post_groups(order, complete, gate)

    def save(self, orders: Orders) -> None:
        """Ready orders, once the forward that computed their KV is enqueued: pull readiness,
        and every push layer group not posted yet, each waiting for the device (never this
        thread) to have run the forward."""
        with self._batch():
            self._save(orders)

    def _save(self, orders: Orders) -> None:
        if not orders.ready:
            return
        gate = self.device.record()
        for order in orders.ready:
            if order.params.mode is Mode.PUSH:
                self._post_groups(order, len(self._groups(order)), gate)
                self._groups_sent.pop(order.request_id, None)
                continue
            pairs = self._open_sending(order)
            decode = order.params.decode  # None: a sequential router's transfer, for whichever D claims it
            d_tp = tp_sizes(order.params, Role.PREFILL, self.tp_size)[1] if pairs and decode is not None else 0
            for target, key in pairs:
                future = self._link().command(
                    "ready_pull",
                    None if decode is None else peer_wire(decode),
                    d_tp,
                    target,
                    key.transfer_id,
                    key.epoch,
                    list(order.block_ids),
                    gate,
                )
                self._ready_starts.append((future, order.request_id, key))

    def _open_sending(self, order: Order) -> list[tuple[int, TransferKey]]:
        """P: the pairs this rank feeds for `order`, recorded; none (or params it cannot use):
        kvflow takes no block, and the request is reported sent once vLLM says it finished."""
        try:
            pairs = pair_keys(order.params, Role.PREFILL, self.rank, self.tp_size, self.total_heads)
        except ConfigError as exc:
            log.error("%s: could not hand over the KV of %s: %s", self.engine_id, order.request_id, exc)
            pairs = []
        if not pairs:
            self._late_frees.add(order.request_id)
            return []
        self.pairs.open(order.request_id, Role.PREFILL, [key for _, key in pairs], order.block_ids)
        for _, key in pairs:
            self._requests[(key, Role.PREFILL)] = order.request_id
        return pairs

    def _post_groups(self, order: Order, upto: int, gate: Gate | None) -> list[concurrent.futures.Future[Any]]:
        """Hand the engine layer groups ``[sent, upto)`` of a push order, in order, for each
        D rank this rank feeds."""
        first = self._groups_sent.get(order.request_id, 0)
        if first >= upto:
            return []
        self._groups_sent[order.request_id] = upto
        if first == 0 and order.first == 0:  # the request's first chunk: its pairs open now
            keys: list[Any] = [key for _, key in self._open_sending(order)]
        else:
            keys = self.pairs.still_open(order.request_id, Role.PREFILL)
        futures: list[concurrent.futures.Future[Any]] = []
        groups = self._groups(order)
        blocks, last = list(order.block_ids), len(groups) - 1
        bound = self._decode_ranks(order)
        for key in keys:
            assert isinstance(key, TransferKey)
            for group in range(first, upto):
                future = self._link().command(
                    "post_group",
                    key.transfer_id,
                    key.epoch,
                    blocks,
                    group,
                    list(groups[group]),
                    order.final and group == last,
                    order.first,
                    group == 0 and order.first == 0,
                    gate,
                    bound.get(key),
                )
                futures.append(future)
                if group == 0 and order.first == 0:
                    self._ready_starts.append((future, order.request_id, key))
        return futures

    def _decode_ranks(self, order: Order) -> dict[TransferKey, str]:
        """P: the D rank each of this rank's pairs for `order` is for, as the params name it: the
        KV goes to that rank only, never to whichever engine registered the transfer id first."""
        decode = order.params.decode
        if decode is None:
            return {}
        try:
            pairs = pair_keys(order.params, Role.PREFILL, self.rank, self.tp_size, self.total_heads)
        except ConfigError:  # its pairs were refused when they opened, and reported then
            return {}
        return {key: rank_name(decode.engine, target) for target, key in pairs}

    def _groups(self, order: Order) -> list[tuple[int, int]]:
        """The layer groups a push order's blocks go out in: as many as ``push_layer_groups``
        allows with at least ``push_group_bytes`` in each (one WRITE for a small chunk: every
        WRITE costs the engine the same work whatever its size, and a small one gains nothing
        from starting before the forward ends)."""
        count = len(self.layer_groups)
        if self.settings.push_group_bytes:
            wanted = -(-len(order.block_ids) * self._block_bytes // self.settings.push_group_bytes)
            count = max(1, min(count, wanted))
        groups = self._group_sets.get(count)
        if groups is None:
            groups = self._group_sets[count] = layer_groups(self._num_layers, count)
        return groups

    def _abort(self, order: Order) -> None:
        role = Role.PREFILL if order.producer else Role.DECODE
        if role is Role.DECODE and not order.allocated:
            self._abort_unallocated(order)
            return
        keys = self.pairs.still_open(order.request_id, role)
        if role is Role.DECODE:
            if not keys:
                return  # released already (reported as received), or it never started
            self._aborted.add(order.request_id)  # its release is then no load failure
        else:
            try:
                keys = keys or [
                    key for _, key in pair_keys(order.params, role, self.rank, self.tp_size, self.total_heads)
                ]
            except ConfigError:
                return  # nothing was started with these params
        for key in keys:
            assert isinstance(key, TransferKey)
            self._abort_pair(key, role, order.reason)

    def _abort_pair(self, key: TransferKey, role: Role, reason: str) -> None:
        """Give up on one pair transfer (D: once its registration, if still under way, is done)."""
        self._link().command("abort_pair", key.transfer_id, key.epoch, role.value, reason)

    # ---------------------------------------------------------------- results

    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        self._finished_ids |= finished_req_ids
        # first: whatever the engine said since the last step (an engine process's answers
        # settle the futures below)
        released = self.link.poll_released() if self.link is not None else []
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
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
                    self._load_errors.update(blocks)
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
        self._finished_ids &= self._sending_ids()
        return sending, recving, failed

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
            self._load_errors.update(done.blocks)

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
        what is live, says Goodbye to its peers and deregisters the memory; on wake-up it
        registers it again.  Blocks until done (bounded); idempotent; nothing before register.
        :raises KVFlowError: see `Engine.unregister_memory`, `EngineLink.wait`."""
        if self.link is not None:
            name = "unregister_memory" if asleep else "restore_memory"
            self.link.wait(self.link.command(name), SHUTDOWN_DRAIN + self.settings.fence_timeout + 20)

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
