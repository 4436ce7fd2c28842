"""The compatibility matrix's Mamba rows: a hybrid of Mamba2 mixers and full attention, vLLM's
hybrid KV cache manager on (a group of each kind).

What moves for a Mamba group is its running-state block (the conv and SSM state, padded to the
attention page), once P's prefill is complete; P prefills all but the prompt's last token and D
computes that one itself, so that the state D starts from is the one before it.  The stand-in's
P writes a state pattern keyed by the tokens computed after every step, so D finds a stale
state (an earlier chunk's), a state that includes the last token, or another request's.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

from kvflow.errors import ConfigError
from kvflow.integrations.vllm import kv_caches
from kvflow.integrations.vllm.kv_caches import check_supported
from kvflow.layout.states import parse_split
from kvflow_tools.standin import EngineOptions, ModelShape, StandInEngine
from kvflow_tools.standin.build import vllm_config
from tests.vllm_compat_hybrid import moved_bytes, pulled, registered
from tests.vllm_compat_registry import refused_at_handshake, scenario
from tests.vllm_pairs import BLOCK_SIZE, kvflow_engine, make_pair, move_and_check

MAMBA = ModelShape(layers=4, layer_types=("mamba", "full_attention", "mamba", "full_attention"))
OPTIONS: dict[str, Any] = {"model": MAMBA, "num_blocks": 256, "kv_cache_layout": "LBHNC"}
PROMPTS = (7, 3 * BLOCK_SIZE + 7, 300)


def state_bytes(p: StandInEngine, prompt: int) -> int:
    """What P writes for one request: the attention layers' blocks of all but the prompt's last
    token, and each Mamba layer's running-state page (padded to the attention page)."""
    spec = kvflow_engine(p).layout.spec
    attention = sum(g.count for g in spec.groups if not g.state)
    states = sum(g.count for g in spec.groups if g.state)
    return int((-(-(prompt - 1) // BLOCK_SIZE) * attention + states) * spec.page_bytes)


def each_prompt(p: StandInEngine, d: StandInEngine, name: str, mode: str = "push") -> None:
    for prompt in PROMPTS:
        moved = moved_bytes(p, d, f"{name}-{prompt}", prompt, mode)
        assert moved == state_bytes(p, prompt), (prompt, moved, state_bytes(p, prompt))


@scenario("mamba")
def _mamba(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    p, d = make_pair(**OPTIONS)
    try:
        groups = [type(g.kv_cache_spec).__name__ for g in p.kv_cache_config.kv_cache_groups]
        assert groups == ["MambaSpec", "FullAttentionSpec"], groups
        assert kvflow_engine(p).layout.spec.kv_groups == "ssm*2,full*2"
        each_prompt(p, d, "mamba")
    finally:
        d.close()
        p.close()


@scenario("mamba-chunked")
def _chunked(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    """P's budget of 48 tokens: the full-attention blocks go out chunk by chunk, the state
    (rewritten by every chunk) only with the last one."""
    for options in ({"hook_order": "v1"}, {"hook_order": "v2", "async_scheduling": True}):
        p, d = make_pair(**OPTIONS, p_options={"max_num_batched_tokens": 48}, **options)
        try:
            each_prompt(p, d, f"chunks-{options['hook_order']}")
        finally:
            d.close()
            p.close()


@scenario("mamba-prefix")
def _prefix(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    """Prefix caching (vLLM's "align" mode: a state per block, kept at block boundaries) on D
    alone and on both: a prompt whose first two blocks D holds, state included, from an earlier
    request registers the attention blocks after them and its running-state block; the pages
    are keyed by their tokens, so those D's cache holds are checked too."""
    from tests.vllm_prefix import move, prompt

    for options in ({"d_options": {"prefix_caching": True}}, {"prefix_caching": True}):
        p, d = make_pair(**OPTIONS, **options)
        try:
            warm = prompt(2, 1, seed=21)  # D loads 64 tokens: its state is at a block boundary
            move(p, d, "warm", warm)
            move(p, d, "hit", prompt(9, 7, seed=22, shared=warm[: 2 * BLOCK_SIZE]))
            full, state = registered(d, "hit", 1), registered(d, "hit", 0)
            assert full == (2, 8) and state == (0, 1), (full, state)  # loads 294 tokens after a hit of 64
        finally:
            d.close()
            p.close()


@scenario("mamba-pull")
def _pull(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    pulled(each_prompt, **OPTIONS)


def sliced(p: StandInEngine, d: StandInEngine, name: str) -> None:
    """Every prompt moves between P and D of different tensor parallelism, each D rank's state
    exactly its shard (D checks it), and P's bytes are the attention blocks of D's heads and each
    state layer's whole state once: no padding, nothing twice."""
    spec = kvflow_engine(p).layout.spec
    split = parse_split(spec.state_split)
    assert split is not None and split.orientation == "sd", spec.state_split  # vLLM's default conv layout
    d_pages = sum(kvflow_engine(d, r).layout.spec.page_bytes for r in range(d.options.tensor_parallel))
    attention = sum(g.count for g in spec.groups if not g.state)
    states = sum(g.count for g in spec.groups if g.state)
    for prompt in PROMPTS:
        moved = moved_bytes(p, d, f"{name}-{prompt}", prompt)
        want = -(-(prompt - 1) // BLOCK_SIZE) * attention * d_pages + states * split.rank_bytes(1)
        assert moved == want, (prompt, moved, want)


@scenario("mamba-tp")
def _tensor_parallel(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    for p_tp, d_tp in ((1, 2), (2, 1), (2, 4)):
        p, d = make_pair(**OPTIONS, p_options={"tensor_parallel": p_tp}, d_options={"tensor_parallel": d_tp})
        try:
            sliced(p, d, f"tp{p_tp}{d_tp}")
        finally:
            d.close()
            p.close()
    # over real NIXL-UCX, each rank's engine in a process of its own: D checks every page
    p, d = make_pair("nixl", **OPTIONS, p_options={"tensor_parallel": 1}, d_options={"tensor_parallel": 2})
    try:
        for prompt in PROMPTS:
            d.checked.clear()
            move_and_check(p, d, f"nixl-tp12-{prompt}", prompt)
    finally:
        d.close()
        p.close()


@scenario("mamba-tp-replicated")
def _replicated_heads(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    """2 KV heads on 4 P ranks (each head on two of them), D on one: the attention KV comes
    from one replica of each head, the state from all four P ranks."""
    options = {**OPTIONS, "model": ModelShape(layers=4, kv_heads=2, layer_types=MAMBA.layer_types)}
    p, d = make_pair(**options, p_options={"tensor_parallel": 4}, d_options={"tensor_parallel": 1})
    try:
        sliced(p, d, "replicated")
        written = [e.counters.bytes_written for e in p.kvflow_engines()]
        assert all(written) and written[0] > written[1] and written[2] > written[3], written
    finally:
        d.close()
        p.close()


@scenario("mamba-tp-unsliced")
def _unsliced(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    """A state kvflow cannot slice (another kind of mixer, or one every rank holds whole) moves
    between equal tensor parallelism only."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_caches, "state_split", lambda *_: "")
        refused_at_handshake(fragment, caplog, **OPTIONS, d_options={"tensor_parallel": 2})


@scenario("mamba-only")
def _mamba_only(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    config = vllm_config(EngineOptions("prefill", "kv_producer"))
    mamba = MambaSpec(block_size=32, shapes=((4, 64),), dtypes=(torch.bfloat16,))
    kv_cache_config = KVCacheConfig(16, [], [KVCacheGroupSpec(["model.layers.0.mixer"], mamba)])
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        check_supported(config, kv_cache_config)
