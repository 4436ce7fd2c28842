"""A stand-in for vLLM's engine core and model runner, around vLLM's own scheduler.

Why: a KV connector's contract is with what vLLM hands it, so everything but the model's
arithmetic is vLLM's own code.  `StandInEngine` builds a model config (a config.json, no
weights), the per-layer KV cache specs the model's attention layers would declare (GQA, MLA,
sliding window, fp8), the layout the engine core resolves for the attention backend in use
(and the connector's request, if any), the KV cache config vLLM plans, the caches vLLM
allocates (views over one int8 buffer, possibly split into kernel blocks, KV-sharing layers
appended last), vLLM's `Scheduler` (synchronous or async), one worker connector per
tensor-parallel rank, and vLLM's `KVOutputAggregator` over the ranks.

`step()` plays one engine-core step in the hook order of the model runner chosen
(`hook_order`): vLLM's V1 runner, or Model Runner V2 (vLLM 0.33's default on GPU: preemptions
handed over first, ``finish_forward`` after the forward, the post-forward hooks only after
sampling); with draft layers (speculative decoding) the results are read before
``wait_for_save``, which runs after the drafter, as both runners do.  The forward runs layer by
layer in execution order (``wait_for_layer_load``, the layer's KV writes, ``save_kv_layer``
unless a full CUDA graph replays the forward).  On a `LaggingDevice` the KV writes are only
enqueued, and run later on a device thread, as kernels on a GPU do.

The bytes: P writes, token by token as prefill computes them, a pattern unique to (transfer,
block position, layer, KV shard) through vLLM's own per-layer views; D checks every page of a
loaded request, byte for byte, the first time it runs.  Used by the tests and by
`kvflow bench vllm` (through `runner`).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from kvflow.integrations.vllm.ranks import heads_of
from kvflow.layout.groups import KVGroup
from kvflow_tools.standin.build import (
    backend_class,
    distributed_worker,
    init_distributed,
    layer_specs,
    mamba_shape,
    vllm_config,
)
from kvflow_tools.standin.fabrics import fabric_of, named_fabric
from kvflow_tools.standin.kv import LaggingDevice, PagedKV, StatePages
from kvflow_tools.standin.model import EngineOptions
from kvflow_tools.standin.pacing import HookClock, HostLoad, Pacer, thread_times
from kvflow_tools.standin.releases import runner_output

__all__ = ("SAMPLED", "Rank", "StandInEngine")

SAMPLED = 7  # the token the stand-in model always samples (never EOS)


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
class _Work:
    """What one step's forward does, the same on every rank."""

    req_ids: list[str] = field(default_factory=list)
    sampled: list[list[int]] = field(default_factory=list)
    # KV cache group, tag, position, block, first token, stop token
    writes: list[tuple[int, str, int, int, int, int]] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)  # P requests whose prompt this step finished


