"""D's sampler held to P's first token, on vLLM's V1 logits processor interface (vLLM 0.32, 0.33).

Why apart: vLLM 0.34's model runner has another interface (`logits_v2`); `logits` loads the one
the installed vLLM has.  Here a processor sees each request's sampling params and its running
output list when it joins the batch (`BatchUpdate`): a request whose kvflow entry asks for P's
first token (`first_token.forced_token`), whose token D's rank took in (`first_token.FORCED`)
and whose output is still empty gets every logit but the token's set to -inf, until its output
has a token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

# vLLM 0.32 and 0.33 only (0.34, which the type check runs with, has none)
from vllm.v1.sample.logits_processor import (  # type: ignore[import-not-found,unused-ignore]
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

from kvflow.integrations.vllm.first_token import forced_token

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ("FirstTokenProcessorV1",)


class FirstTokenProcessorV1(LogitsProcessor):  # type: ignore[misc,unused-ignore]
    """Holds the first output position of requests whose first token came from P."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (P's token, the request's output tokens so far: vLLM's own list)
        self._rows: dict[int, tuple[int, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes what greedy sampling picks too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, _prompt, output in batch_update.added:
            self._rows.pop(index, None)
            token = forced_token(params.extra_args) if not output else None
            if token is not None:
                self._rows[index] = (token, output)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self._rows.pop(a, None), self._rows.pop(b, None)
            if row_a is not None:
                self._rows[b] = row_a
            if row_b is not None and direction is MoveDirectionality.SWAP:
                self._rows[a] = row_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        done = [index for index, (_, output) in self._rows.items() if output]
        for index in done:  # past its first position: left alone from now on
            del self._rows[index]
        for index, (token, _) in self._rows.items():
            if index < logits.shape[0] and 0 <= token < logits.shape[1]:
                logits[index].fill_(float("-inf"))
                logits[index, token] = 0.0
        return logits
