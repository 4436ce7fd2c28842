"""The step-time model of `kvflow bench pd`.

How long one engine step of a real model on a real GPU would take.

Why: on this machine the model's arithmetic is the only thing the stand-in engine does not do
for real (vLLM's scheduler, the KV cache allocation, the connector hooks and the transfer all
run as they ship).  The engine asks this model how long each step's forward should last, from
the step's batch, and lasts no less (`StandInEngine` sleeps the remainder).  Pure: no clock
reads, no I/O; time is only ever an output.

The model, each constant printed with its source by the benchmark:

* decode rows are memory bound: every step reads the weights once and every cached token of
  every request in the batch, ``(weights/TP + Σctx·kv_bytes_per_token/TP) / (BW·η_mem)``;
* prefill chunks are compute bound: ``2·params·c + 4·layers·(heads·head_dim)·c·(k + c/2)``
  FLOPs for ``c`` new tokens after ``k`` cached ones, at ``TP·peak·MFU``;
* every step pays a fixed ``t_base`` (launches, sampling, the host's share), calibrated once so
  that one short request decoding alone takes the article's low-load TPOT.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kvflow.errors import ConfigError

__all__ = ("GPUS", "MODELS", "GpuSpec", "ModelGeometry", "Row", "StepModel")

# vLLM 0.33 `EngineArgs._set_default_args`: a GPU of 70..160 GiB that is not an A100 (H100,
# H200) gets max_num_batched_tokens 8192 for an online server (UsageContext.OPENAI_API_SERVER)
VLLM_ONLINE_BUDGET = 8192
VLLM_BUDGET_SOURCE = "vllm/engine/arg_utils.py EngineArgs._set_default_args: H100/H200, OPENAI_API_SERVER -> 8192"
CALIBRATION_TPOT_MS = 5.7  # the article's low-load TPOT (5.6-5.8 ms, push and pull alike)
CALIBRATION_CONTEXT = 1024  # "a short context": the one request's cached tokens at calibration


@dataclass(frozen=True)
class ModelGeometry:
    """The shapes that decide a step's cost and a token's KV bytes (from the model's config.json)."""

    name: str
    layers: int
    heads: int  # attention (query) heads
    kv_heads: int
    head_dim: int
    hidden: int
    params: float  # parameters
    dtype_bytes: int = 2  # bf16
    dtype: str = "bfloat16"
    source: str = ""

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: 2·layers·kv_heads·head_dim·dtype."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model's datasheet figures."""

    name: str
    hbm_gb: float
    bw_tb_s: float
    tflops: float  # dense BF16
    source: str = ""


MODELS = {
    "Qwen3-32B": ModelGeometry(
        "Qwen3-32B", 64, 64, 8, 128, 5120, 32.8e9,
        source="huggingface.co/Qwen/Qwen3-32B config.json: 64 layers, 64 heads, 8 KV heads, head_dim 128, "
        "hidden 5120, bf16; model card: 32.8B parameters",
    ),
    "Llama-3.1-8B": ModelGeometry(
        "Llama-3.1-8B", 32, 32, 8, 128, 4096, 8.03e9,
        source="huggingface.co/meta-llama/Llama-3.1-8B config.json: 32 layers, 32 heads, 8 KV heads, "
        "head_dim 128, hidden 4096, bf16; model card: 8.03B parameters",
    ),
}  # fmt: skip
GPUS = {
    "H200": GpuSpec(
        "H200 SXM", 141.0, 4.8, 989.0, "NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS BF16 dense"
    ),
    "H100": GpuSpec(
        "H100 SXM", 80.0, 3.35, 989.0, "NVIDIA H100 datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS BF16 dense"
    ),
}


@dataclass(frozen=True)
class Row:
    """One request's share of a step: `new` tokens computed after `cached` ones; a decode row
    (one new token after the whole prompt) when `decode`."""

    cached: int
    new: int
    decode: bool


@dataclass(frozen=True)
class StepModel:
    """A step's modelled duration on `tp` GPUs of `gpu` running `model`.

    :raises ConfigError: a non-positive or out-of-range field (named in the message).
    """

    model: ModelGeometry
    gpu: GpuSpec
    tp: int = 8
    eta_mem: float = 0.7
    mfu: float = 0.4
    budget_tokens: int = VLLM_ONLINE_BUDGET
    t_base_ms: float = field(default=-1.0)  # < 0: calibrated (`calibrated`)

    def __post_init__(self) -> None:
        checks = {
            "tp": self.tp >= 1,
            "eta_mem": 0 < self.eta_mem <= 1,
            "mfu": 0 < self.mfu <= 1,
            "budget_tokens": self.budget_tokens >= 1,
            "model.layers": self.model.layers >= 1,
            "model.params": self.model.params > 0,
            "model.kv_heads": self.model.kv_heads >= 1,
            "model.head_dim": self.model.head_dim >= 1,
            "gpu.bw_tb_s": self.gpu.bw_tb_s > 0,
            "gpu.tflops": self.gpu.tflops > 0,
            "gpu.hbm_gb": self.gpu.hbm_gb > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(f"step model: invalid {', '.join(bad)}")
        if self.t_base_ms < 0:
            base = CALIBRATION_TPOT_MS - self._decode_ms([CALIBRATION_CONTEXT])
            if base < 0:
                raise ConfigError(
                    f"step model: t_base_ms would be negative ({base:.3f}): the weights alone take longer "
                    f"than the calibration TPOT {CALIBRATION_TPOT_MS} ms on tp={self.tp}"
                )
            object.__setattr__(self, "t_base_ms", base)

    @classmethod
    def named(cls, model: str, gpu: str = "H200", **options: Any) -> StepModel:
        """The model and GPU of those names.

        :raises ConfigError: an unknown name or a bad option.
        """
        if model not in MODELS:
            raise ConfigError(f"unknown model {model!r}; choose from {sorted(MODELS)}")
        if gpu not in GPUS:
            raise ConfigError(f"unknown gpu {gpu!r}; choose from {sorted(GPUS)}")
        return cls(MODELS[model], GPUS[gpu], **options)

    def _decode_ms(self, contexts: Iterable[int]) -> float:
        read = self.model.weight_bytes / self.tp + sum(contexts) * self.model.kv_bytes_per_token / self.tp
        return read / (self.gpu.bw_tb_s * 1e12 * self.eta_mem) * 1e3

    def prefill_flops(self, cached: int, new: int) -> float:
        """FLOPs of one prefill chunk: `new` tokens after `cached` ones."""
        m = self.model
        return 2 * m.params * new + 4 * m.layers * (m.heads * m.head_dim) * new * (cached + new / 2)

    def step_ms(self, rows: Iterable[Row]) -> float:
        """The modelled time of a step computing `rows` (0 for an empty step: nothing runs).

        :raises ConfigError: a row with negative tokens.
        """
        rows = list(rows)
        if not rows:
            return 0.0
        if any(r.cached < 0 or r.new < 0 for r in rows):
            raise ConfigError("step model: a row has negative cached or new tokens")
        ms = self.t_base_ms
        decode = [r.cached + r.new for r in rows if r.decode]
        if decode:
            ms += self._decode_ms(decode)
        flops = sum(self.prefill_flops(r.cached, r.new) for r in rows if not r.decode)
        if flops:
            ms += flops / (self.tp * self.gpu.tflops * 1e12 * self.mfu) * 1e3
        return ms

    def capacity_blocks(self, gpu_memory_utilization: float = 0.9, reserve_gb: float = 4.0, block: int = 16) -> int:
        """KV blocks one engine holds: per GPU, HBM·utilisation − weights/TP − `reserve_gb`, over
        the KV bytes of a token on one GPU (its KV heads / TP).

        :raises ConfigError: nothing is left for the KV cache.
        """
        free = self.gpu.hbm_gb * 1e9 * gpu_memory_utilization - self.model.weight_bytes / self.tp - reserve_gb * 1e9
        per_token = self.model.kv_bytes_per_token / self.tp
        if free <= per_token * block:
            raise ConfigError(f"capacity: no room for KV on {self.gpu.name} with tp={self.tp}")
        return int(free // (per_token * block))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "budget_source": VLLM_BUDGET_SOURCE}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepModel:
        """:raises ConfigError: a missing or bad field."""
        try:
            fields = {k: v for k, v in data.items() if k != "budget_source"}
            return cls(ModelGeometry(**fields.pop("model")), GpuSpec(**fields.pop("gpu")), **fields)
        except (TypeError, KeyError) as error:
            raise ConfigError(f"step model: bad description ({error})") from None

    def describe(self) -> dict[str, Any]:
        """The constants, with their sources, as the results print them."""
        return {
            "t_base_ms": round(self.t_base_ms, 4),
            "eta_mem": self.eta_mem,
            "mfu": self.mfu,
            "budget_tokens": self.budget_tokens,
            "sources": [
                self.model.source,
                self.gpu.source,
                f"t_base: calibrated so one request with {CALIBRATION_CONTEXT} cached tokens decodes in "
                f"{CALIBRATION_TPOT_MS} ms (the article's low-load TPOT, 5.6-5.8 ms)",
                "eta_mem 0.7, MFU 0.4: assumptions",
                VLLM_BUDGET_SOURCE,
            ],
            "notes": "decode: t_base + (weights/TP + Σctx·kv_bytes_per_token/TP)/(BW·η_mem); prefill: t_base + "
            "(2·params·c + 4·layers·heads·head_dim·c·(k + c/2))/(TP·peak·MFU); a mixed step pays both; "
            "a step lasts max(real work, modelled)",
        }
