"""`FirstTokenProcessor` on the installed vLLM's interface: P's token at the first sampled
position, nothing else anywhere else.

vLLM has two logits processor interfaces, one per model runner: V1's (vLLM 0.32 and 0.33) and
V2's (0.32 to 0.34).  The suite runs this file on 0.34 (the first stage: V2's) and on 0.33 (the
second: both), each time through every interface the installed vLLM has, as its runner would
drive the one class vLLM loads: a batch where one request asked for P's token and its token is
in D's table, beside one that did not ask and one that asked but has no token.  The held row
samples only P's token at its first position and is left alone afterwards; the others are never
touched.  A real D server runs it in `tests/real_first_token.py` (vLLM 0.32).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from kvflow.integrations.vllm.first_token import FORCED
from kvflow.integrations.vllm.logits import FirstTokenProcessor
from tests.vllm_params import entry

VOCAB = 16
# the interfaces of the installed vLLM's runners
RUNNERS = ["v1", "v2"] if importlib.util.find_spec("vllm.v1.sample.logits_processor") is not None else ["v2"]


def sampling(transfer_id: str, first_token: bool = True) -> SamplingParams:
    kv = {"do_remote_prefill": True, "kvflow": entry(transfer_id, first_token=first_token)}
    return SamplingParams(extra_args={"kv_transfer_params": kv})


def untouched() -> torch.Tensor:
    return torch.arange(3 * VOCAB, dtype=torch.float32).reshape(3, VOCAB)


class Batch:
    """Three requests at rows 0..2 (slots 5, 6, 7 with V2's), driven as `runner` drives them."""

    def __init__(self, runner: str, params: list[SamplingParams]) -> None:
        self.runner = runner
        self.outputs: list[list[int]] = [[] for _ in params]
        self.wanted: list[bool] = []
        self.slots = [5 + row for row in range(len(params))]
        if runner == "v1":
            from vllm.v1.sample.logits_processor import BatchUpdate  # type: ignore[import-not-found,unused-ignore]

            self.processor: Any = FirstTokenProcessor(None, torch.device("cpu"), False)
            added = [(row, p, [1, 2], self.outputs[row]) for row, p in enumerate(params)]
            self.processor.update_state(BatchUpdate(len(params), [], added, []))
        else:
            self.processor = FirstTokenProcessor(None, None)
            self.wanted = [self.processor.add_request(slot, p) for slot, p in zip(self.slots, params, strict=True)]

    def step(self) -> torch.Tensor:
        """One step's logits after the processor, then each request's output grows by a token."""
        logits = untouched()
        if self.runner == "v1":
            self.processor.update_state(None)
            out: torch.Tensor = self.processor.apply(logits)
        else:
            from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext

            slots = torch.tensor(self.slots)
            nothing = torch.zeros(3, dtype=torch.int64)
            ctx = LogitsContext(slots, slots, np.array(self.slots), nothing, nothing, nothing, np.full(3, 3))
            out = self.processor.apply(logits, ctx)
        for row, output in enumerate(self.outputs):
            output.append(int(out[row].argmax()))
        return out


@pytest.mark.parametrize("runner", RUNNERS)
def test_only_the_held_row_samples_ps_token_and_only_at_its_first_position(runner: str) -> None:
    FORCED.put("held", 9)
    batch = Batch(runner, [sampling("plain", first_token=False), sampling("held"), sampling("no token")])
    assert batch.wanted == ([False, True, False] if runner == "v2" else [])
    first = batch.step()
    assert torch.equal(first[0], untouched()[0]) and torch.equal(first[2], untouched()[2])
    assert first[1, 9] == 0.0 and int(first[1].argmax()) == 9
    assert torch.isinf(first[1]).sum() == VOCAB - 1
    assert torch.softmax(first[1], 0)[9] == 1.0  # at any temperature: the one token left
    assert torch.equal(batch.step(), untouched())  # later positions: left alone
    assert FORCED.take("held") is None  # the processor took it


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_request_that_did_not_ask_is_never_given_a_token_left_in_the_table(runner: str) -> None:
    FORCED.put("plain", 3)
    batch = Batch(
        runner, [sampling("plain", first_token=False), sampling("x", first_token=False), sampling("y", False)]
    )
    assert torch.equal(batch.step(), untouched())
    assert FORCED.take("plain") == 3
