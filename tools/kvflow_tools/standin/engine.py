"""A stand-in for vLLM's engine core, around vLLM's own scheduler.

Why: a KV connector's contract is with what vLLM hands it, so everything but the model's
arithmetic is vLLM's own code.  `StandInEngine` builds a model config (a config.json, no
weights), the per-layer KV cache specs the model's attention layers would declare (GQA, MLA,
sliding window, fp8), the layout the engine core resolves for the attention backend in use
(and the connector's request, if any), the KV cache config vLLM plans, vLLM's `Scheduler`
(synchronous or async), one `Rank` per tensor-parallel rank (its worker connector and the caches
vLLM allocates, made by `model_runner`), and vLLM's `KVOutputAggregator` over the ranks.

`step()` plays one engine-core step: it schedules, plans what the step's forward does (the KV
prefill writes, the loaded pages D checks, the tokens sampled), has the model runner run it on
every rank between the connector's hooks, in the hook order of the runner chosen
(`hook_order`: vLLM's V1 runner or Model Runner V2), and hands the aggregated output back to
the scheduler; with async scheduling, two batches in flight.

The bytes: P writes, token by token as prefill computes them, a pattern unique to (transfer,
block position, layer, KV shard) through vLLM's own per-layer views; D checks every page of a
loaded request, byte for byte, the first time it runs.  Used by the tests and by
`kvflow bench vllm` (through `runner`).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvflow.layout.groups import KVGroup
from kvflow_tools.standin.build import backend_class, layer_specs, vllm_config
from kvflow_tools.standin.model import EngineOptions
from kvflow_tools.standin.model_runner import ModelRunner, Rank, Work
from kvflow_tools.standin.pacing import HostLoad, Pacer, thread_times
from kvflow_tools.standin.releases import runner_output

__all__ = ("SAMPLED", "StandInEngine")

SAMPLED = 7  # the token the stand-in model always samples (never EOS)


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
        self.spin = False  # step even with nothing scheduled (an engine core busy with other requests)
        self.pacer: Pacer | None = None  # paced by a step-time model (`kvflow bench pd`); else by step_ms
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
        self.runner = ModelRunner(
            o,
            self.config,
            kv_cache_config,
            self.backend,
            self.layout,
            self.owners,
            self.owner_group,
            self.state_groups,
            self.page_index,
        )
        try:
            for rank in range(o.tensor_parallel):
                self.ranks.append(self.runner.rank(rank, self.scheduler.connector))
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

    @property
    def step_ms(self) -> float:
        """The step's length in milliseconds: its forward ends no sooner (0: as fast as it runs)."""
        return self.runner.step_ms

    @step_ms.setter
    def step_ms(self, ms: float) -> None:
        self.runner.step_ms = ms

    @property
    def host(self) -> HostLoad | None:
        """The host engine's own work in each step (`kvflow bench host`), the forward's included."""
        return self.runner.host

    @host.setter
    def host(self, load: HostLoad | None) -> None:
        self.runner.host = load

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
        self.runner.host_python = 0.0
        if self.pacer is not None:
            self.step_ms, self.runner.slept = self.pacer.plan(so, self.scheduler), 0.0
            for new in so.scheduled_new_reqs:
                self.emit(ev="scheduled", id=new.req_id, t=started)
        outputs = []
        for rank in self.ranks:  # one after the other here; in parallel in vLLM
            if rank.worker is None:  # no connector: the forward alone
                connector_output = None
                self.runner.forward(rank, work, range(len(self.layer_names())), started)
            else:
                connector_output = self.runner.run_hooks(rank, so, work, started)
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
            self.emit(ev="hstep", t=started, dur=now - started, py=self.runner.host_python, **busy)
        spent, by_name, cpu = self.ranks[0].hooks.take()  # rank 0's time inside connector hooks
        # with the step's scheduled tokens (a prefill step on P: any) and its length, paced sleep included
        self.emit(ev="hooks", s=spent, by=by_name, cpu=cpu, tokens=so.total_num_scheduled_tokens, dur=now - started)
        for request_id in work.completed:  # made when the forward ended: a push may land before the step ends
            self.emit(ev="computed", id=request_id, t=self.runner.forward_ended, started=started)
        if self.pacer is not None:
            real_ms = (now - started - self.runner.slept) * 1e3
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

    def _plan(self, so: Any) -> Work:
        """The step's prompt tokens P computes (and so writes), the loaded requests D reads for
        the first time (checked now, before the step's hooks), the tokens sampled."""
        work = Work()
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
