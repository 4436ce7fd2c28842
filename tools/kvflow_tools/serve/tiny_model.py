"""A tiny decoder model written locally: config, seeded random weights and a word-level tokenizer.

Why: a real vLLM engine needs a model directory, and tests and demos must not download one.
The weights are random but seeded, so greedy output is the same on every machine and run (and
differs from prompt to prompt, which vLLM's ``load_format="dummy"`` weights do not); the
tokenizer maps the words ``<0>`` .. ``<vocab-1>`` to their ids, so prompts can name token ids
directly.  Its chat template joins the messages' contents with spaces (a chat is its words, no
role markers), so a chat request names its prompt's tokens too.  Only torch, safetensors and
tokenizers are used, so a directory written by one environment loads in another (the main venv
and a vLLM CPU build's).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from kvflow.errors import ConfigError

__all__ = ("TinyModel", "write_model")


ARCHITECTURES = ("llama", "gemma2", "granite-hybrid")
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


@dataclass(frozen=True)
class TinyModel:
    """A Llama-architecture geometry, small enough to run on a CPU in milliseconds a token; or
    Gemma 2's (``architecture="gemma2"``): sliding-window (`sliding_window` tokens) and
    full-attention layers in turn, the hybrid model vLLM's hybrid KV cache manager splits into
    one KV cache group of each kind; or a Granite 4 hybrid's (``"granite-hybrid"``): Mamba2
    mixers (8 heads, a state of 16) and full-attention layers in turn, a dense MLP in each."""

    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    seed: int = 0
    architecture: str = "llama"
    sliding_window: int = 64  # gemma2: the sliding-window layers' window, in tokens

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"tiny model architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        for name, value in asdict(self).items():
            if name != "architecture" and (type(value) is not int or value < (0 if name == "seed" else 1)):
                raise ConfigError(f"tiny model {name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ConfigError("tiny model: hidden_size must divide by num_heads, num_heads by num_kv_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def config(self) -> dict[str, object]:
        """The ``config.json`` of this model (Hugging Face's Llama or Gemma 2 schema)."""
        common: dict[str, object] = {
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": 10000.0,
            "torch_dtype": "float32",
            "bos_token_id": 0,
            "eos_token_id": self.vocab_size - 1,
        }
        if self.architecture == "granite-hybrid":
            return {**common, **_granite_config(self)}
        if self.architecture == "gemma2":  # layers alternate sliding (even) and full (odd) attention
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_layers)]
            return {
                **common,
                "architectures": ["Gemma2ForCausalLM"],
                "model_type": "gemma2",
                "hidden_activation": "gelu_pytorch_tanh",
                "rms_norm_eps": 1e-6,
                "attention_bias": False,
                "query_pre_attn_scalar": self.head_dim,
                "sliding_window": self.sliding_window,
                "layer_types": types,
                "final_logit_softcapping": 30.0,
                "attn_logit_softcapping": 50.0,
                "tie_word_embeddings": True,  # the embeddings are the output's weights too
                "pad_token_id": 0,
            }
        return {
            **common,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        }


MAMBA_HEADS, MAMBA_STATE, MAMBA_CONV = 8, 16, 4  # the Granite hybrid's mixers


def _granite_config(model: TinyModel) -> dict[str, object]:
    """GraniteMoeHybrid without experts: even layers Mamba2 ("linear_attention"), odd ones full
    attention, every layer a dense MLP."""
    types = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(model.num_layers)]
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "layer_types": types,
        "shared_intermediate_size": model.intermediate_size,
        "num_local_experts": 0,
        "num_experts_per_tok": 0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "position_embedding_type": "rope",
        "attention_bias": False,
        "attention_multiplier": model.head_dim**-0.5,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "logits_scaling": 1.0,
        "mamba_n_heads": MAMBA_HEADS,
        "mamba_d_head": 2 * model.hidden_size // MAMBA_HEADS,
        "mamba_n_groups": 1,
        "mamba_d_state": MAMBA_STATE,
        "mamba_d_conv": MAMBA_CONV,
        "mamba_expand": 2,
        "mamba_chunk_size": 64,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
    }


