"""How the stand-in builds an engine's vLLM configuration and its layers' KV cache specs.

Why apart: this is where the stand-in stands in for vLLM's engine start-up (the config a GPU
host would have) and for the model's attention layers (the KV cache spec each declares); the
engine module then uses vLLM's own layout resolution, planning and allocation on them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from kvflow_tools.standin.fabrics import fabric_of
from kvflow_tools.standin.model import BACKENDS, EngineOptions

__all__ = (
    "MambaShape",
    "backend_class",
    "distributed_worker",
    "init_distributed",
    "layer_specs",
    "mamba_shape",
    "vllm_config",
)


@dataclass(frozen=True)
class MambaShape:
    """The stand-in's Mamba2 mixer on one rank: its conv state's columns (x, B, C: each rank
    its `1/ranks` of each), rows, and the temporal state's (heads, head size, state size)."""

    columns: tuple[int, int, int]
    rows: int
    temporal: tuple[int, int, int]
    dim_first: bool  # the conv state (columns, rows), vLLM's "DS"; else (rows, columns)
    element_size: int  # bytes of a value of either state


def mamba_shape(o: EngineOptions, element_size: int) -> MambaShape:
    """The state a rank of `o`'s engine holds per Mamba layer (4 head sizes of channels per KV
    head of the model, x of them for 2 SSM heads per KV head of 16 values each, B and C the
    rest), oriented as vLLM's `VLLM_SSM_CONV_STATE_LAYOUT` says."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    ranks = o.tensor_parallel
    channels, heads = 4 * o.model.head_dim * o.model.kv_heads // ranks, max(1, 2 * o.model.kv_heads // ranks)
    x = heads * 16
    b = (channels - x) // 2
    return MambaShape((x, b, b), 3, (heads, 16, 16), is_conv_state_dim_first(), element_size)


def backend_class(name: str) -> Any:
    """vLLM's attention backend class of that name."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {sorted(BACKENDS)}, not {name!r}")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def _extra(o: EngineOptions) -> dict[str, Any]:
    """The connector's settings: the stand-in's own keys out and, for kvflow's, no engine-core
    sleep unless a test asks for one.  No stand-in engine core would sleep (its loop is not
    vLLM's), and the bell that ends a sleep would ring threads of this process, which here
    holds P's and D's ranks together, while another rank's KV memory moves in place
    (`host_memory.share_in_place`: the stand-in's caches are small heap allocations, whose pages
    any running thread may write).  The sleep is tested on real servers."""
    extra = dict(fabric_of(o.extra)[0])
    if o.connector == "KVFlowConnector":
        extra.setdefault("idle_sleep", 0.0)
    return extra


