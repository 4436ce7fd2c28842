"""The stand-in engine paced by the step-time model: what each step's batch is, how long the
model says it takes, and what the engine's KV cache and queues look like after it.

Why apart from `timing`: the model is pure arithmetic over rows; this module reads vLLM's
scheduler output and scheduler (the batch of a step, its block pool, its queues) to feed it and
to report each step, and `StandInEngine` only asks it for a step's duration and hands it the
step's measured time.
"""

from __future__ import annotations

from typing import Any

from kvflow.integrations.vllm.standin.timing import Row, StepModel

__all__ = ("Pacer", "rows_of")


def rows_of(so: Any, requests: dict[str, Any]) -> list[Row]:
    """The step's rows: each scheduled request's cached and new tokens (the scheduler has already
    advanced ``num_computed_tokens`` by the scheduled count)."""
    rows = []
    for request_id, count in so.num_scheduled_tokens.items():
        request = requests[request_id]
        cached = request.num_computed_tokens - count
        rows.append(Row(cached, count, decode=cached >= request.num_prompt_tokens))
    return rows


class Pacer:
    """One engine's pacing: the modelled duration of each step and a report of it."""

    def __init__(self, model: StepModel, budget_tokens: int, block_size: int) -> None:
        self.model = model
        self.budget_tokens = budget_tokens
        self.block_size = block_size
        self.firsts: list[str] = []

    def plan(self, so: Any, scheduler: Any) -> float:
        """The modelled milliseconds of the step that runs `so`; `firsts` becomes the requests
        whose first token it samples (the chunk that ends their prompt)."""
        rows = rows_of(so, scheduler.requests)
        self.firsts = [
            request_id
            for request_id, row in zip(so.num_scheduled_tokens, rows, strict=True)
            if not row.decode and row.cached + row.new >= scheduler.requests[request_id].num_prompt_tokens
        ]
        return self.model.step_ms(rows)

    def report(self, scheduler: Any, modelled_ms: float, real_ms: float) -> dict[str, Any]:
        """The step as the benchmark records it: blocks used of the total, queue lengths, the
        modelled and real (work, not waiting) milliseconds, whether the real work overran the
        model, and whether admission is stalled (a request waits and the head of the queue needs
        more free blocks than there are)."""
        pool = scheduler.kv_cache_manager.block_pool
        free = int(pool.get_num_free_blocks())
        running, waiting = scheduler.get_request_counts()
        stalled = False
        if scheduler.waiting:
            head = scheduler.waiting.peek_request()
            tokens = min(head.num_tokens - head.num_computed_tokens, self.budget_tokens)
            stalled = free < -(-tokens // self.block_size)
        total = int(pool.num_gpu_blocks) - 1  # vLLM's null block is never free, nor anyone's
        return {
            "used": total - free,
            "total": total,
            "waiting": waiting,
            "running": running,
            "model_ms": round(modelled_ms, 4),
            "real_ms": round(real_ms, 4),
            "over": real_ms > modelled_ms > 0,
            "stall": stalled,
        }
