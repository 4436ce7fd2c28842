"""The compatibility matrix's prefix-caching rows: D with prefix caching on (vLLM's default).

Each row runs one scenario of `tests.vllm_prefix` on vLLM's real Scheduler with synchronous
scheduling (tests/test_vllm_prefix.py runs them with async scheduling).
"""

from __future__ import annotations

from collections.abc import Callable

from kvflow_tools.standin import StandInEngine
from tests.vllm_compat_registry import SCENARIOS, bound
from tests.vllm_prefix import full_hit, pair, partial_hit, shared_in_flight


def _on_a_pair(run: Callable[[StandInEngine, StandInEngine], None]) -> None:
    p, d = pair()
    try:
        run(p, d)
    finally:
        d.close()
        p.close()


SCENARIOS["prefix-caching-decode"] = bound(_on_a_pair, run=partial_hit)
SCENARIOS["prefix-hit-full"] = bound(_on_a_pair, run=full_hit)
SCENARIOS["prefix-shared-in-flight"] = bound(_on_a_pair, run=shared_in_flight)