def vllm_config(o: EngineOptions) -> Any:
    """The VllmConfig of one engine, as a GPU host would have it."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(
        model=o.model.model_dir(o.max_model_len),
        skip_tokenizer_init=True,
        dtype=o.model.dtype,  # type: ignore[arg-type]
        max_model_len=o.max_model_len,
        seed=0,
    )
    transfer = (
        None
        if not o.connector
        else KVTransferConfig(
            kv_connector=o.connector,
            kv_connector_module_path=o.module_path,
            kv_role=o.role,  # type: ignore[arg-type]
            engine_id=o.engine_id or o.name,
            kv_connector_extra_config=_extra(o),
            kv_load_failure_policy=o.failure_policy,  # type: ignore[arg-type]
            kv_buffer_device=o.kv_buffer_device,
        )
    )
    # vLLM 0.34's option only where asked for: 0.33's SchedulerConfig has no such field
    inflight: dict[str, Any] = {}
    if o.max_num_inflight_kv_loads is not None:
        inflight["max_num_inflight_kv_loads"] = o.max_num_inflight_kv_loads
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            # vLLM refuses a token budget below max_num_seqs: small budgets (chunked prefill) lower it
            max_num_seqs=o.max_num_seqs or min(64, o.max_num_batched_tokens),
            max_num_batched_tokens=o.max_num_batched_tokens,
            max_model_len=o.max_model_len,
            is_encoder_decoder=False,
            async_scheduling=o.async_scheduling,
            **inflight,
        ),
        cache_config=CacheConfig(
            block_size=o.block_size, enable_prefix_caching=o.prefix_caching, cache_dtype=o.cache_dtype
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=o.tensor_parallel,
            data_parallel_rank=o.data_parallel[0],
            data_parallel_size=o.data_parallel[1],
        ),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.block_size = o.block_size  # as on a GPU (the CPU platform forces 16 for MLA)
    config.cache_config.num_gpu_blocks_override = o.num_blocks
    config.cache_config.num_gpu_blocks = o.num_blocks
    # vLLM's hybrid KV cache manager as a GPU platform decides it (whatever platform this process
    # resolved): on, unless the user turned it off or the connector does not support it
    hybrid = o.hybrid_kv_cache_manager
    if hybrid is None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        hybrid = transfer is None or KVConnectorFactory.supports_hma_config(transfer)
    config.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
    if o.kv_cache_layout is not None:  # the user's choice wins outright, as in vLLM
        config.cache_config.kv_cache_layout = o.kv_cache_layout
    return config


def layer_specs(config: Any, o: EngineOptions) -> dict[str, Any]:
    """The KV cache spec each attention layer declares (what vLLM's Attention and
    MLAAttention layers build from the model config), KV-sharing layers excepted."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        get_kv_quant_mode,
    )

    model, parallel = config.model_config, config.parallel_config
    cache_dtype = o.cache_dtype
    common: dict[str, Any] = {
        "block_size": config.cache_config.block_size,
        "dtype": kv_cache_dtype_str_to_dtype(cache_dtype, model),
        "kv_quant_mode": get_kv_quant_mode(cache_dtype),
        "head_size": model.get_head_size(),
    }
    layer_types = list(o.model.layer_types) or getattr(model.hf_config, "layer_types", None) or []
    shared = dict(o.model.shared)
    specs: dict[str, Any] = {}
    for layer, name in enumerate(o.model.layer_names()):
        if layer in shared:
            continue
        if layer < len(layer_types) and layer_types[layer] == "mamba":
            specs[name] = _mamba_spec(config, o, common["dtype"])
        elif model.use_mla:
            specs[name] = MLAAttentionSpec(num_kv_heads=1, max_tp_shards=1, cache_dtype_str=cache_dtype, **common)
        elif layer < len(layer_types) and layer_types[layer] == "sliding_attention":
            window = model.get_sliding_window()
            specs[name] = SlidingWindowSpec(
                num_kv_heads=model.get_num_kv_heads(parallel), sliding_window=window, **common
            )
        else:
            specs[name] = FullAttentionSpec(num_kv_heads=model.get_num_kv_heads(parallel), **common)
    return specs


def _mamba_spec(config: Any, o: EngineOptions, dtype: Any) -> Any:
    """A Mamba2 mixer's state spec, as vLLM's layer builds it (`mamba_shape`); one state block
    per request without prefix caching (vLLM's "none" mode, block size the model's length), a
    state per block with it ("align")."""
    from vllm.v1.kv_cache_interface import MambaSpec

    shape = mamba_shape(o, dtype.itemsize)
    channels = sum(shape.columns)
    align = o.prefix_caching
    return MambaSpec(
        block_size=config.cache_config.block_size if align else o.max_model_len,
        shapes=((channels, shape.rows) if shape.dim_first else (shape.rows, channels), shape.temporal),
        dtypes=(dtype, dtype),
        mamba_cache_mode="align" if align else "none",
    )


def distributed_worker(config: Any, kv_cache_config: Any, o: EngineOptions) -> Any:
    """vLLM's own worker set-up: a one-rank gloo group, then the connector made by
    ``ensure_kv_transfer_initialized`` (vLLM's CPU pinning undone unless `keep_vllm_affinity`).

    Raises:
        ValueError: the engine has more than one tensor-parallel rank.
    """
    import os

    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_initialized,
        get_kv_transfer_group,
    )

    init_distributed(o)
    affinity = os.sched_getaffinity(0)
    ensure_kv_transfer_initialized(config, kv_cache_config)
    if not o.keep_vllm_affinity:
        os.sched_setaffinity(0, affinity)
    return get_kv_transfer_group()


def init_distributed(o: EngineOptions) -> None:
    """A one-rank gloo group, as vLLM's worker makes before its connector.

    Raises:
        ValueError: the engine has more than one tensor-parallel rank.
    """
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

    if o.tensor_parallel != 1:
        raise ValueError("a distributed stand-in engine runs one rank per process")
    init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{o.dist_port}",
        local_rank=0,
        backend="gloo",
    )
    ensure_model_parallel_initialized(1, 1)
