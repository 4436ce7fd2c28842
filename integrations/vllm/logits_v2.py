"""D's sampler held to P's first token, on vLLM 0.34's model runner (its V2 logits processor interface).

Why apart: vLLM 0.32 and 0.33 have another interface (`logits_v1`); `logits` loads the one the
installed vLLM has.  Here a request joins a persistent slot (`add_request`, with its sampling
params) and each step's `apply` sees the whole batch's logits, a row per token sampled, with
the slot of each row (``ctx.expanded_idx_mapping``, on the device; ``ctx.idx_mapping_np``, the
slots in the batch, on the host).  A request whose kvflow entry asks for P's first token
(`first_token.forced_token`) and whose token D's rank took in (`first_token.FORCED`) is held
in its slot until the first step that samples it: D computes the prompt's last token after its
KV landed and samples the first output token in that step.  Its rows then get every logit but
the token's set to -inf, with device operations only (no sync), and the slot is let go.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor

from kvflow.integrations.vllm.first_token import forced_token

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext, LogitsProcRequestState

__all__ = ("FirstTokenProcessorV2",)


class FirstTokenProcessorV2(LogitsProcessor):
    """Holds the first sampled position of requests whose first token came from P."""

    def __init__(self, vllm_config: VllmConfig, req_states: LogitsProcRequestState) -> None:
        self._held: dict[int, int] = {}  # slot -> P's token, until the slot's first sampling step

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        self._held.pop(req_idx, None)  # a recycled slot: nothing of its last occupant
        token = forced_token(sampling_params.extra_args)
        if token is None:
            return False
        self._held[req_idx] = token
        return True

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if not self._held:
            return logits
        in_batch = set(ctx.idx_mapping_np.tolist())
        for slot in [slot for slot in self._held if slot in in_batch]:
            token = self._held.pop(slot)
            if not 0 <= token < logits.shape[1]:
                continue
            rows = ctx.expanded_idx_mapping == slot
            kept = logits[:, token].clone()
            logits.masked_fill_(rows.unsqueeze(1), float("-inf"))
            logits[:, token] = torch.where(rows, torch.zeros_like(kept), kept)
        return logits
