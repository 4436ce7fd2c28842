"""A stand-in for vLLM's engine core and model runner.

Around vLLM's own scheduler, KV cache planning and allocation, and connector hooks: what the
vLLM tests and `kvflow bench vllm` run.  `model` names the models and options, `build` the
config and KV cache specs, `kv` the bytes and the lagging device, `fabrics` the loopback
fabrics engines of one process share by name, `engine` the engine core's steps, `model_runner`
each rank's connector, KV caches and forward; `engine` says what is vLLM's and what is stood in
for.  `releases` absorbs where vLLM 0.33 and 0.34 differ for it, and
`platform` with `cpu_platform` give its engine processes vLLM's CPU platform."""

from kvflow_tools.standin.engine import SAMPLED, StandInEngine
from kvflow_tools.standin.kv import LaggingDevice, PagedKV
from kvflow_tools.standin.model import BACKENDS, FAMILIES, EngineOptions, ModelShape
from kvflow_tools.standin.model_runner import Rank

__all__ = (
    "BACKENDS",
    "FAMILIES",
    "SAMPLED",
    "EngineOptions",
    "LaggingDevice",
    "ModelShape",
    "PagedKV",
    "Rank",
    "StandInEngine",
)
