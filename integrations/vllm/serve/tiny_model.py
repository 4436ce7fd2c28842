"""A tiny decoder model written locally: config, seeded random weights and a word-level tokenizer.

Why: a real vLLM engine needs a model directory, and tests and demos must not download one.
The weights are random but seeded, so greedy output is the same on every machine and run (and
differs from prompt to prompt, which vLLM's ``load_format="dummy"`` weights do not); the
tokenizer maps the words ``<0>`` .. ``<vocab-1>`` to their ids, so prompts can name token ids
directly.  Only torch, safetensors and tokenizers are used, so a directory written by one
environment loads in another (the main venv and a vLLM CPU build's).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from kvflow.errors import ConfigError

__all__ = ("TinyModel", "write_model")


ARCHITECTURES = ("llama", "gemma2")


@dataclass(frozen=True)
class TinyModel:
    """A Llama-architecture geometry, small enough to run on a CPU in milliseconds a token; or
    Gemma 2's (``architecture="gemma2"``): sliding-window (`sliding_window` tokens) and
    full-attention layers in turn, the hybrid model vLLM's hybrid KV cache manager splits into
    one KV cache group of each kind."""

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


def _weights(model: TinyModel) -> dict[str, torch.Tensor]:
    """Every tensor by the name vLLM's loader expects.  Gemma 2's norms scale by 1 + w (so they
    are 0) and its embeddings are the output's weights too; small embeddings (it multiplies them
    by sqrt(hidden)) and sharp queries and keys keep its greedy output off a fixed point, so the
    context, and the window, decide the tokens."""
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
            {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<0>", "model_max_length": 1 << 20}
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