def _granite_weights(model: TinyModel) -> dict[str, torch.Tensor]:
    """The Granite hybrid's tensors: an attention layer's projections, a Mamba2 mixer's input
    projection (z, x, B, C, dt), convolution, decay (A_log), step bias, skip (D), gated norm and
    output projection, and every layer's MLP; decays and steps in Mamba2's usual ranges, so that
    the state carries the context."""
    generator = torch.Generator().manual_seed(model.seed)

    def normal(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * std

    def uniform(n: int, low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(n, generator=generator, dtype=torch.float32)

    h, q, kv = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    inner, groups = 2 * h, MAMBA_STATE  # mamba_expand 2; one group of the state's size
    tensors = {"model.embed_tokens.weight": normal(model.vocab_size, h, std=0.5)}
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(h)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h)
        if i % 2:
            tensors[p + "self_attn.q_proj.weight"] = normal(q, h, std=0.2)
            tensors[p + "self_attn.k_proj.weight"] = normal(kv, h, std=0.2)
            tensors[p + "self_attn.v_proj.weight"] = normal(kv, h)
            tensors[p + "self_attn.o_proj.weight"] = normal(h, q)
        else:
            tensors[p + "mamba.in_proj.weight"] = normal(2 * inner + 2 * groups + MAMBA_HEADS, h)
            tensors[p + "mamba.conv1d.weight"] = normal(inner + 2 * groups, 1, MAMBA_CONV, std=0.4)
            tensors[p + "mamba.conv1d.bias"] = normal(inner + 2 * groups, std=0.05)
            tensors[p + "mamba.A_log"] = torch.log(uniform(MAMBA_HEADS, 1.0, 16.0))
            step = torch.exp(uniform(MAMBA_HEADS, math.log(1e-3), math.log(1e-1)))
            tensors[p + "mamba.dt_bias"] = step + torch.log(-torch.expm1(-step))  # softplus's inverse
            tensors[p + "mamba.D"] = torch.ones(MAMBA_HEADS)
            tensors[p + "mamba.norm.weight"] = torch.ones(inner)
            tensors[p + "mamba.out_proj.weight"] = normal(h, inner)
        tensors[p + "shared_mlp.input_linear.weight"] = normal(2 * model.intermediate_size, h)
        tensors[p + "shared_mlp.output_linear.weight"] = normal(h, model.intermediate_size)
    tensors["model.norm.weight"] = torch.ones(h)
    tensors["lm_head.weight"] = normal(model.vocab_size, h)
    return tensors


def _weights(model: TinyModel) -> dict[str, torch.Tensor]:
    """Every tensor by the name vLLM's loader expects.  Gemma 2's norms scale by 1 + w (so they
    are 0) and its embeddings are the output's weights too; small embeddings (it multiplies them
    by sqrt(hidden)) and sharp queries and keys keep its greedy output off a fixed point, so the
    context, and the window, decide the tokens."""
    if model.architecture == "granite-hybrid":
        return _granite_weights(model)
    gemma = model.architecture == "gemma2"
    generator = torch.Generator().manual_seed(model.seed)

    def normal(*shape: int, std: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * std

    h, q, kv = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    norm = torch.zeros if gemma else torch.ones
    norms = ("input", "post_attention", "pre_feedforward", "post_feedforward") if gemma else ("input", "post_attention")
    embed_std, qk_std = (0.02, 0.2) if gemma else (0.05, 0.05)
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(model.vocab_size, h, std=embed_std)}
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        for name in norms:
            tensors[f"{p}{name}_layernorm.weight"] = norm(h)
        tensors[p + "self_attn.q_proj.weight"] = normal(q, h, std=qk_std)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, h, std=qk_std)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, h)
        tensors[p + "self_attn.o_proj.weight"] = normal(h, q)
        tensors[p + "mlp.gate_proj.weight"] = normal(model.intermediate_size, h)
        tensors[p + "mlp.up_proj.weight"] = normal(model.intermediate_size, h)
        tensors[p + "mlp.down_proj.weight"] = normal(h, model.intermediate_size)
    tensors["model.norm.weight"] = norm(h)
    if not gemma:
        tensors["lm_head.weight"] = normal(model.vocab_size, h)
    return tensors


def _tokenizer_json(model: TinyModel) -> str:
    vocab = {f"<{i}>": i for i in range(model.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    text: str = tokenizer.to_str()
    return text


def write_model(path: str | os.PathLike[str], model: TinyModel = TinyModel()) -> Path:
    """Write `model` into the directory `path` (created; files already there are replaced) and
    return it.  The same model gives the same bytes: two writes compare equal file by file.

    :raises ConfigError: `path` exists and is not a directory.
    """
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"tiny model directory {target} exists and is not a directory")
    target.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": json.dumps(model.config(), indent=2, sort_keys=True),
        "generation_config.json": json.dumps({"bos_token_id": 0, "eos_token_id": model.vocab_size - 1}),
        "tokenizer.json": _tokenizer_json(model),
        "tokenizer_config.json": json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<0>",
                "model_max_length": 1 << 20,
                "chat_template": CHAT_TEMPLATE,
            }
        ),
    }
    for name, text in files.items():
        _replace(target / name, text.encode())
    with tempfile.NamedTemporaryFile(dir=target, suffix=".part", delete=False) as staged:
        pass
    try:
        save_file(_weights(model), staged.name, metadata={"format": "pt"})
        os.replace(staged.name, target / "model.safetensors")
    finally:
        if os.path.exists(staged.name):
            os.unlink(staged.name)
    return target


def _replace(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file, so no reader sees half of it."""
    staged = path.with_name(path.name + ".part")
    staged.write_bytes(data)
    os.replace(staged, path)
