"""The stand-in's models and engine options: what a P or D engine is made of.

Why here: a test case or a benchmark cell is a model geometry (written out as the config.json of
its family: vLLM needs a model config, not weights), an attention backend (whose supported KV
cache layouts and kernel block sizes vLLM reads), and the engine's vLLM settings.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ("BACKENDS", "FAMILIES", "EngineOptions", "ModelShape")

BACKENDS = {  # attention backend -> where vLLM keeps its class
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
    "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend"),
    "CPU_ATTN": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend"),
    "FLASHMLA": ("vllm.v1.attention.backends.mla.flashmla", "FlashMLABackend"),
    "TRITON_MLA": ("vllm.v1.attention.backends.mla.triton_mla", "TritonMLABackend"),
}
FAMILIES = ("qwen3", "deepseek_v3", "gemma2", "opt")


@dataclass(frozen=True)
class ModelShape:
    """A model geometry, written out as the config.json of its family.

    qwen3: GQA; deepseek_v3: MLA (one 576-wide latent per token); gemma2: sliding-window and
    full-attention layers (in turn, or as `layer_types` says: Gemma-3-like 5:1, all sliding);
    opt: multi-head attention.  `draft_layers` adds EAGLE-style
    draft layers after the model's (speculative decoding); `shared` lists (layer, target) pairs
    of layers that attend over another layer's KV (KV sharing); `attention_modules` is the number
    of attention modules in one decoder layer (LongCat-Flash: 2, named ``model.layers.L.self_attn.M.attn``).
    Layers in `shared` and in the specs count attention modules, draft layers after them.
    """

    family: str = "qwen3"
    layers: int = 4
    kv_heads: int = 4  # all ranks together
    head_dim: int = 64
    dtype: str = "bfloat16"
    draft_layers: int = 0
    shared: tuple[tuple[int, int], ...] = ()
    attention_modules: int = 1
    # each layer's kind: gemma2's "sliding_attention" / "full_attention" (default: in turn, as
    # Gemma 2), and any family's "mamba" (a Mamba2 mixer's conv and SSM state in place of
    # attention, ``model.layers.L.mixer``); gemma2's sliding window in tokens
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 64

    @property
    def attention_layers(self) -> int:
        """The model's attention modules (not counting draft layers)."""
        return self.layers * self.attention_modules

    def config(self, max_model_len: int) -> dict[str, Any]:
        if self.family not in FAMILIES:
            raise ValueError(f"model family must be one of {FAMILIES}, not {self.family!r}")
        heads = max(8, self.kv_heads)
        common = {
            "hidden_size": heads * self.head_dim,
            "num_attention_heads": heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.layers,
            "intermediate_size": 1024,
            "vocab_size": 1000,
            "max_position_embeddings": max_model_len,
            "torch_dtype": self.dtype,
            "eos_token_id": 2,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
        }
        if self.family == "qwen3":
            return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **common}
        if self.family == "gemma2":
            return {
                "architectures": ["Gemma2ForCausalLM"],
                "model_type": "gemma2",
                "sliding_window": self.sliding_window,
                "query_pre_attn_scalar": self.head_dim,
                **common,
                **({"layer_types": list(self.layer_types)} if self.layer_types else {}),
            }
        if self.family == "opt":
            hidden = self.kv_heads * self.head_dim
            return {
                "architectures": ["OPTForCausalLM"],
                "model_type": "opt",
                "hidden_size": hidden,
                "num_attention_heads": self.kv_heads,
                "num_hidden_layers": self.layers,
                "ffn_dim": 4 * hidden,
                "vocab_size": 1000,
                "max_position_embeddings": max_model_len,
                "word_embed_proj_dim": hidden,
                "torch_dtype": self.dtype,
                "do_layer_norm_before": True,
                "eos_token_id": 2,
            }
        return {  # deepseek_v3: the latent is kv_lora_rank + qk_rope_head_dim = 576 wide
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            **common,
            "num_key_value_heads": heads,
            "kv_lora_rank": 512,
            "q_lora_rank": 256,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "moe_intermediate_size": 256,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
        }

    def layer_name(self, layer: int) -> str:
        decoder = "model.decoder.layers" if self.family == "opt" else "model.layers"
        if layer >= self.attention_layers:  # a draft layer: numbered after the model's
            return f"{decoder}.{layer - self.attention_layers + self.layers}.self_attn.attn"
        if self.attention_modules > 1:
            index, module = divmod(layer, self.attention_modules)
            return f"{decoder}.{index}.self_attn.{module}.attn"
        if layer < len(self.layer_types) and self.layer_types[layer] == "mamba":
            return f"{decoder}.{layer}.mixer"
        return f"{decoder}.{layer}.self_attn.attn"

    def layer_names(self) -> list[str]:
        """Every attention layer, in execution order (draft layers last)."""
        return [self.layer_name(i) for i in range(self.attention_layers + self.draft_layers)]

    def model_dir(self, max_model_len: int) -> str:
        """A directory holding only this config.json; its path depends only on the config, so
        P and D name the same model."""
        text = json.dumps(self.config(max_model_len), sort_keys=True)
        path = os.path.join(tempfile.gettempdir(), f"kvflow-model-{zlib.crc32(text.encode()):08x}")
        os.makedirs(path, exist_ok=True)
        staged = os.path.join(path, f".config.{os.getpid()}.{threading.get_ident()}")
        with open(staged, "w") as f:
            f.write(text)
        os.replace(staged, os.path.join(path, "config.json"))
        return path