class StandInEngine:
    """vLLM's Scheduler and one worker connector per tensor-parallel rank, stepped like
    vLLM's engine core.  `emit` receives timestamped events (for the benchmark)."""

    def __init__(self, options: EngineOptions, emit: Callable[..., None] | None = None) -> None:
        from vllm.config import set_current_vllm_config

        self.options = options
        self.shape = options.model
        self.emit = emit or (lambda **_: None)
        self.config = vllm_config(options)
        self.steps = 0
        self.step_ms = 0.0
        self.spin = False  # step even with nothing scheduled (an engine core busy with other requests)
        self.pacer: Pacer | None = None  # paced by a step-time model (`kvflow bench pd`); else by step_ms
        self.host: HostLoad | None = None  # the host engine's own work in each step (`kvflow bench host`)
        self.host_python = 0.0  # seconds the step's host work (`host`) took, interpreter held
        self.slept = 0.0  # the step's time spent waiting for its pace, not working
        self.forward_ended = 0.0  # when the step's last layer was computed, before its KV was handed on
        self.step_starts: deque[float] = deque(maxlen=200_000)
        self.most_in_flight = 0
        self.tags: dict[str, str] = {}  # request id -> transfer tag (P writes it, D checks it)
        # request id -> its prompt, for requests whose pages are keyed by their tokens (as real
        # KV is: the same prefix has the same KV, whichever transfer wrote it or cached it)
        self.content: dict[str, tuple[int, ...]] = {}
        self.added: dict[str, float] = {}
        self.checked: dict[str, int] = {}  # D request id -> bad pages found at its first forward
        self.live: set[str] = set()
        self._in_flight: deque[tuple[Any, Any]] = deque()
        self.ranks: list[Rank] = []
        self.stats_listeners: list[Callable[[Any], None]] = []  # each SchedulerStats (`log_stats`)
        with set_current_vllm_config(self.config):
            self._build()

    # ---------------------------------------------------------------- building

    def layer_names(self) -> list[str]:
        """Every attention layer, in execution order (draft layers last)."""
        return self.shape.layer_names()

    def _build(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
        from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, resolve_kv_cache_block_sizes
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        o = self.options
        specs = layer_specs(self.config, o)
        self.backend = backend_class(o.backend)
        supported = [layout.name for layout in get_supported_kv_cache_layouts([self.backend])]
        self.layout = resolve_kv_cache_layout(self.config, [supported], specs.values())
        groups = get_global_kv_cache_groups(self.config, [specs])
        [kv_cache_config] = get_kv_cache_configs(self.config, [specs], [1 << 40], groups)
        kv_cache_config.kv_cache_layout = self.layout.name
        self.kv_cache_config = kv_cache_config
        scheduler_class = AsyncScheduler if o.async_scheduling else Scheduler
        scheduler_config = generate_scheduler_kv_cache_config([kv_cache_config])
        block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_config, self.config)  # the engine core's
        self.scheduler = scheduler_class(
            vllm_config=self.config,
            kv_cache_config=scheduler_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=o.log_stats,
        )
        self.block_hasher = self._block_hasher(hash_block_size)
        self.owners = [n for n in self.layer_names() if n in specs]  # layers with KV of their own
        group_of = {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names}
        self.owner_group = [group_of[name] for name in self.owners]  # each owner's KV cache group
        # the KV cache groups of Mamba state; each owner's page index among its kind's
        self.state_groups = {
            g for g, gr in enumerate(kv_cache_config.kv_cache_groups) if hasattr(gr.kv_cache_spec, "shapes")
        }
        kinds = [group in self.state_groups for group in self.owner_group]
        self.page_index = [kinds[:owner].count(kind) for owner, kind in enumerate(kinds)]
        try:
            for rank in range(o.tensor_parallel):
                self.ranks.append(self._rank(rank))
        except BaseException:
            self.close()
            raise
        finally:
            self.config.parallel_config.rank = 0
        self.aggregator = KVOutputAggregator(expected_finished_count=o.tensor_parallel)
        self._watch_request_finished()

    def _block_hasher(self, block_size: int) -> Any:
        """The request block hasher vLLM's engine core gives every request (prefix caching
        finds hits by these hashes)."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        return get_request_block_hasher(block_size, hash_fn)

    def _rank(self, rank: int) -> Rank:
        """One worker: its connector, made as vLLM's worker makes it, and KV caches allocated
        and registered as vLLM's GPU model runner does."""
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
                assert self.scheduler.connector is not None
                self.scheduler.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): handshake})
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

    def _watch_request_finished(self) -> None:
        """Timestamp the scheduler connector's request_finished (behaviour unchanged)."""
        connector = self.scheduler.connector
        for name in ("request_finished", "request_finished_all_groups"):
            original = getattr(connector, name, None)
            if original is None:
                continue

            def timed(request: Any, *args: Any, _original: Any = original) -> Any:
                self.emit(ev="request_finished", id=request.request_id, t=time.perf_counter())
                return _original(request, *args)

            setattr(connector, name, timed)

    # ---------------------------------------------------------------- requests

    @property
    def connector(self) -> Any:
        """The scheduler-role connector vLLM's Scheduler made."""
        return self.scheduler.connector

    @property
    def worker(self) -> Any:
        """Rank 0's worker connector."""
        return self.ranks[0].worker

    def add(
        self,
        request_id: str,
        prompt_len: int,
        max_tokens: int,
        params: dict[str, Any],
        tag: str = "",
        prompt: Sequence[int] | None = None,
    ) -> Any:
        """A request of `prompt_len` tokens; with `prompt` (its tokens), its pages are keyed by
        their tokens instead of by `tag`, so that a prefix-cache hit holds the right KV."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sampling.extra_args = {"kv_transfer_params": params}
        tokens = list(prompt) if prompt is not None else list(range(3, 3 + prompt_len))
        if len(tokens) != prompt_len:
            raise ValueError(f"prompt has {len(tokens)} tokens, not {prompt_len}")
        if prompt is not None:
            self.content[request_id] = tuple(tokens)
        request = Request(request_id, tokens, sampling, None, block_hasher=self.block_hasher)
        self.scheduler.add_request(request)
        self.tags[request_id] = tag or request_id
        self.added[request_id] = time.perf_counter()
        self.live.add(request_id)
        return request

    def busy(self) -> bool:
        """The engine core keeps stepping while it has requests or outputs to read."""
        return bool(self.scheduler.has_requests() or self._in_flight)

    def idle(self) -> bool:
        return not self.busy()

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def _state_block(self, request_id: str, group: int, tokens: int | None = None) -> int:
        """The running-state block of a Mamba group's table (vLLM's: before the scratch blocks);
        with `tokens`, the block holding the state after that many ("align" mode keeps a state
        per block: the one a step starts from is not the one it writes)."""
        spec = self.kv_cache_config.kv_cache_groups[group].kv_cache_spec
        table = self.block_ids(request_id, group)
        if tokens is not None and getattr(spec, "mamba_cache_mode", "") == "align":
            table = table[: -(-tokens // spec.block_size)]
        scratch = int(getattr(spec, "num_speculative_blocks", 0))
        block = KVGroup((0, 1), state=True, scratch=scratch).state_block(table)
        assert block is not None, f"{request_id}: no running-state block in group {group}"
        return block

    def block_ids(self, request_id: str, group: int = 0) -> list[int | None]:
        """The request's blocks in KV cache group `group`, vLLM's null block as None (a sliding
        window's blocks before the window)."""
        blocks = self.scheduler.kv_cache_manager.get_blocks(request_id).blocks[group]
        return [None if block.is_null else int(block.block_id) for block in blocks]

    def page_tag(self, request_id: str, position: int, end: int | None = None) -> str:
        """What the KV of the request's block `position` is keyed by (its Mamba state after `end`
        tokens: position -1): its transfer tag, or (for a request added with its prompt) the
        tokens up to the block's end."""
        tokens = self.content.get(request_id)
        if tokens is None:
            return self.tags.get(request_id, request_id)
        end = min((position + 1) * self.ranks[0].pages.block_size if end is None else end, len(tokens))
        return "kv-" + hashlib.blake2b(repr(tokens[:end]).encode(), digest_size=8).hexdigest()

    def count_bad(self, request_id: str, tokens: int) -> int:
        """Pages of this request's first `tokens` tokens, on every rank, that do not hold the
        KV P computed for them: every KV cache group's blocks (a sliding window's within it)."""
        bad, size = 0, self.ranks[0].pages.block_size
        for group in range(len(self.kv_cache_config.kv_cache_groups)):
            layers = [self.page_index[owner] for owner, mine in enumerate(self.owner_group) if mine == group]
            if group in self.state_groups:  # the running state, after the tokens D holds
                state, tag = self._state_block(request_id, group, tokens), self.page_tag(request_id, -1, tokens)
                bad += sum(r.states.count_bad(tag, tokens, state, layers) for r in self.ranks if r.states)
                continue
            by_tag: dict[str, list[tuple[int, int]]] = {}
            for position, block in enumerate(self.block_ids(request_id, group)[: -(-tokens // size)]):
                if block is not None:  # None: freed, out of the window, never read
                    by_tag.setdefault(self.page_tag(request_id, position), []).append((position, block))
            for tag, pages in by_tag.items():
                positions, ids = [position for position, _ in pages], [block for _, block in pages]
                bad += sum(rank.pages.count_bad(tag, positions, ids, tokens, layers) for rank in self.ranks)
        return bad

    # ---------------------------------------------------------------- stepping

    def step(self) -> None:
        """One engine-core step.  With async scheduling, as vLLM's ``step_with_batch_queue``
        with two batches: schedule and run the next batch, and read the older batch's output
        only once two are in flight (or nothing more can be scheduled)."""
        if not self.options.async_scheduling:
            so = self.scheduler.schedule()
            self._update(so, self._execute(so))
            return
        if self.scheduler.has_requests() or self.spin:
            so = self.scheduler.schedule()
            self._in_flight.appendleft((so, self._execute(so)))
            self.most_in_flight = max(self.most_in_flight, len(self._in_flight))
            if len(self._in_flight) < 2:
                return
        if self._in_flight:
            so, output = self._in_flight.pop()
            self._update(so, output)

    def _update(self, so: Any, output: Any) -> None:
        for outputs in self.scheduler.update_from_output(so, output).values():
            if outputs.scheduler_stats is not None:
                for listener in self.stats_listeners:  # as the API process's stat loggers
                    listener(outputs.scheduler_stats)
            for out in outputs.outputs:
                if out.finish_reason is not None:
                    self.emit(ev="params", id=out.request_id, params=out.kv_transfer_params, t=time.perf_counter())
        for request_id in [r for r in self.live if r not in self.scheduler.requests]:
            self.live.discard(request_id)
            self.emit(ev="gone", id=request_id, t=time.perf_counter())

    def _execute(self, so: Any) -> Any:
        """Every rank runs the batch; vLLM's aggregator combines their connector outputs."""
        from vllm.v1.outputs import ModelRunnerOutput

        started = time.perf_counter()
        self.steps += 1
        self.step_starts.append(started)
        clock = thread_times() if self.host is not None else None
        work = self._plan(so)
        self.host_python = 0.0
        if self.pacer is not None:
            self.step_ms, self.slept = self.pacer.plan(so, self.scheduler), 0.0
            for new in so.scheduled_new_reqs:
                self.emit(ev="scheduled", id=new.req_id, t=started)
        outputs = []
        for rank in self.ranks:  # one after the other here; in parallel in vLLM
            if rank.worker is None:  # no connector: the forward alone
                connector_output = None
                self._forward(rank, work, range(len(self.layer_names())), started)
            else:
                connector_output = self._run_hooks(rank, so, work, started)
            outputs.append(
                runner_output(
                    ModelRunnerOutput,
                    req_ids=work.req_ids,
                    sampled_token_ids=work.sampled,
                    kv_connector_output=connector_output,
                )
            )
        output = self.aggregator.aggregate(outputs)
        assert output is not None
        busy = self.host.finish(clock) if self.host is not None and clock is not None else None
        now = time.perf_counter()
        if busy is not None:
            self.emit(ev="hstep", t=started, dur=now - started, py=self.host_python, **busy)
        spent, by_name, cpu = self.ranks[0].hooks.take()  # rank 0's time inside connector hooks
        # with the step's scheduled tokens (a prefill step on P: any) and its length, paced sleep included
        self.emit(ev="hooks", s=spent, by=by_name, cpu=cpu, tokens=so.total_num_scheduled_tokens, dur=now - started)
        for request_id in work.completed:  # made when the forward ended: a push may land before the step ends
            self.emit(ev="computed", id=request_id, t=self.forward_ended, started=started)
        if self.pacer is not None:
            real_ms = (now - started - self.slept) * 1e3
            self.emit(ev="step", t=started, **self.pacer.report(self.scheduler, self.step_ms, real_ms))
            for request_id in self.pacer.firsts:  # the step sampled these requests' first tokens
                self.emit(ev="first", id=request_id, t=now)
        kv = output.kv_connector_output
        if kv is not None:
            for request_id in kv.finished_recving or ():
                since = self.added.get(request_id, started)
                failed = request_id in (kv.failed_recving or ())
                self.emit(ev="recving", id=request_id, t=now, failed=failed, step_starts=self._starts_since(since))
            for request_id in kv.finished_sending or ():
                starts = self._starts_since(self.added.get(request_id, started))
                self.emit(ev="sending", id=request_id, t=now, step_starts=starts)
        return output

    def _starts_since(self, since: float) -> list[float]:
        """The starts of the steps begun at or after `since`, oldest first: walked back from the
        newest (starts only grow), not across every step the engine has kept."""
        starts = list(itertools.takewhile(lambda start: start >= since, reversed(self.step_starts)))
        starts.reverse()
        return starts

    def _plan(self, so: Any) -> _Work:
        """The step's prompt tokens P computes (and so writes), the loaded requests D reads for
        the first time (checked now, before the step's hooks), the tokens sampled."""
        work = _Work()
        size = self.ranks[0].pages.block_size
        # an engine without a connector computes its prompts' KV itself, whatever its role
        producer = self.options.role == "kv_producer" or not self.options.connector
        verify = self.options.verify_pages
        for request_id, count in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            computed = request.num_computed_tokens - count  # schedule() has already advanced it
            prompt = request.num_prompt_tokens
            if producer and computed < prompt:
                stop = min(computed + count, prompt)
                for group in range(len(self.kv_cache_config.kv_cache_groups)) if verify else ():
                    if group in self.state_groups:  # the state after this step's tokens
                        state = self._state_block(request_id, group)
                        work.writes.append((group, self.page_tag(request_id, -1, stop), -1, state, 0, stop))
                        continue
                    blocks = self.block_ids(request_id, group)
                    for position in range(computed // size, (stop - 1) // size + 1):
                        first = max(computed, position * size) - position * size
                        last = min(stop, (position + 1) * size) - position * size
                        block = blocks[position]
                        assert block is not None, f"{request_id}: no block at position {position} of group {group}"
                        tag = self.page_tag(request_id, position)
                        work.writes.append((group, tag, position, block, first, last))
                if stop == prompt:
                    work.completed.append(request_id)
            elif verify and not producer and request_id not in self.checked and computed > 0:
                # the KV D reads and does not compute: loaded, or its prefix cache's (vLLM
                # recomputes the prompt's last token)
                bad = self.count_bad(request_id, computed)
                self.checked[request_id] = bad
                pages = -(-prompt // size) * len(self.owners) * len(self.ranks)
                self.emit(ev="checked", id=request_id, pages=pages, bad=bad, page_bytes=self.ranks[0].pages.page_bytes)
            work.req_ids.append(request_id)
            work.sampled.append([SAMPLED] if computed + count >= prompt else [])
        return work

    def _run_hooks(self, rank: Rank, so: Any, work: _Work, started: float) -> Any:
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
            self._forward(rank, work, range(self.shape.attention_layers), started)
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
                self._forward(rank, work, range(self.shape.attention_layers, len(self.layer_names())), started)
                worker.wait_for_save()
            worker.clear_connector_metadata()
        return output

    def _forward(self, rank: Rank, work: _Work, layers: range, started: float) -> None:
        """Layer by layer, as attention layers do: ``wait_for_layer_load``, the layer's KV
        writes (enqueued on a lagging device), ``save_kv_layer`` (not under a full CUDA graph).
        A step of `step_ms` ends no sooner than `step_ms` after it started."""
        names, shared, hooks = self.layer_names(), dict(self.shape.shared), rank.worker is not None
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

    # ---------------------------------------------------------------- inspection

    def kvflow_engines(self) -> Iterator[Any]:
        """The kvflow engine of every rank (kvflow's connector only)."""
        for rank in self.ranks:
            engine = getattr(rank.worker, "kvflow_engine", None)  # another connector has none
            if engine is not None:
                yield engine

    def describe(self) -> str:
        """What this engine is waiting on, for a test that timed out."""
        requests = [(r, q.status.name) for r, q in self.scheduler.requests.items()]
        lines = [f"{self.options.name}: requests {requests}, in flight {len(self._in_flight)}"]
        if self.connector is not None:
            lines.append(f"  pending push work {self.connector.has_pending_push_work()}")
        for rank in self.ranks:
            describe = getattr(rank.worker, "describe_engine", None)  # kvflow's connector only
            if describe is not None:
                lines.append(f"  {describe()}")
        return "\n".join(lines)

    def close(self) -> None:
        for rank in self.ranks:
            if rank.worker is not None:
                rank.worker.shutdown()
            if rank.device is not None:
                rank.device.close()
