"""What differs between the vLLM releases the connector supports (`kvflow.integrations.vllm.releases`,
and the book's answer to vLLM 0.34's `may_load_async`), on whichever release runs the tests:
scripts/test runs this file with vLLM 0.34 and with 0.33.

- how kvflow reaches the KV cache, per memory kind;
- `may_load_async` agrees with `get_num_new_matched_tokens` on every params a client can send,
  and asks nothing of the book (no log, no count);
- a prompt P shortens (Mamba hand-over) keeps no block hash of a block it no longer fills: the
  block its output token fills is hashed from its real tokens, as for a request that had the
  shortened prompt from the start.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.v1.request import Request

from kvflow.integrations.vllm.mapping import SchedulerBook
from kvflow.integrations.vllm.releases import cache_access, drop_prompt_tail, skips_external_kv
from kvflow_tools.testing.params_fuzz import hostile_params
from tests.vllm_params import BLOCK_SIZE, d_params, entry, p_params

PROMPT = 40


def test_gpu_caches_are_registered_and_shared_by_legacy_ipc_and_host_caches_ask_nothing() -> None:
    assert cache_access(gpu=True) == ("REGISTERS", "LEGACY_IPC")
    assert cache_access(gpu=False) == ()


def _answers(book: SchedulerBook, params: object, request_id: str = "r") -> tuple[bool, bool]:
    may = book.may_load(request_id, params)
    matched = book.matched_tokens(request_id, params, PROMPT, 0)  # type: ignore[arg-type]
    return may, matched[1]


def test_may_load_async_answers_as_get_num_new_matched_tokens_does_for_every_params() -> None:
    genuine = d_params(entry())
    cases: list[object] = [genuine, p_params(entry()), None, {}, "do_remote_prefill", {"do_remote_prefill": True}]
    cases += [{**genuine, "do_remote_decode": True}, {**genuine, "do_remote_prefill": ""}, d_params(entry(epoch=-1))]
    rng = random.Random(5)
    cases += [hostile_params(genuine, rng) for _ in range(1500)]
    loads = 0
    for index, params in enumerate(cases):
        book = SchedulerBook(BLOCK_SIZE, False)
        may, matched = _answers(book, params, f"r{index}")
        assert may is matched, params
        loads += may
    assert 1 <= loads < len(cases) // 2  # both answers met, most hostile params refused


def test_may_load_async_is_silent_and_no_after_the_load_was_ordered() -> None:
    book = SchedulerBook(BLOCK_SIZE, False)
    counted = dict(book.counters)
    for params in ({"do_remote_prefill": True}, d_params(entry(epoch=-1)), "text"):
        assert book.may_load("r", params) is False
    assert dict(book.counters) == counted  # matched_tokens counts what it refuses; this does not
    genuine = d_params(entry())
    assert book.may_load("r", genuine) is True
    blocks = [list(range(-(-PROMPT // BLOCK_SIZE)))]
    book.allocated("r", genuine, PROMPT, blocks, PROMPT)  # D registers its blocks: the one load
    assert book.may_load("r", genuine) is False
    assert book.matched_tokens("r", genuine, PROMPT, 0) == (0, False)


def test_a_peer_outside_the_allow_list_may_not_load_either() -> None:
    from kvflow.protocol.admission import PeerAllowList

    book = SchedulerBook(BLOCK_SIZE, False, allowed=PeerAllowList(("other-*",), ("10.0.0.0/8",)))
    assert _answers(book, d_params(entry())) == (False, False)


def _hashed(tokens: list[int], sampling: SamplingParams | None = None) -> Request:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    sampling = sampling or SamplingParams(max_tokens=8)
    sampling.extra_args = {"kv_transfer_params": {"do_remote_decode": True}}
    return Request("r", list(tokens), sampling, None, block_hasher=hasher)


def _append(request: Request, token: int) -> None:
    """An output token, as vLLM's scheduler appends one (the block hasher then runs)."""
    request.append_output_token_ids(token)


@pytest.mark.parametrize("dropped", [1, 3])
def test_a_shortened_prompt_keeps_no_stale_block_hash(dropped: int) -> None:
    prompt = list(range(100, 100 + 3 * BLOCK_SIZE))  # three full blocks: three hashes
    request = _hashed(prompt)
    assert len(request.block_hashes) == 3
    drop_prompt_tail(request, dropped, BLOCK_SIZE)
    assert request.num_prompt_tokens == request.num_tokens == len(prompt) - dropped
    assert request.max_tokens == 1
    assert len(request.block_hashes) == 2  # the third block is no longer full
    for token in range(7, 7 + dropped):
        _append(request, token)  # P's output fills the third block with other tokens
    fresh = _hashed(prompt[:-dropped] + list(range(7, 7 + dropped)))
    assert request.block_hashes == fresh.block_hashes  # hashed from the tokens it now holds


def test_a_request_for_prompt_logprobs_skips_external_kv() -> None:
    plain: Any = _hashed(list(range(10)))
    logprobs: Any = _hashed(list(range(10)), SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert not skips_external_kv(plain)
    assert skips_external_kv(logprobs)


def test_the_vllm_extra_the_code_and_the_matrix_name_one_range() -> None:
    import tomllib
    from pathlib import Path

    from kvflow.integrations.vllm.releases import SUPPORTED_VLLM

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{SUPPORTED_VLLM}"]
    matrix = (root / "docs" / "vllm-compatibility.md").read_text()
    assert f"`kvflow's connector supports vLLM {SUPPORTED_VLLM}`" in matrix
