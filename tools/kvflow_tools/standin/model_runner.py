"""The stand-in's model runner: each rank's connector and KV caches, and its forward between hooks.

Why apart: vLLM draws the same line between its engine core and its workers.  The engine core
(`engine`: the scheduler, the requests, the aggregator, the step and its events) decides what a
step's forward does, as a `Work`; the model runner makes each rank's connector as vLLM's worker
makes it, allocates and registers its KV caches as vLLM's GPU model runner does (views over one
int8 buffer, possibly split into kernel blocks, KV-sharing layers appended last), and runs the
work.  The engine core asks it for a `Rank`, to run a step on one, and reads back what the
forward measured (`slept`, `host_python`, `forward_ended`).

The hooks run in the order of the runner chosen (`hook_order`): vLLM's V1 runner, or Model
Runner V2 (vLLM 0.33's default on GPU: preemptions handed over first, ``finish_forward`` after
the forward, the post-forward hooks only after sampling); with draft layers (speculative
decoding) the results are read before ``wait_for_save``, which runs after the drafter, as both
runners do.  The forward runs layer by layer in execution order (``wait_for_layer_load``, the
layer's KV writes, ``save_kv_layer`` unless a full CUDA graph replays the forward), paced to the
step's length.  On a `LaggingDevice` the KV writes are only enqueued, and run later on a device
thread, as kernels on a GPU do.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from kvflow.integrations.vllm.ranks import heads_of
from kvflow_tools.standin.build import distributed_worker, init_distributed, mamba_shape
from kvflow_tools.standin.fabrics import fabric_of, named_fabric
from kvflow_tools.standin.kv import LaggingDevice, PagedKV, StatePages
from kvflow_tools.standin.model import EngineOptions
from kvflow_tools.standin.pacing import HookClock, HostLoad

__all__ = ("ModelRunner", "Rank", "Work")


@dataclass
class Rank:
    """One tensor-parallel worker: its connector, its KV caches and its pages."""

    worker: Any
    kv_caches: dict[str, torch.Tensor]
    pages: PagedKV  # the attention layers'
    device: LaggingDevice | None
    states: StatePages | None = None  # the Mamba layers', if the model has any

    def __post_init__(self) -> None:
        self.hooks = HookClock(self.worker)  # how the model runner calls the connector


@dataclass
class Work:
    """What one step's forward does, the same on every rank."""

    req_ids: list[str] = field(default_factory=list)
    sampled: list[list[int]] = field(default_factory=list)
    # KV cache group, tag, position, block, first token, stop token
    writes: list[tuple[int, str, int, int, int, int]] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)  # P requests whose prompt this step finished


