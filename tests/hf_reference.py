"""Greedy tokens from Hugging Face's own `generate`: the reference a real vLLM engine's output is
checked against.

Helpers, no tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def greedy(path: Path, prompt: list[int], steps: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt) :]]
