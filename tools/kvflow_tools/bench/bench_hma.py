"""`kvflow bench hma`: the KV bytes P moves per request for a hybrid model.

With vLLM's hybrid KV cache manager on (kvflow's connector declares `SupportsHMA`) and off
(``--disable-hybrid-kv-cache-manager``).

Why: with the manager off every sliding-window layer keeps, and kvflow moves, the KV of every
prompt token.  This measures the difference on vLLM's own code rather than on arithmetic: the
layers' specs are planned by vLLM's `get_global_kv_cache_groups` / `get_kv_cache_configs`
(hybrid manager on, then off), and a prompt of N tokens is prefilled through vLLM's
`KVCacheManager.allocate_slots` (in one step or in chunks, as the scheduler would), then its
out-of-window blocks are freed with
`remove_skipped_blocks` and its block ids read with `get_block_ids_for_computed_tokens`, exactly
as `Scheduler._connector_finished` does before it hands them to a connector.  The bytes moved
with HMA are each group's non-null blocks x that group's layers x its page bytes; the list vLLM's
NIXL connector would send is also shown (`get_exchange_clipped_blocks`, which keeps the last
ceil(window/block) + 1 entries of a sliding-window group, a null one among them when the window's
first block was freed).  The models are geometries, not weights: attention layers only.  With
``--moved`` kvflow also moves each prompt between a P and a D of the model, the manager on and
off (`bench_hma_moved`), and the block-layers P wrote are shown beside what vLLM keeps.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ("MODELS", "HybridModel", "add_arguments", "main", "measure", "render")

BLOCK = 16
DEFAULT_TOKENS = (1024, 4096, 16384, 32768)


@dataclass(frozen=True)
class HybridModel:
    """The attention geometry of a hybrid model: which layers slide, over how many tokens."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    window: int
    full_every: int  # layer i is full attention when (i + 1) % full_every == 0
    note: str

    def is_full(self, layer: int) -> bool:
        return (layer + 1) % self.full_every == 0


MODELS = {
    model.name: model
    for model in (
        # Gemma 3 27B: 62 layers, 16 KV heads of 128, sliding window 1024, 5 sliding : 1 full
        HybridModel("gemma3-27b", 62, 16, 128, 1024, 6, "Gemma 3 27B: 62 layers, 16 KV heads x 128, 5 SWA(1024):1"),
        # gpt-oss-120b: 36 layers, 8 KV heads of 64, sliding window 128 and full in turn
        HybridModel("gpt-oss-120b", 36, 8, 64, 128, 2, "gpt-oss-120b: 36 layers, 8 KV heads x 64, SWA(128)/full"),
    )
}


def _specs(model: HybridModel) -> dict[str, Any]:
    """The KV cache spec each attention layer declares (as vLLM's Attention layer builds it)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common: dict[str, Any] = {
        "block_size": BLOCK,
        "num_kv_heads": model.kv_heads,
        "head_size": model.head_dim,
        "dtype": torch.bfloat16,
    }
    return {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(**common)
        if model.is_full(i)
        else SlidingWindowSpec(sliding_window=model.window, **common)
        for i in range(model.layers)
    }


def _config(max_tokens: int, blocks: int) -> Any:
    from kvflow_tools.standin.build import vllm_config
    from kvflow_tools.standin.model import EngineOptions

    length = max_tokens + BLOCK
    options = EngineOptions(
        name="hma",
        role="kv_both",
        kv_cache_layout="NHD",
        max_model_len=length,
        max_num_batched_tokens=length,
        num_blocks=blocks,
        prefix_caching=False,
    )
    return vllm_config(options)


def _plan(config: Any, specs: dict[str, Any], hybrid: bool) -> Any:
    """vLLM's KV cache config for these layers, its hybrid manager on or off."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    config.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
    groups = get_global_kv_cache_groups(config, [specs])
    [kv_cache_config] = get_kv_cache_configs(config, [specs], [1 << 44], groups)
    return kv_cache_config


