"""vLLM's real Scheduler with a KV connector, and a stand-in for the model runner.

Why: the connector's contract is with vLLM's scheduler and worker hooks, in vLLM's call order.
`VllmEngine` builds a real `Scheduler` (which loads the scheduler-role connector itself, by
``kv_connector_module_path``), a worker-role connector, and KV caches as CPU tensors registered
through the worker connector, one per tensor-parallel rank.  `step()` plays one model-runner
step on every rank the way vLLM's `_get_kv_connector_output` does: bind metadata, a per-layer
"forward" (which writes a known pattern, per rank, into the KV of every prefill token it
computes, calling ``save_kv_layer``), ``start_load_kv``, ``wait_for_save``,
``get_transfer_results``, ``get_block_ids_with_load_errors``, clear metadata; the ranks' outputs
are combined by vLLM's own `KVOutputAggregator`, as its executors do, and passed to
``update_from_output`` with the sampled tokens.

The model is a config.json only (no weights, nothing fetched): vLLM needs a model config, not a
model, to schedule.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import deque
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 32
HEADS, HEAD_DIM = 4, 64
LAYERS = ["model.decoder.layers.0.self_attn.attn", "model.decoder.layers.1.self_attn.attn"]
TOKEN = 7  # what the stand-in model always samples (never EOS)
_MODEL_DIR: str | None = None


def model_dir() -> str:
    """A directory holding only a tiny OPT config.json."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        _MODEL_DIR = tempfile.mkdtemp(prefix="kvflow-opt-")
        config = {
            "architectures": ["OPTForCausalLM"],
            "model_type": "opt",
            "hidden_size": HEADS * HEAD_DIM,
            "num_attention_heads": HEADS,
            "num_hidden_layers": len(LAYERS),
            "ffn_dim": 512,
            "vocab_size": 1000,
            "max_position_embeddings": 4096,
            "word_embed_proj_dim": HEADS * HEAD_DIM,
            "torch_dtype": "float16",
            "do_layer_norm_before": True,
            "eos_token_id": 2,
        }
        with open(os.path.join(_MODEL_DIR, "config.json"), "w") as f:
            json.dump(config, f)
    return _MODEL_DIR


def page_elements() -> int:
    return 2 * BLOCK_SIZE * HEADS * HEAD_DIM


def pattern(transfer: str, position: int, layer: int, rank: int = 0) -> torch.Tensor:
    """The KV bytes prefill writes for one block: recognisable per transfer, position, layer and
    tensor-parallel rank (each rank holds its own shard of the heads)."""
    seed = (hash((transfer, position, layer, rank)) & 0xFFFF) + 1
    return (torch.arange(page_elements(), dtype=torch.int32) * seed % 997).to(torch.float16)


@dataclass
class Rank:
    """One tensor-parallel worker: its connector and its KV caches."""

    worker: KVConnectorBase_V1
    kv: dict[str, torch.Tensor]


