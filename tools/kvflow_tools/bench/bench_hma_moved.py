"""What kvflow really moves per request for a hybrid model, its hybrid KV cache manager on and off.

Why beside `bench_hma`: that module reads what vLLM's KV cache manager keeps of each group;
this one runs a prefill and a decode engine of the model (vLLM's scheduler, planning and
allocation in kvflow's stand-in, kvflow's connector on both, the loopback transport moving real
bytes, every page D holds checked) and counts the bytes P's WRITEs carried for each prompt.
The model keeps its layers, their kinds and its window, with one KV head of 64 values (so that
a 62-layer model fits in memory): bytes are counted in block-layers (one block of one layer) and
also given at the real model's page size.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

__all__ = ("moved",)

_fabrics = itertools.count()


def moved(
    model: Any, tokens: list[int], block: int, hybrid: bool, groups: int, limit: float = 300.0
) -> list[dict[str, Any]]:
    """Per prompt length: the block-layers P wrote, with vLLM's hybrid manager on (`hybrid`,
    `groups` KV cache groups) or off.  `model` is a `bench_hma.HybridModel`.

    Raises:
        RuntimeError: a request did not finish within `limit` seconds, D read a page that does
            not hold P's KV, or D's request did not end as decoded.
    """
    from vllm.v1.request import RequestStatus

    from kvflow_tools.standin import EngineOptions, ModelShape, StandInEngine

    types = tuple("full_attention" if model.is_full(i) else "sliding_attention" for i in range(model.layers))
    shape = ModelShape(
        family="gemma2", layers=model.layers, kv_heads=1, head_dim=64, layer_types=types, sliding_window=model.window
    )
    longest = max(tokens) + block
    per_request = -(-longest // block) * (groups if hybrid else 1)  # a block table per group, from one pool
    options: dict[str, Any] = {
        "model": shape,
        "block_size": block,
        "num_blocks": per_request + 16,
        "max_model_len": longest,
        "max_num_batched_tokens": longest,
        "hybrid_kv_cache_manager": hybrid,
    }
    extra = {"transport": "loopback", "fabric": f"hma-{next(_fabrics)}", "port": 0, "push_group_bytes": 0}
    p = StandInEngine(EngineOptions("prefill", "kv_producer", extra, **options))
    d: Any = None
    try:
        d = StandInEngine(EngineOptions("decode", "kv_consumer", extra, **options))
        rows = []
        for n in tokens:
            before = sum(e.counters.bytes_written for e in p.kvflow_engines())
            counted = _costs(p, d)
            kv = {
                "transfer_id": f"hma-{n}",
                "epoch": 1,
                "mode": "push",
                "prefill": {"engine": "prefill", "address": p.worker.control_address},
                "decode": {"engine": "decode", "address": d.worker.control_address},
            }
            d_req = d.add(f"d-{n}", n, 2, {"do_remote_prefill": True, "kvflow": kv}, tag=f"hma-{n}")
            p.add(f"p-{n}", n, 1, {"do_remote_decode": True, "kvflow": kv}, tag=f"hma-{n}")
            deadline = time.monotonic() + limit
            while p.busy() or d.busy():
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{model.name}, {n} tokens: not done within {limit}s\n{p.describe()}\n{d.describe()}"
                    )
                for engine in (p, d):
                    if engine.busy():
                        engine.step()
                time.sleep(0.001)
            if d.checked.get(d_req.request_id) != 0 or d_req.status != RequestStatus.FINISHED_LENGTH_CAPPED:
                raise RuntimeError(f"{model.name}, {n} tokens: D read {d.checked} bad pages, ended {d_req.status}")
            written = sum(e.counters.bytes_written for e in p.kvflow_engines()) - before
            page = next(iter(p.kvflow_engines())).layout.spec.page_bytes
            transfers, frames = (after - was for after, was in zip(_costs(p, d), counted, strict=True))
            rows.append(
                {
                    "tokens": n,
                    "bytes": written,
                    "block_layers": written // page,
                    "transfers": transfers,  # P's, one per KV cache group
                    "control_frames": frames,  # sent by P and D together
                }
            )
        return rows
    finally:
        if d is not None:
            d.close()
        p.close()


def _costs(p: Any, d: Any) -> tuple[int, int]:
    """(transfers P completed, control frames P and D sent) so far."""
    transfers = sum(int(e.stats()["completed"]) for e in p.kvflow_engines())
    frames = sum(int(e.control.counters.get("frames_sent", 0)) for s in (p, d) for e in s.kvflow_engines())
    return transfers, frames
