"""`KVFlowConnector`: kvflow behind vLLM's KV-connector V1 API (vLLM 0.32.x, 0.33.x and 0.34.x).

Why a thin facade: vLLM builds one instance per role.  The scheduler-role instance keeps the
pure `SchedulerBook` (mapping.py) and ships its per-step orders to the workers as connector
metadata; each worker-role instance runs one kvflow engine for its rank (worker.py).  Load it
with::

    --kv-transfer-config '{"kv_connector": "KVFlowConnector",
                           "kv_connector_module_path": "kvflow.integrations.vllm",
                           "kv_role": "kv_producer" | "kv_consumer",
                           "kv_connector_extra_config": {"port": 5700}}'

It declares vLLM's `SupportsHMA`: with the hybrid KV cache manager on, each KV cache group's
blocks move with that group's layers, a sliding-window group's only within its window.  What
differs between the releases it runs on is in releases.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.request import RequestStatus

from kvflow.errors import ConfigError, UsageError
from kvflow.integrations.vllm.device import Device, device_for
from kvflow.integrations.vllm.first_token import PROCESSOR, FirstTokenWaits
from kvflow.integrations.vllm.idle_sleep import IdleSleep, StepView, engine_core_pid, listen
from kvflow.integrations.vllm.kv_caches import cache_groups, check_supported, describe_kv_caches
from kvflow.integrations.vllm.mapping import Orders, SchedulerBook
from kvflow.integrations.vllm.releases import (
    cache_access,
    check_gpu_export,
    check_sleep_mode,
    check_vllm_version,
    drop_prompt_tail,
    skips_external_kv,
)
from kvflow.integrations.vllm.stats import KVFlowConnectorStats, KVFlowPromMetrics, RankMeter, counter_deltas
from kvflow.integrations.vllm.worker import Settings, WorkerSide
from kvflow.runtime.bell import bell_path
from kvflow.runtime.engine import Engine

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVCacheAccess, KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvflow.transports.base import Transport

__all__ = ("KVFlowConnector", "KVFlowMetadata")

log = logging.getLogger("kvflow.vllm")


class KVFlowMetadata(KVConnectorMetadata):
    def __init__(self, orders: Orders) -> None:
        self.orders = orders


class KVFlowConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        from vllm import __version__ as vllm_version

        check_vllm_version(vllm_version)
        check_sleep_mode(vllm_config, vllm_version)
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # checked by the base class
        self.settings = Settings.from_extra(transfer.kv_connector_extra_config)
        check_gpu_export(self.settings.gpu_export, vllm_version)
        # data parallelism: one engine per DP rank, named as vLLM's engine core names it
        # (``<engine_id>_dp<k>``, which it does itself when it runs DP ranks), its ranks' ports
        # after the DP ranks' before it (as vLLM's NIXL connector offsets its side channel)
        parallel = vllm_config.parallel_config
        self._dp = int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank) or 0)
        engine_id, suffix = str(transfer.engine_id), f"_dp{self._dp}"
        dp_size = int(parallel.data_parallel_size)
        self.engine_id = engine_id + suffix if dp_size > 1 and not engine_id.endswith(suffix) else engine_id
        check_supported(vllm_config, kv_cache_config)
        # the engine core sleeps while every request waits for KV, woken by the ranks' bell
        # (idle_sleep.py), where its workers are its children or itself, on one node, and it
        # is the only data-parallel rank
        backend = parallel.distributed_executor_backend
        sleeps = self.settings.idle_sleep > 0 and dp_size == 1 and int(getattr(parallel, "nnodes", 1)) == 1
        core_pid = engine_core_pid(backend, os.getpid(), os.getppid()) if sleeps else None
        self._idle_sleep: IdleSleep | None = None
        self._block_size = vllm_config.cache_config.block_size
        self._book: SchedulerBook | None = None
        self._worker: WorkerSide | None = None
        self._meter: RankMeter | None = None
        self._scheduler_counted: dict[str, int] = {}
        self._left_for_decode: set[str] = set()  # P requests whose last prompt token D computes
        self._manager: KVCacheManager | None = None  # vLLM's scheduler binds it (the block tables)
        self._device: Device | None = None  # `inject`ed; otherwise the KV tensors' own
        self._transport: Callable[[str], Transport] | None = None  # `inject`ed; otherwise NIXL
        # With prefix caching a consumer receives only the blocks after a request's local hit,
        # and vLLM shares received blocks only once their load completed (see mapping.py).
        prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        if role is KVConnectorRole.SCHEDULER:
            tp_size = vllm_config.parallel_config.tensor_parallel_size
            producer = self.settings.producer(self.engine_id, tp_size, self._dp)
            groups = cache_groups(kv_cache_config)[0] if kv_cache_config is not None else ()
            self._book = SchedulerBook(
                self._block_size, prefix_caching, producer=producer, allowed=self.settings.allow_list(), groups=groups
            )
            if core_pid is not None:
                self._idle_sleep = listen(self.engine_id, self.settings.idle_sleep)
        else:
            parallel, model = vllm_config.parallel_config, vllm_config.model_config
            heads = 1 if model.use_mla else model.get_total_num_kv_heads()  # MLA: one latent cache on every rank
            tp_size = parallel.tensor_parallel_size
            self._worker = WorkerSide(
                self.engine_id, parallel.rank, self.settings, tp_size, heads, self._dp, _bell(core_pid, self.engine_id)
            )
            if PROCESSOR in (model.logits_processors or ()):  # D's sampler takes P's first token
                self._worker.firsts = FirstTokenWaits()
            self._meter = RankMeter(self._worker.engine_id)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The layout named by the ``kv_cache_layout`` setting, if any: kvflow moves every
        layout, so by default it leaves the choice to the attention backend."""
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config if transfer is not None else None
        return Settings.from_extra(extra).kv_cache_layout or None

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig) -> KVCacheAccess:
        """vLLM 0.34 asks how the workers reach the KV cache, to choose how it allocates a GPU
        cache: kvflow registers it with NIXL, and UCX peers on the same host import it by
        legacy CUDA IPC, or (``gpu_export: "fd"``) its engine process imports the chunks by file
        descriptor (`releases.cache_access` says which flags and why).

        :raises ConfigError: a bad kvflow setting (named)."""
        from vllm.config.kv_transfer import KVCacheAccess
        from vllm.platforms import current_platform

        export = Settings.from_extra(kv_transfer_config.kv_connector_extra_config).gpu_export
        access = KVCacheAccess.IN_PROCESS
        for name in cache_access(gpu=current_platform.is_cuda_alike(), export=export):
            access |= KVCacheAccess[name]
        return access

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """No (vLLM 0.34 asks): vLLM then keeps the block hashes of 0.33, as for its own NIXL
        connectors.  kvflow moves blocks by position, never by hash, so lookahead hashes would
        change only which blocks D's prefix cache finds, and no test of kvflow runs vLLM's
        speculative decoding with them."""
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: object) -> bool:
        """Yes (vLLM 0.33 asks this when ``--enable-sleep-mode`` is on): the worker's sleep and
        wake-up hooks below let go of the KV memory's registration and take it up again."""
        return True

    def unregister_kv_caches(self) -> None:
        """Before sleep (or a discard of the KV cache): this rank's engine fails whatever
        transfer is still live (vLLM says none is; not taken on trust), says Goodbye to its
        peers and deregisters the KV memory; until `restore_kv_caches`, new transfers on this
        rank fail at once ("engine asleep") and peers' handshakes are refused.  Idempotent.

        :raises KVFlowError: the engine did not let go of the memory in time.
        """
        if self._worker is not None:
            self._worker.sleep(True)

    def restore_kv_caches(self) -> None:
        """After wake-up: the same KV regions (sleep mode keeps their addresses) registered
        again; peers associate again, with the new transport metadata, on their next transfer.
        Idempotent.

        :raises KVFlowError: the transport refused the memory.
        """
        if self._worker is not None:
            self._worker.sleep(False)

    # ================================================================ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().matched_tokens(
            request.request_id, request.kv_transfer_params, len(request.prompt_token_ids or ()), num_computed_tokens
        )

    def may_load_async(self, request: Request) -> bool:
        """Whether `get_num_new_matched_tokens` may load `request` asynchronously (vLLM 0.34 asks,
        as the request enters its waiting queues, for ``--max-num-inflight-kv-loads``): a
        remote prefill whose kvflow entry this engine accepts, not yet loaded.  Side-effect free."""
        return self._scheduler().may_load(request.request_id, request.kv_transfer_params)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler().allocated(
            request.request_id,
            request.kv_transfer_params,
            len(request.prompt_token_ids or ()),
            _group_block_ids(blocks),
            num_external_tokens,
        )

    def on_new_request(self, request: Request) -> None:
        book = self._scheduler()
        if (
            book.replay
            and request.request_id not in self._left_for_decode
            and _leave_for_decode(request, book.replay, self._hash_block_size())
        ):
            self._left_for_decode.add(request.request_id)  # once: a preempted request comes back
        book.new_request(request.request_id, request.kv_transfer_params, len(request.prompt_token_ids or ()))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        book = self._scheduler()
        for request_id in scheduler_output.preempted_req_ids or ():
            book.preempted(request_id)
        steps = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        steps += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for request_id, computed in steps:
            if book.producing(request_id):  # the block tables of the requests that hand KV over only
                scheduled = scheduler_output.num_scheduled_tokens.get(request_id, 0)
                book.scheduled(request_id, computed, scheduled, _request_block_ids(self._bound_manager(), request_id))
        # a step that runs no token while transfers are outstanding: vLLM's engine core would
        # step again at once, so the workers may sleep until their engines have news
        idle = scheduler_output.total_num_scheduled_tokens == 0 and book.pending_work()
        orders = book.take_orders()
        orders.idle_wait = self.settings.idle_wait if idle else 0.0
        if idle and self._idle_sleep is not None:
            finishing = len(scheduler_output.finished_req_ids or ())
            step = StepView(scheduler_output.total_num_scheduled_tokens, finishing, bool(orders), book.pending_work())
            if self._idle_sleep.after_step(self, step, _holds):
                orders.idle_wait = 0.0  # it slept here already: its workers need not again
        return KVFlowMetadata(orders)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """vLLM's scheduler hands its KV cache manager over: the block tables of the requests P
        hands over are read from it."""
        super().bind_kv_cache_manager(kv_cache_manager)
        self._manager = kv_cache_manager

    def _bound_manager(self) -> KVCacheManager:
        """:raises ConfigError: vLLM's scheduler bound no KV cache manager to this connector."""
        if self._manager is None:
            raise ConfigError(
                "vLLM's scheduler bound no KV cache manager to the kvflow connector (bind_kv_cache_manager): "
                "the blocks of the requests P hands over cannot be read; is this vLLM one kvflow supports?"
            )
        return self._manager

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._left_for_decode.discard(request.request_id)
        aborted = request.status == RequestStatus.FINISHED_ABORTED
        first = request.output_token_ids[0] if request.output_token_ids else None
        return self._scheduler().finished(request.request_id, aborted, first)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`SupportsHMA`: the same as `request_finished`, whatever the KV cache groups (the book
        kept each group's blocks when it handed them over)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().output(
            set(connector_output.finished_sending or ()),
            set(connector_output.finished_recving or ()),
            set(connector_output.failed_recving or ()),
        )

    def has_pending_push_work(self) -> bool:
        return self._scheduler().pending_work()

    def has_pending_block_frees(self) -> bool:
        return self._scheduler().handing_off()

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Start this rank's engine on vLLM's KV views, whatever their layout.

        :raises ConfigError: the views are not what vLLM's KV cache config says.
        """
        worker = self._worker_side()
        kv_cache_config, config = self._kv_cache_config, self._vllm_config
        if kv_cache_config is None:
            raise ConfigError("kvflow needs vLLM's KV cache config to register KV caches")
        caches = describe_kv_caches(
            kv_caches,
            kv_cache_config,
            model=self.settings.model_id or str(config.model_config.model),
            cache_dtype=str(config.cache_config.cache_dtype),
            layout_name=kv_cache_config.kv_cache_layout or config.cache_config.kv_cache_layout,
            tp_size=config.parallel_config.tensor_parallel_size,
        )
        worker.register(caches, self._device or device_for(next(iter(kv_caches.values()))), self._transport)

    def inject(self, *, device: Device | None = None, transport: Callable[[str], Transport] | None = None) -> None:
        """For a host that builds this connector itself, not vLLM's model runner (the stand-in):
        `device` holds the KV caches it will register (kvflow waits on `device`'s gates before a
        WRITE reads them), in place of the device the tensors name; `transport` makes this rank's
        engine's transport from its engine id (a loopback fabric's endpoint, say), in place of
        NIXL's, and the engine then runs on a thread of this process.  Call it before
        `register_kv_caches`.

        :raises ConfigError: the KV caches are registered already.
        """
        if self._worker is not None and self._worker.link is not None:
            raise ConfigError("kvflow: inject a device or transport before register_kv_caches, not after")
        self._device = device or self._device
        self._transport = transport or self._transport

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's orders arrive: D's registrations (and aborts) go out now, before the
        forward, so that P can write while this step runs."""
        super().bind_connector_metadata(connector_metadata)
        self._worker_side().start_load(self._orders())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None  # the step's registrations went out when its orders were bound

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete before the request is scheduled (asynchronous loading)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Push: once every layer of a layer group is saved, its WRITE is posted (on a GPU it
        waits for an event recorded now), while the forward goes on."""
        orders = self._orders()
        if orders.ready:
            self._worker_side().save_layer(orders, layer_name)

    def wait_for_save(self) -> None:
        """The rest of this step's KV goes out once the device has run the forward; this
        thread does not wait for the device."""
        self._worker_side().save(self._orders())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker_side().results(finished_req_ids, self._orders().idle_wait)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        result = self.get_transfer_results(finished_req_ids)
        return result.finished_sending, result.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._idle_sleep is not None:
            self._idle_sleep.close()

    @property
    def control_address(self) -> str:
        """Where this rank's kvflow engine listens (the router passes it to the peer)."""
        return self._worker.address if self._worker is not None else ""

    def describe_engine(self, timeout: float = 2.0) -> str:
        """What this rank's kvflow engine still waits on, in words, wherever it runs (waits at
        most `timeout` seconds: for a run that stalled, never for a hook)."""
        if self._worker is None:
            return "no kvflow engine (scheduler side)"
        return self._worker.describe(timeout)

    @property
    def kvflow_engine(self) -> Engine | None:
        """This rank's kvflow engine, for inspection (None on the scheduler side, before the KV
        caches are registered, or when the engine runs in a process of its own)."""
        return self._worker.engine if self._worker is not None else None

    # ================================================================ metrics

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Worker side: this rank's figures since the previous step (never waits for the
        engine).  Scheduler side: what the scheduler-side book counted since the previous call,
        if it counts anything (a ``counters`` mapping of cumulative counts)."""
        if self._meter is not None:
            return self._meter.take(self._worker.link if self._worker is not None else None)
        counted = {name: int(value) for name, value in dict(getattr(self._book, "counters", {})).items()}
        if self._idle_sleep is not None:
            counted.update(self._idle_sleep.counters)
        gained = counter_deltas(counted, self._scheduler_counted)
        self._scheduler_counted = counted
        return KVFlowConnectorStats(data={"scheduler": gained}) if gained else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """vLLM's loggers rebuild each payload they receive with this."""
        return KVFlowConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVFlowPromMetrics:
        """The ``vllm:kvflow_*`` Prometheus metrics (docs/vllm.md lists them)."""
        return KVFlowPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ================================================================ plumbing

    def _orders(self) -> Orders:
        meta = self._get_connector_metadata()
        return meta.orders if isinstance(meta, KVFlowMetadata) else Orders()

    def _hash_block_size(self) -> int:
        """The tokens each of a request's block hashes covers, as vLLM's engine core resolved it."""
        config: KVCacheConfig | None = self._kv_cache_config  # None where a host built the connector without one
        if config is None:
            return int(self._block_size)
        if config.hash_block_size is not None:
            return int(config.hash_block_size)
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes  # a host that built the scheduler itself

        return int(resolve_kv_cache_block_sizes(config, self._vllm_config)[1])

    def _scheduler(self) -> SchedulerBook:
        if self._book is None:
            raise UsageError("scheduler-side hook called on a worker-role KVFlowConnector")
        return self._book

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise UsageError("worker-side hook called on a scheduler-role KVFlowConnector")
        return self._worker


