"""`FirstTokenProcessor`: vLLM's sampler on D held to the first token P sampled.

Why a logits processor: it is vLLM's own way to change what a request may draw, per request,
without patching vLLM.  D is started with it::

    vllm serve ... --logits-processors kvflow.integrations.vllm.logits:FirstTokenProcessor

For a request whose kvflow entry asks for P's first token and whose token D's rank took in
(`kvflow.integrations.vllm.first_token`), every logit but the token's is -inf at the request's
first sampled position: D samples P's token whatever its temperature, and, as it still draws its
random numbers for that position, a seeded request goes on as one engine's.  Every other
request, and every later position, is left alone.

vLLM has two interfaces for it, chosen by its model runner, not by its release: the V1 runner's
(`logits_v1`, vLLM 0.32 and 0.33; the CPU build runs it) and the V2 runner's (`logits_v2`, 0.32
to 0.34; 0.32 and 0.33 run it on a GPU where Triton is installed, 0.34 always).  So on a vLLM
that has both, the class is both (each runner's loader checks its own base), and each call goes
to the half of the runner that made it; on 0.34 it is `logits_v2`'s.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from kvflow.integrations.vllm.logits_v2 import FirstTokenProcessorV2

__all__ = ("FirstTokenProcessor",)

FirstTokenProcessor: type[Any] = FirstTokenProcessorV2
if importlib.util.find_spec("vllm.v1.sample.logits_processor") is not None:  # vLLM 0.32, 0.33
    import torch

    from kvflow.integrations.vllm.logits_v1 import FirstTokenProcessorV1

    class _EitherRunner(FirstTokenProcessorV1, FirstTokenProcessorV2):  # type: ignore[misc,unused-ignore]
        """V1's processor when the V1 runner builds it (with a device), V2's when V2's does."""

        def __init__(self, vllm_config: Any, *more: Any) -> None:
            if len(more) == 2:  # V1: (device, is_pin_memory)
                FirstTokenProcessorV1.__init__(self, vllm_config, *more)
            else:  # V2: (req_states)
                FirstTokenProcessorV2.__init__(self, vllm_config, *more)

        def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
            if ctx is None:
                return FirstTokenProcessorV1.apply(self, logits)  # type: ignore[no-any-return,unused-ignore]
            return FirstTokenProcessorV2.apply(self, logits, ctx)

    _EitherRunner.__name__ = _EitherRunner.__qualname__ = "FirstTokenProcessor"
    FirstTokenProcessor = _EitherRunner
