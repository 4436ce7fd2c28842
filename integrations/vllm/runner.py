"""One vLLM engine with any KV connector and a stand-in model runner, driven over JSON lines.

Why: a fair comparison of KV connectors runs each one inside vLLM's real `Scheduler` and worker
hooks, called in vLLM's order, with the same stand-in for the model and the same clocks.  This
module is that engine.  It builds what vLLM's `EngineCore` and GPU worker would (a one-rank gloo
group, the worker connector through ``ensure_kv_transfer_initialized``, KV tensors from
``allocate_kv_cache``, the handshake-metadata hand-off), then steps like `EngineCore`: back to
back while the scheduler has requests (``has_pending_push_work`` included), each step running
the hooks as ``kv_connector_model_runner_mixin`` does.

The stand-in forward writes a recognisable page (header: transfer tag, block position, layer;
body: a ramp offset by them) into the KV of every prompt token P computes; D checks every page of
a loaded request, byte for byte, at its first forward.  Model weights are never needed: the
model is a config.json.

Run as ``python -m kvflow.integrations.vllm.runner``: the first stdin line is the `EngineSpec`,
later lines are commands (``add``, ``pace``, ``stop``); events go out on stdout, one JSON object
per line, timestamped with ``time.perf_counter`` (CLOCK_MONOTONIC, comparable across processes).
Everything else the process prints goes to stderr.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import sys
import tempfile
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import IO, Any

__all__ = ("EngineSpec", "PatternKV", "main")

MAGIC = 0x6B76666C6F770001  # "kvflow" + version: no stale or zeroed page can match


@dataclass(frozen=True)
class EngineSpec:
    """What one engine process runs."""

    name: str
    role: str  # "kv_producer" (P) | "kv_consumer" (D)
    connector: str  # vLLM connector class name
    module_path: str | None = None  # kv_connector_module_path for out-of-tree connectors
    engine_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config
    num_blocks: int = 640
    block_size: int = 32
    layers: int = 8
    kv_heads: int = 4
    head_size: int = 64
    max_model_len: int = 8192
    dist_port: int = 0  # the one-rank gloo group's TCP port
    keep_vllm_affinity: bool = False  # keep the CPU pinning vLLM's NIXL worker applies on CPU
    nixl_progress_delay_us: int | None = None  # NIXL progress-thread delay (stock: 0, busy poll)


class PatternKV:
    """The KV pages of every layer, and the known pattern written to and checked in them.

    A page is 64-bit words: a header (magic, transfer tag, block position, layer) and a body, a
    fixed random sequence per layer XORed with a key derived from the header.  A page of another
    request, position or layer, a zeroed page or a torn one cannot match.  Writing and checking
    are one vectorised pass each, so they stay a small part of a step.
    """

    HEADER_WORDS = 4

    def __init__(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        import numpy as np

        self.np = np
        self.pages = []
        for tensor in kv_caches.values():
            pages = tensor.view(-1).numpy().view(np.uint64).reshape(num_blocks, -1)
            if pages.ctypes.data != tensor.data_ptr():
                raise ValueError("KV cache views must be block-major")
            self.pages.append(pages)
        self.page_bytes = int(self.pages[0].shape[1]) * 8
        body = int(self.pages[0].shape[1]) - self.HEADER_WORDS
        rng = np.random.default_rng(1234)
        self._base = [rng.integers(0, 2**63, size=body, dtype=np.uint64) for _ in self.pages]

    def _header_and_keys(self, tag: str, positions: list[int], layer: int) -> tuple[Any, Any]:
        np = self.np
        code = zlib.crc32(tag.encode())
        header = np.array([[MAGIC, code, p, layer] for p in positions], dtype=np.uint64)
        keys = np.array([(code << 32) ^ (p << 8) ^ layer ^ 0x9E3779B97F4A7C15 for p in positions], dtype=np.uint64)
        return header, keys[:, None]

    def write(self, tag: str, positions: list[int], block_ids: list[int], layer: int | None = None) -> None:
        """Write the pattern of these positions into these blocks, in one layer or all."""
        for index, pages in enumerate(self.pages):
            if layer is not None and index != layer:
                continue
            header, keys = self._header_and_keys(tag, positions, index)
            pages[block_ids, : self.HEADER_WORDS] = header
            pages[block_ids, self.HEADER_WORDS :] = self._base[index][None, :] ^ keys

    def count_bad(self, tag: str, positions: list[int], block_ids: list[int]) -> int:
        """How many of these pages differ from the pattern (in any byte)."""
        bad = 0
        for layer, pages in enumerate(self.pages):
            header, keys = self._header_and_keys(tag, positions, layer)
            got = pages[block_ids]
            same = (got[:, : self.HEADER_WORDS] == header).all(axis=1)
            got_body = got[:, self.HEADER_WORDS :]
            got_body ^= keys
            same &= (got_body == self._base[layer][None, :]).all(axis=1)
            bad += int((~same).sum())
        return bad


def _model_dir(spec: EngineSpec) -> str:
    """A directory holding only an OPT-style config.json: vLLM schedules without weights.

    Its path depends only on the config, so P and D name the same model (NIXL's handshake
    compares the model's name among other things)."""
    hidden = spec.kv_heads * spec.head_size
    config = {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": hidden,
        "num_attention_heads": spec.kv_heads,
        "num_hidden_layers": spec.layers,
        "ffn_dim": 4 * hidden,
        "vocab_size": 1000,
        "max_position_embeddings": spec.max_model_len,
        "word_embed_proj_dim": hidden,
        "torch_dtype": "float16",
        "do_layer_norm_before": True,
        "eos_token_id": 2,
    }
    text = json.dumps(config, sort_keys=True)
    path = os.path.join(tempfile.gettempdir(), f"kvflow-model-{zlib.crc32(text.encode()):08x}")
    os.makedirs(path, exist_ok=True)
    staged = os.path.join(path, f".config.{os.getpid()}")
    with open(staged, "w") as f:
        f.write(text)
    os.replace(staged, os.path.join(path, "config.json"))
    return path


def _slow_nixl_progress_thread(delay_us: int) -> None:
    """Make NIXL agents created from now on sleep `delay_us` between progress polls (stock
    agents busy-poll a core).  Only the agent config's constructor is wrapped."""
    api = importlib.import_module("nixl._api")  # the module vLLM's NIXL connectors use
    base = api.nixlBind.nixlAgentConfig

    class DelayedProgress(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, delay_us if name == "pthrDelay" else value)

    api.nixlBind.nixlAgentConfig = DelayedProgress


class Engine:
    """vLLM's Scheduler and one worker connector, stepped like EngineCore."""

    def __init__(self, spec: EngineSpec, emit: Callable[..., None]) -> None:
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
            set_current_vllm_config,
        )

        self.spec = spec
        self.emit = emit
        torch.set_num_threads(1)
        if spec.nixl_progress_delay_us is not None:
            _slow_nixl_progress_thread(spec.nixl_progress_delay_us)
        model = ModelConfig(
            model=_model_dir(spec), skip_tokenizer_init=True, dtype="float16", max_model_len=spec.max_model_len, seed=0
        )
        transfer = KVTransferConfig(
            kv_connector=spec.connector,
            kv_connector_module_path=spec.module_path,
            kv_role=spec.role,  # type: ignore[arg-type]
            engine_id=spec.engine_id or spec.name,
            kv_connector_extra_config=spec.extra,
            kv_buffer_device="cpu",
        )
        self.config = VllmConfig(
            model_config=model,
            scheduler_config=SchedulerConfig(
                max_num_seqs=64,
                max_num_batched_tokens=spec.max_model_len,
                max_model_len=spec.max_model_len,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=spec.block_size, enable_prefix_caching=False),
            parallel_config=ParallelConfig(),
            kv_transfer_config=transfer,
            device_config=DeviceConfig("cpu"),
        )
        self.config.cache_config.num_gpu_blocks = spec.num_blocks
        self.config.cache_config.kv_cache_layout = "LBHNC"  # EngineCore resolves it; CPU attention needs it
        with set_current_vllm_config(self.config):
            self._build(spec)

    def _build(self, spec: EngineSpec) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            ensure_kv_transfer_initialized,
            get_kv_transfer_group,
        )
        from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{spec.dist_port}",
            local_rank=0,
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
        attention = FullAttentionSpec(
            block_size=spec.block_size, num_kv_heads=spec.kv_heads, head_size=spec.head_size, dtype=torch.float16
        )
        names = [f"model.decoder.layers.{i}.self_attn.attn" for i in range(spec.layers)]
        page = attention.page_size_bytes
        kv_cache_config = KVCacheConfig(
            num_blocks=spec.num_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=page * spec.num_blocks * spec.layers,
                    layers=names,
                    layer_stride=page * spec.num_blocks,
                    block_stride=page,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(names, attention)],
        )
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=spec.block_size,
        )
        affinity = os.sched_getaffinity(0)
        ensure_kv_transfer_initialized(self.config, kv_cache_config)
        if not spec.keep_vllm_affinity:
            os.sched_setaffinity(0, affinity)
        self.worker = get_kv_transfer_group()
        kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
        self.worker.register_kv_caches(kv_caches)
        self.kv = PatternKV(kv_caches, spec.num_blocks)
        self.kv_caches = kv_caches
        self.layer_names = list(kv_caches)
        handshake = self.worker.get_handshake_metadata()
        connector = self.scheduler.connector
        assert connector is not None  # a kv_transfer_config was given
        if handshake is not None:
            connector.set_xfer_handshake_metadata_pp_aware({(0, 0): handshake})
        self._watch_request_finished(connector)
        self.step_ms = 0.0
        self.steps: deque[float] = deque(maxlen=200_000)  # start times of recent steps
        self.tags: dict[str, str] = {}  # request id -> transfer tag (P writes it, D checks it)
        self.added: dict[str, float] = {}
        self.checked: set[str] = set()
        self.live: set[str] = set()

    @property
    def producer(self) -> bool:
        return self.spec.role == "kv_producer"

    def ready_event(self) -> dict[str, Any]:
        return {
            "ev": "ready",
            "engine_id": self.config.kv_transfer_config.engine_id,  # type: ignore[union-attr]
            "control_address": getattr(self.worker, "control_address", ""),
            "page_bytes": self.kv.page_bytes,
            "pid": os.getpid(),
        }

    def _watch_request_finished(self, connector: Any) -> None:
        """Timestamp P's request_finished: an instance-level wrapper, behaviour unchanged."""
        for name in ("request_finished", "request_finished_all_groups"):
            original = getattr(connector, name, None)
            if original is None:
                continue

            def timed(request: Any, *args: Any, _original: Any = original) -> Any:
                self.emit(ev="request_finished", id=request.request_id, t=time.perf_counter())
                return _original(request, *args)

            setattr(connector, name, timed)

    def add(self, request_id: str, prompt_len: int, max_tokens: int, params: dict[str, Any], tag: str) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sampling.extra_args = {"kv_transfer_params": params}
        self.scheduler.add_request(Request(request_id, list(range(3, 3 + prompt_len)), sampling, None))
        self.tags[request_id] = tag
        self.added[request_id] = time.perf_counter()
        self.live.add(request_id)

    def step(self) -> None:
        from vllm.forward_context import get_forward_context, set_forward_context
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        started = time.perf_counter()
        self.steps.append(started)
        so = self.scheduler.schedule()
        worker = self.worker
        meta = so.kv_connector_metadata
        assert meta is not None  # a connector is configured
        worker.handle_preemptions(meta)
        with set_forward_context(None, self.config):
            worker.bind_connector_metadata(meta)
            if so.has_sync_kv_loads:
                worker.start_load_kv(get_forward_context())
            req_ids, sampled = self._forward(so, started)
            if not so.has_sync_kv_loads:
                worker.start_load_kv(get_forward_context())
            worker.wait_for_save()  # type: ignore[no-untyped-call]
            results = worker.get_transfer_results(so.finished_req_ids)
            connector_output = KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_stats=worker.get_kv_connector_stats(),
                kv_cache_events=worker.get_kv_connector_kv_cache_events(),
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            )
            worker.clear_connector_metadata()
        now = time.perf_counter()
        for request_id in results.finished_recving or ():
            since = self.added.get(request_id, started)
            self.emit(
                ev="recving",
                id=request_id,
                t=now,
                failed=request_id in (results.failed_recving or ()),
                step_starts=[s for s in self.steps if s >= since],
            )
        for request_id in results.finished_sending or ():
            self.emit(ev="sending", id=request_id, t=now)
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=connector_output,
        )
        outputs = self.scheduler.update_from_output(so, output)
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                if out.finish_reason is not None:
                    self.emit(ev="params", id=out.request_id, params=out.kv_transfer_params)
        for request_id in [r for r in self.live if r not in self.scheduler.requests]:
            self.live.discard(request_id)
            self.emit(ev="gone", id=request_id, t=time.perf_counter())

    def _forward(self, so: Any, started: float) -> tuple[list[str], list[list[int]]]:
        """Layer by layer, as a model's attention layers do (``wait_for_layer_load``, compute,
        ``save_kv_layer``), each layer taking its share of the step's pacing (a step of
        `step_ms` ends no sooner than `step_ms` after it started, its outputs with it).
        P writes the pattern into the KV of the prompt tokens it computes.
        D checks the pages of a loaded request the first time it runs.  A request reaching the
        end of its prompt samples a token."""
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        writes: list[tuple[str, list[int], list[int]]] = []
        checks: list[tuple[str, str, list[int], list[int]]] = []
        completed: list[str] = []
        size = self.spec.block_size
        for request_id, count in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            computed = request.num_computed_tokens - count  # schedule() has already advanced it
            block_ids = list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])
            tag = self.tags.get(request_id, request_id)
            if self.producer and computed < request.num_prompt_tokens:
                last = min(computed + count, request.num_prompt_tokens) - 1
                positions = list(range(computed // size, last // size + 1))
                writes.append((tag, positions, [block_ids[p] for p in positions]))
                if request.num_prompt_tokens <= computed + count:
                    completed.append(request_id)
            elif not self.producer and request_id not in self.checked and computed > 0:
                self.checked.add(request_id)
                positions = list(range(-(-request.num_prompt_tokens // size)))
                checks.append((request_id, tag, positions, [block_ids[p] for p in positions]))
            req_ids.append(request_id)
            sampled.append([7] if computed + count >= request.num_prompt_tokens else [])
        for layer, name in enumerate(self.layer_names):
            self.worker.wait_for_layer_load(name)
            for tag, positions, blocks in writes:
                self.kv.write(tag, positions, blocks, layer)
            if self.step_ms > 0:
                layer_end = started + self.step_ms / 1000 * (layer + 1) / len(self.layer_names)
                time.sleep(max(0.0, layer_end - time.perf_counter()))
            self.worker.save_kv_layer(name, self.kv_caches[name], None)  # type: ignore[arg-type]  # no attention here
        now = time.perf_counter()
        for request_id in completed:
            self.emit(ev="computed", id=request_id, t=now)
        for request_id, tag, positions, blocks in checks:
            bad = self.kv.count_bad(tag, positions, blocks)
            pages = len(positions) * len(self.kv.pages)
            self.emit(ev="checked", id=request_id, pages=pages, bad=bad, page_bytes=self.kv.page_bytes)
        return req_ids, sampled

    def close(self) -> None:
        self.worker.shutdown()  # type: ignore[no-untyped-call]


def _read_commands(stream: Iterable[str], commands: queue.Queue[dict[str, Any] | None]) -> None:
    for line in stream:
        if line.strip():
            commands.put(json.loads(line))
    commands.put(None)  # stdin closed: the driver is gone


def serve(spec: EngineSpec, commands: queue.Queue[dict[str, Any] | None], events: IO[str]) -> None:
    """Step the engine and obey commands until told to stop (or stdin closes)."""
    lock = threading.Lock()

    def emit(**event: Any) -> None:
        with lock:
            events.write(json.dumps(event) + "\n")
            events.flush()

    engine = Engine(spec, emit)
    emit(**engine.ready_event())
    try:
        while True:
            busy = engine.scheduler.has_requests()
            try:
                command = commands.get_nowait() if busy else commands.get(timeout=0.05)
            except queue.Empty:
                command = {"op": "none"}
            if command is None or command["op"] == "stop":
                break
            if command["op"] == "add":
                c = command
                engine.add(c["id"], c["prompt_len"], c["max_tokens"], c["params"], c["tag"])
            elif command["op"] == "pace":
                engine.step_ms = float(command["step_ms"])
            if engine.scheduler.has_requests():
                engine.step()
    finally:
        engine.close()
        emit(ev="closed")


def main() -> None:
    """Entry point of an engine process (see the module docstring)."""
    events = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever vLLM, NIXL or UCX print goes to stderr
    spec_fields = json.loads(sys.stdin.readline())
    spec = EngineSpec(**spec_fields)
    commands: queue.Queue[dict[str, Any] | None] = queue.Queue()
    threading.Thread(target=_read_commands, args=(sys.stdin, commands), daemon=True).start()
    serve(spec, commands, events)


def spec_line(spec: EngineSpec) -> str:
    return json.dumps(asdict(spec))


if __name__ == "__main__":
    main()