@dataclass(frozen=True)
class EngineOptions:
    """One engine: a P ("kv_producer") or D ("kv_consumer") with its connector and model."""

    name: str
    role: str
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config
    connector: str = "KVFlowConnector"  # "": no KV connector (the engine alone)
    module_path: str | None = "kvflow.integrations.vllm"
    engine_id: str = ""
    model: ModelShape = field(default_factory=ModelShape)
    backend: str = "FLASH_ATTN"
    kv_cache_layout: str | None = None  # as a user's VLLM_KV_CACHE_LAYOUT; None: resolved by vLLM
    cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype
    block_size: int = 32
    num_blocks: int = 64
    max_model_len: int = 1024
    max_num_batched_tokens: int = 1024
    max_num_seqs: int | None = None  # the running batch's size; None: 64, or the token budget if smaller
    # vLLM 0.34's --max-num-inflight-kv-loads: requests the connector may load while the batch is full
    max_num_inflight_kv_loads: int | None = None
    tensor_parallel: int = 1
    data_parallel: tuple[int, int] = (0, 1)  # (this engine's DP rank, DP size): one DP rank per stand-in
    prefix_caching: bool = False
    async_scheduling: bool = False
    log_stats: bool = False  # the scheduler makes SchedulerStats each step (`vllm serve` does by default)
    failure_policy: str = "fail"
    hook_order: str = "v1"  # "v1": vLLM's V1 model runner; "v2": Model Runner V2
    full_cudagraph: bool = False  # the forward replays a full CUDA graph: no save_kv_layer calls
    device_lag: float | None = None  # seconds a LaggingDevice runs kernels after their launch
    kv_device: str = "cpu"  # "cuda": rank r's KV caches on CUDA device r (modulo the devices present)
    # vLLM's hybrid KV cache manager: None, as vLLM decides (on for a connector that declares
    # SupportsHMA); True / False: --enable- / --disable-hybrid-kv-cache-manager
    hybrid_kv_cache_manager: bool | None = None
    distributed: bool = False  # a gloo group and vLLM's own worker set-up (one rank per process)
    dist_port: int = 0  # its one-rank gloo group's port (0: the kernel picks one)
    keep_vllm_affinity: bool = False  # keep the CPU pinning vLLM's NIXL worker applies on CPU
    # P writes a pattern into the KV it computes and D checks every page it loads; off: neither
    # (a GPU host's CPU does neither: `kvflow bench host` measures the host alone)
    verify_pages: bool = True
    kv_buffer_device: str = "cuda"  # vLLM's default; the CPU KV caches of the benchmark's NIXL connectors need "cpu"