def _holds(scheduler: Any) -> Iterator[str]:
    """What each request vLLM's scheduler holds is doing, for `IdleSleep`."""
    for request in scheduler.requests.values():
        status = request.status
        if status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            yield "waiting"
        else:
            yield "finished" if RequestStatus.is_finished(status) else "running"


def _bell(core_pid: int | None, engine_id: str) -> str:
    """Where a worker rings its engine core's bell ("": it does not)."""
    if core_pid is None:
        return ""
    try:
        return bell_path(core_pid, engine_id)
    except ConfigError as exc:
        log.warning("kvflow: %s; the engine core steps without pause while requests wait for KV", exc)
        return ""


def _leave_for_decode(request: Any, tokens: int, hash_block_size: int) -> bool:
    """P, for a model with Mamba / linear-attention state: drop the prompt's last `tokens`, so
    that P's state is the one after the token before them and D, which loads that state, computes
    them itself (as vLLM's NIXL connector does, `_truncate_request_for_prefill`); whether it
    did.  Not for a request that reads no external KV (prompt logprobs): D computes its whole
    prompt."""
    params = request.kv_transfer_params
    if (
        not isinstance(params, Mapping)
        or params.get("do_remote_decode") is not True
        or request.prompt_token_ids is None
        or request.num_prompt_tokens <= tokens
        or skips_external_kv(request)
    ):
        return False
    drop_prompt_tail(request, tokens, hash_block_size)
    return True


def _group_block_ids(blocks: Any) -> list[list[int | None]]:
    """Each KV cache group's block ids in a vLLM `KVCacheBlocks`, its null block as None (a
    sliding-window group's entries before its window)."""
    return [[None if block.is_null else int(block.block_id) for block in group] for group in blocks.blocks]


def _request_block_ids(manager: Any, request_id: str) -> list[list[int | None]]:
    try:
        return _group_block_ids(manager.get_blocks(request_id))
    except (KeyError, IndexError):
        return []