class ModelRunner:
    """The model runner of every rank (one rank after the other here; in parallel in vLLM): its
    caches and connector made, and each step's forward and connector hooks, paced."""

    def __init__(
        self,
        options: EngineOptions,
        config: Any,
        kv_cache_config: Any,
        backend: Any,
        layout: Any,
        owners: list[str],
        owner_group: list[int],
        state_groups: set[int],
        page_index: list[int],
    ) -> None:
        self.options = options
        self.shape = options.model
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.backend = backend
        self.layout = layout
        self.owners = owners  # layers with KV of their own, in execution order
        self.owner_group = owner_group  # each owner's KV cache group
        self.state_groups = state_groups  # the KV cache groups of Mamba state
        self.page_index = page_index  # each owner's page index among its kind's
        self.step_ms = 0.0  # the step's length: its forward ends no sooner (0: as fast as it runs)
        self.host: HostLoad | None = None  # the host engine's own work in each step (`kvflow bench host`)
        self.host_python = 0.0  # seconds the step's host work (`host`) took, interpreter held
        self.slept = 0.0  # the step's time spent waiting for its pace, not working
        self.forward_ended = 0.0  # when the step's last layer was computed, before its KV was handed on

    def rank(self, rank: int, scheduler_connector: Any) -> Rank:
        """One worker: its connector, made as vLLM's worker makes it, and KV caches allocated
        and registered as vLLM's GPU model runner does (a distributed worker's handshake handed
        to `scheduler_connector`, the Scheduler's)."""
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.worker.utils import allocate_kv_cache, prepare_kernel_block_sizes

        from kvflow.integrations.vllm.connector import KVFlowConnector

        o, config, kv_cache_config = self.options, self.config, self.kv_cache_config
        config.parallel_config.rank = rank  # what a worker process of that rank has
        worker: Any = None  # no connector: the engine alone
        if not o.connector:
            if o.distributed:  # the same set-up (and its threads) as with a connector
                init_distributed(o)
        elif o.distributed:
            worker = distributed_worker(config, kv_cache_config, o)
        else:
            worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
        attention_groups = [
            [SimpleNamespace(backend=self.backend, kv_cache_spec=group.kv_cache_spec)]
            for group in kv_cache_config.kv_cache_groups
        ]
        kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attention_groups)  # type: ignore[arg-type]
        place = torch.device("cpu")
        if o.kv_device == "cuda":
            place = torch.device("cuda", rank % torch.cuda.device_count())
        kv_caches = allocate_kv_cache(kv_cache_config, place, self.layout, kernel_block_sizes)
        for layer, target in self.shape.shared:  # appended last, as vLLM's init_kv_cache does
            kv_caches[self.shape.layer_name(layer)] = kv_caches[self.shape.layer_name(target)]
        device = None if o.device_lag is None else LaggingDevice(o.device_lag)
        fabric = fabric_of(o.extra)[1]
        if isinstance(worker, KVFlowConnector):  # what another connector would ignore
            worker.inject(device=device, transport=named_fabric(fabric).endpoint if fabric is not None else None)
        if worker is not None:
            worker.register_kv_caches(kv_caches)
        if worker is not None and o.distributed:
            handshake = worker.get_handshake_metadata()
            if handshake is not None:
                assert scheduler_connector is not None
                scheduler_connector.set_xfer_handshake_metadata_pp_aware({(0, 0): handshake})
        model = config.model_config  # MLA: every rank holds the same latent cache, one "head"
        total = 1 if model.use_mla else model.get_total_num_kv_heads()
        heads = heads_of(total, o.tensor_parallel, rank)
        block_size = self.config.cache_config.block_size
        attention, states = ([kv_caches[n] for g, n in zip(self.owner_group, self.owners, strict=True)
                              if (g in self.state_groups) is kind] for kind in (False, True))  # fmt: skip
        pages = PagedKV(attention, kv_cache_config.num_blocks, block_size, heads, total_heads=total)
        state_pages = None
        if states:
            mamba: Any = kv_cache_config.kv_cache_groups[min(self.state_groups)].kv_cache_spec
            shape = mamba_shape(o, int(mamba.dtypes[0].itemsize))
            state_pages = StatePages(states, kv_cache_config.num_blocks, shape, shard=rank, ranks=o.tensor_parallel)
        return Rank(worker, kv_caches, pages, device, state_pages)

    def run_hooks(self, rank: Rank, so: Any, work: Work, started: float) -> Any:
        """The connector hooks of one step on one rank, in the model runner's order."""
        from vllm.forward_context import get_forward_context, set_forward_context
        from vllm.v1.outputs import KVConnectorOutput

        worker, meta, v2 = rank.hooks, so.kv_connector_metadata, self.options.hook_order == "v2"
        assert meta is not None  # a connector is configured
        speculative = self.shape.draft_layers > 0
        if rank.device is not None:
            rank.device.host_threads.add(threading.get_ident())
        with set_forward_context(None, self.config):
            if v2:
                worker.handle_preemptions(meta)
            worker.bind_connector_metadata(meta)
            if so.has_sync_kv_loads:
                worker.start_load_kv(get_forward_context())
            self.forward(rank, work, range(self.shape.attention_layers), started)
            if v2:
                worker.finish_forward()  # then Model Runner V2 samples, before the post-forward hooks
            if not so.has_sync_kv_loads:
                worker.start_load_kv(get_forward_context())
            if not speculative:
                worker.wait_for_save()
            results = worker.get_transfer_results(so.finished_req_ids)
            output = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_stats=worker.get_kv_connector_stats(),
                kv_cache_events=worker.get_kv_connector_kv_cache_events(),
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            )
            if speculative:  # the drafter runs, then the deferred finalize
                self.forward(rank, work, range(self.shape.attention_layers, len(self.shape.layer_names())), started)
                worker.wait_for_save()
            worker.clear_connector_metadata()
        return output

    def forward(self, rank: Rank, work: Work, layers: range, started: float) -> None:
        """Layer by layer, as attention layers do: ``wait_for_layer_load``, the layer's KV
        writes (enqueued on a lagging device), ``save_kv_layer`` (not under a full CUDA graph).
        A step of `step_ms` ends no sooner than `step_ms` after it started."""
        names, shared, hooks = self.shape.layer_names(), dict(self.shape.shared), rank.worker is not None
        total = len(names)
        for layer in layers:
            name = names[layer]
            if self.host is not None:  # the forward's own Python for this layer (kernel launches)
                self.host_python += self.host.layer(total)
            if hooks:
                rank.hooks.wait_for_layer_load(name)
            if layer not in shared and work.writes:
                owner = self.owners.index(name)
                writes = [w[1:] for w in work.writes if w[0] == self.owner_group[owner]]
                if self.owner_group[owner] in self.state_groups and rank.states is not None:
                    kernel = rank.states.kernel(self.page_index[owner], writes)
                else:
                    kernel = rank.pages.kernel(self.page_index[owner], writes)
                if rank.device is not None:
                    rank.device.launch(kernel)
                else:
                    kernel()
            if self.step_ms > 0:
                layer_end = started + self.step_ms / 1000 * (layer + 1) / total
                pause = max(0.0, layer_end - time.perf_counter())
                self.slept += pause
                time.sleep(pause)
            self.forward_ended = time.perf_counter()
            if hooks and not self.options.full_cudagraph:
                rank.hooks.save_kv_layer(name, rank.kv_caches[name], None)