@dataclass
class VllmEngine:
    name: str
    scheduler: Scheduler
    ranks: list[Rank]
    transfers: dict[str, str] = field(default_factory=dict)  # request id -> transfer id (P: patterns)
    steps: int = 0
    layerwise: bool = True  # the forward calls save_kv_layer after each layer
    async_scheduling: bool = False  # vLLM 0.33's default: step N+1 is scheduled before N's output is read
    most_in_flight: int = 0  # batches scheduled and not yet read back, at most

    def __post_init__(self) -> None:
        self.aggregator = KVOutputAggregator(expected_finished_count=len(self.ranks))
        self._in_flight: deque[tuple[Any, ModelRunnerOutput]] = deque()

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    @property
    def worker(self) -> KVConnectorBase_V1:
        """Rank 0's worker connector."""
        return self.ranks[0].worker

    @property
    def kv(self) -> dict[str, torch.Tensor]:
        return self.ranks[0].kv

    def add(self, request_id: str, prompt_len: int, max_tokens: int, params: dict[str, Any]) -> Request:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sampling.extra_args = {"kv_transfer_params": params}
        request = Request(request_id, list(range(3, 3 + prompt_len)), sampling, None)
        self.scheduler.add_request(request)
        return request

    def step(self) -> None:
        """One engine-core step.  With async scheduling, as vLLM's `step_with_batch_queue` with
        two batches: schedule and run the next batch, and read the older batch's output only
        once two are in flight (or nothing more can be scheduled)."""
        if not self.async_scheduling:
            so = self.scheduler.schedule()
            self.scheduler.update_from_output(so, self._execute(so))
            return
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            self._in_flight.appendleft((so, self._execute(so)))
            self.most_in_flight = max(self.most_in_flight, len(self._in_flight))
            if len(self._in_flight) < 2:
                return
        if self._in_flight:
            so, output = self._in_flight.pop()
            self.scheduler.update_from_output(so, output)

    def busy(self) -> bool:
        """EngineCore keeps stepping while it has requests or outputs to read."""
        return self.scheduler.has_requests() or bool(self._in_flight)

    def _execute(self, so: Any) -> ModelRunnerOutput:
        """Every rank runs the batch; vLLM's aggregator combines their connector outputs."""
        self.steps += 1
        assert so.kv_connector_metadata is not None  # a connector is configured
        outputs: list[ModelRunnerOutput | None] = []
        for rank, shard in enumerate(self.ranks):  # one after the other here; in parallel in vLLM
            worker = shard.worker
            worker.bind_connector_metadata(so.kv_connector_metadata)
            req_ids, sampled = self._forward(so, rank)
            worker.start_load_kv(None)  # type: ignore[arg-type]  # the forward context is unused here
            worker.wait_for_save()  # type: ignore[no-untyped-call]
            results = worker.get_transfer_results(so.finished_req_ids)
            errors = worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=sampled,
                    kv_connector_output=KVConnectorOutput(
                        finished_sending=results.finished_sending,
                        finished_recving=results.finished_recving,
                        failed_recving=results.failed_recving,
                        invalid_block_ids=errors,
                    ),
                )
            )
        output = self.aggregator.aggregate(outputs)
        assert output is not None
        return output

    def _forward(self, so: Any, rank: int) -> tuple[list[str], list[list[int]]]:
        """Layer by layer, as attention layers do (``wait_for_layer_load``, compute, and, when
        `layerwise`, ``save_kv_layer``): write the pattern into the KV of every prompt token
        computed this step; sample a token for every request that reaches the end of its prompt."""
        req_ids, sampled = [], []
        writes: list[tuple[str, list[int], list[int]]] = []
        for req_id, count in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            computed = request.num_computed_tokens - count  # schedule() has already advanced it
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            transfer = self.transfers.get(req_id)
            if transfer is not None:
                first, last = computed // BLOCK_SIZE, (computed + count - 1) // BLOCK_SIZE
                positions = list(range(first, min(last + 1, len(block_ids))))
                writes.append((transfer, positions, [block_ids[p] for p in positions]))
            req_ids.append(req_id)
            sampled.append([TOKEN] if computed + count >= request.num_prompt_tokens else [])
        worker, kv = self.ranks[rank].worker, self.ranks[rank].kv
        for layer, name in enumerate(LAYERS):
            worker.wait_for_layer_load(name)
            for transfer, positions, blocks in writes:
                for position, block in zip(positions, blocks, strict=True):
                    kv[name][block] = pattern(transfer, position, layer, rank)
            if self.layerwise:
                worker.save_kv_layer(name, kv[name], None)  # type: ignore[arg-type]  # no attention
        return req_ids, sampled

    def blocks_hold(self, request_id: str, transfer: str, num_blocks: int) -> bool:
        """Every rank's blocks of the request hold that rank's pattern."""
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)[0]
        return all(
            torch.equal(shard.kv[name][block_ids[position]], pattern(transfer, position, layer, rank))
            for rank, shard in enumerate(self.ranks)
            for position in range(num_blocks)
            for layer, name in enumerate(LAYERS)
        )

    def describe(self) -> str:
        """What this engine is waiting on, for a test that timed out."""
        lines = [f"{self.name}: requests {[(r, q.status.name) for r, q in self.scheduler.requests.items()]}"]
        lines.append(f"  pending push work {self.connector.has_pending_push_work()}, in flight {len(self._in_flight)}")
        for rank, shard in enumerate(self.ranks):
            side = getattr(shard.worker, "_worker", None)
            thread = getattr(side, "thread", None)
            if thread is None:
                continue
            engine = thread.engine
            live = [(m.key.transfer_id, m.role.value, m.state.name) for m in engine.core.live()]
            stats = {k: v for k, v in engine.stats().items() if v}
            lines.append(f"  rank {rank}: live {live}, stats {stats}, crashed {engine.crashed}")
        return "\n".join(lines)

    def idle(self) -> bool:
        return not self.busy()

    def close(self) -> None:
        for shard in self.ranks:
            shard.worker.shutdown()  # type: ignore[no-untyped-call]


def make_engine(
    name: str,
    role: str,
    extra: dict[str, Any],
    *,
    num_blocks: int = 64,
    failure_policy: str = "fail",
    connector: str = "KVFlowConnector",
    module_path: str | None = "kvflow.integrations.vllm",
    tensor_parallel: int = 1,
    prefix_caching: bool = False,
    async_scheduling: bool = False,
) -> VllmEngine:
    """A vLLM scheduler plus one worker connector per tensor-parallel rank, as a P
    ("kv_producer") or D ("kv_consumer")."""
    model = ModelConfig(model=model_dir(), skip_tokenizer_init=True, dtype="float16", max_model_len=4096, seed=0)
    scheduler_config = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=4096,
        max_model_len=4096,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    transfer = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module_path,
        kv_role=role,  # type: ignore[arg-type]
        engine_id=name,
        kv_connector_extra_config=extra,
        kv_load_failure_policy=failure_policy,  # type: ignore[arg-type]
    )
    config = VllmConfig(
        model_config=model,
        scheduler_config=scheduler_config,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16)
    page = spec.page_size_bytes
    tensors = [KVCacheTensor(size=page * num_blocks, layers=[n], layer_stride=0, block_stride=page) for n in LAYERS]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)]
    )
    scheduler = (AsyncScheduler if async_scheduling else Scheduler)(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
    )
    ranks = []
    for rank in range(tensor_parallel):
        config.parallel_config.rank = rank  # what a worker process of that rank has
        worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
        kv = {n: torch.zeros((num_blocks, page_elements()), dtype=torch.float16) for n in LAYERS}
        worker.register_kv_caches(kv)
        ranks.append(Rank(worker, kv))
    config.parallel_config.rank = 0
    return VllmEngine(name, scheduler, ranks, async_scheduling=async_scheduling)


def is_finished(request: Request) -> bool:
    return request.status >= RequestStatus.FINISHED_STOPPED