def _nixl_blocks_per_window(kv_cache_config: Any) -> list[int]:
    """What vLLM's NIXL connector keeps of each group's list (NixlBaseConnectorScheduler.__init__)."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return [
        cdiv(g.kv_cache_spec.sliding_window, g.kv_cache_spec.block_size) + 1
        if isinstance(g.kv_cache_spec, SlidingWindowSpec)
        else 0
        for g in kv_cache_config.transfer_groups
    ]


def _prefill(config: Any, kv_cache_config: Any, tokens: int, chunk: int) -> tuple[list[list[int]], int]:
    """Prefill one prompt through vLLM's KVCacheManager; its block ids per group as the
    scheduler hands them to a connector when the request finishes, and the null block's id."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

    manager = KVCacheManager(
        kv_cache_config,
        max_model_len=config.model_config.max_model_len,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=False,
    )
    request = Request("hma", list(range(tokens)), SamplingParams(max_tokens=1), None)
    step = chunk or tokens
    while request.num_computed_tokens < tokens:  # one allocate_slots per scheduled chunk
        new = min(step, tokens - request.num_computed_tokens)
        if manager.allocate_slots(request, new) is None:
            raise RuntimeError(f"vLLM's KV cache manager could not allocate {new} tokens of {tokens}")
        request.num_computed_tokens += new
    # what Scheduler._connector_finished does before request_finished(_all_groups)
    manager.remove_skipped_blocks(request.request_id, tokens, num_prompt_tokens=tokens)
    ids = manager.get_block_ids_for_computed_tokens(request.request_id, tokens)
    null = manager.block_pool.null_block.block_id
    return [list(group) for group in ids], null


def _nixl_lists(kv_cache_config: Any, ids: list[list[int]]) -> list[list[int]]:
    """The per-group lists vLLM's NIXL connector puts in remote_block_ids (its own method)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler

    state = SimpleNamespace(
        kv_cache_config=kv_cache_config,
        _is_hma_required=True,
        blocks_per_sw=_nixl_blocks_per_window(kv_cache_config),
        _ssm_spec_blocks=[None] * len(ids),
    )
    return [list(g) for g in NixlBaseConnectorScheduler.get_exchange_clipped_blocks(state, tuple(ids))]  # type: ignore[arg-type]


def _groups(kv_cache_config: Any, ids: list[list[int]], null: int) -> list[dict[str, Any]]:
    rows = []
    for group, blocks in zip(kv_cache_config.kv_cache_groups, ids, strict=True):
        spec = group.kv_cache_spec
        kept = [b for b in blocks if b != null]
        rows.append(
            {
                "kind": type(spec).__name__,
                "window": getattr(spec, "sliding_window", None),
                "layers": len(group.layer_names),
                "page_bytes": spec.page_size_bytes,
                "blocks": len(blocks),
                "kept_blocks": len(kept),
                "null_blocks": len(blocks) - len(kept),
                "bytes": len(kept) * len(group.layer_names) * spec.page_size_bytes,
            }
        )
    return rows


def measure(model: HybridModel, tokens: list[int], chunk: int = 0, moved: bool = False) -> list[dict[str, Any]]:
    """One row per prompt length: blocks per group after prefill and bytes moved, HMA on and off;
    with `moved`, also the block-layers kvflow's P wrote for it each way (`bench_hma_moved`).

    Raises:
        ValueError: a prompt length below 1 or a chunk below 0.
        RuntimeError: vLLM's manager could not allocate the prompt.
    """
    if not tokens or min(tokens) < 1 or chunk < 0:
        raise ValueError(f"prompt lengths must be at least 1 and the chunk at least 0, not {tokens}, {chunk}")
    specs = _specs(model)
    blocks = (model.layers + 1) * math.ceil(max(tokens) / BLOCK) + 16  # room for every group
    config = _config(max(tokens), blocks)
    on, off = _plan(config, specs, hybrid=True), _plan(config, specs, hybrid=False)
    rows = []
    for n in tokens:
        ids, null = _prefill(config, on, n, chunk)
        nixl = _nixl_lists(on, ids)
        groups = _groups(on, ids, null)
        for group, sent in zip(groups, nixl, strict=True):
            group["nixl_list"] = len(sent)
            group["nixl_list_nulls"] = sum(1 for b in sent if b == null)
        off_ids, off_null = _prefill(config, off, n, chunk)
        off_groups = _groups(off, off_ids, off_null)
        hma, whole = sum(g["bytes"] for g in groups), sum(g["bytes"] for g in off_groups)
        rows.append(
            {
                "model": model.name,
                "tokens": n,
                "block_size": BLOCK,
                "chunk": chunk,
                "groups": groups,
                "groups_hma_off": off_groups,
                "bytes_hma": hma,
                "bytes_hma_off": whole,
                "ratio": whole / hma,
            }
        )
    if moved:
        from kvflow_tools.bench.bench_hma_moved import moved as kvflow_moved

        count = len(on.kv_cache_groups)
        each_way = [kvflow_moved(model, tokens, BLOCK, hybrid, count) for hybrid in (True, False)]
        for row, hma_row, off_row in zip(rows, *each_way, strict=True):
            for suffix, moved_row in (("hma", hma_row), ("hma_off", off_row)):
                row[f"moved_block_layers_{suffix}"] = moved_row["block_layers"]
                row[f"moved_transfers_{suffix}"] = moved_row["transfers"]
                row[f"moved_control_frames_{suffix}"] = moved_row["control_frames"]
    return rows


def _summary(groups: list[dict[str, Any]]) -> str:
    """'6 SWA(1024) x 8-9 layers: 64 kept (nixl 65); 1 full x 10: 256'."""
    parts: dict[tuple[Any, int, int], list[int]] = {}
    for g in groups:
        parts.setdefault((g["window"], g["kept_blocks"], g.get("nixl_list", 0)), []).append(g["layers"])
    out = []
    for (window, kept, nixl), layers in parts.items():
        name = f"SWA({window})" if window else "full"
        span = f"{min(layers)}-{max(layers)}" if min(layers) != max(layers) else f"{layers[0]}"
        sent = f" (nixl {nixl})" if window else ""
        out.append(f"{len(layers)} {name} x {span}: {kept}{sent}")
    return "; ".join(out)


def render(rows: list[dict[str, Any]]) -> str:
    """The table: per model and prompt length, MiB moved each way, their ratio, blocks per group."""
    head = f"{'model':13} {'tokens':>7} {'MiB HMA':>9} {'MiB off':>9} {'off/HMA':>8}  blocks kept per group (HMA on)"
    body = [
        f"{r['model']:13} {r['tokens']:>7,} {r['bytes_hma'] / 2**20:>9,.1f} {r['bytes_hma_off'] / 2**20:>9,.1f} "
        f"{r['ratio']:>7.2f}x  {_summary(r['groups'])}"
        for r in rows
    ]
    moved = [r for r in rows if "moved_block_layers_hma" in r]
    if moved:
        body += [
            "",
            "kvflow's P wrote (block-layers: one block of one layer; vLLM's kept count beside), and what",
            "it took (transfers; control frames P and D sent):",
        ]
        body += [
            f"{r['model']:13} {r['tokens']:>7,}  HMA on {r['moved_block_layers_hma']:>7,} (kept "
            f"{_kept(r['groups']):,}), {r['moved_transfers_hma']} transfers, {r['moved_control_frames_hma']} frames;"
            f"  off {r['moved_block_layers_hma_off']:>7,} (kept {_kept(r['groups_hma_off']):,}), "
            f"{r['moved_transfers_hma_off']} transfer, {r['moved_control_frames_hma_off']} frames"
            for r in moved
        ]
    return "\n".join([head, *body]) + "\n"


def _kept(groups: list[dict[str, Any]]) -> int:
    """Block-layers vLLM keeps of a request: each group's kept blocks times its layers."""
    return sum(g["kept_blocks"] * g["layers"] for g in groups)


def main(
    models: list[str], tokens: list[int], chunk: int = 0, json_path: str | None = None, moved: bool = False
) -> int:
    """Print one row per model and prompt length; write every row to `json_path` if given.

    Raises:
        ValueError: an unknown model name, or a bad prompt length or chunk (see `measure`).
        RuntimeError: vLLM's manager could not allocate a prompt.
    """
    logging.getLogger("vllm").setLevel(logging.ERROR)  # its notices on the hybrid manager, per plan
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        raise ValueError(f"models must be among {sorted(MODELS)}, not {unknown}")
    rows = [row for name in models for row in measure(MODELS[name], tokens, chunk, moved)]
    sys.stdout.write(render(rows))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated, among {', '.join(MODELS)} (default: all)",
    )
    parser.add_argument(
        "--tokens",
        default=",".join(str(n) for n in DEFAULT_TOKENS),
        help="prompt lengths, comma-separated (default 1024,4096,16384,32768)",
    )
    parser.add_argument("--chunk", type=int, default=0, help="prefill in chunks of this many tokens (0: one step)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument(
        "--moved",
        action="store_true",
        help="also move each prompt with kvflow between a P and a D of the model (1 KV head of 64), manager on and off",
    )
