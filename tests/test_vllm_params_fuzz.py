"""A live fuzz of ``kv_transfer_params`` through kvflow's connector, on vLLM's real scheduler.

Hostile params (`kvflow_tools.testing.params_fuzz`: every value that once broke an engine, in every
field of a transfer's params, then random mutations) arrive at P and D, as any HTTP client of
vLLM's server may send them, in batches with genuine transfers between the same two engines
(`kvflow_tools.testing.params_soak`; `kvflow soak --fuzz` runs it at scale).  Whatever they
hold, no engine crashes, every request ends (computed locally, or its load fails under D's
policy), every genuine request decodes from P's KV and nothing else from KV it was not sent, no
block stays held, and each engine keeps exactly its one association.  Params that are not a
mapping at all never reach a scheduler through vLLM's OpenAI server (it admits only a JSON
object), and vLLM's scheduler raises on them itself; the connector's answer to them is checked
in `test_vllm_mapping.py`.  On the code before this fuzz, P ended associated with itself.
"""

from __future__ import annotations

import json
import random

import pytest

from kvflow_tools.testing.params_fuzz import HOSTILE_VALUES, hostile_params
from kvflow_tools.testing.params_soak import run_params_soak


@pytest.mark.system
def test_hostile_kv_transfer_params_change_nothing_for_genuine_transfers() -> None:
    # few batches, each waiting out a deadline long enough that a genuine transfer amid one
    # meets it however loaded the machine (they take about 0.1 s where it is quiet)
    report = run_params_soak(60, seed=7, genuine_every=200, transfer_timeout=8.0)
    assert report.ok, report.as_dict()
    assert report.genuine >= 8 and report.genuine_ok == report.genuine
    assert report.refused > report.hostile // 2  # most were refused where they entered, each logged


def test_the_hostile_params_are_json_and_leave_the_table_of_values_as_it_was() -> None:
    """What a client sends is JSON text: a variant nesting a value in itself cannot be sent at
    all, and one that changed the shared table of values would change every later variant."""
    table = repr(HOSTILE_VALUES)
    genuine = {"do_remote_prefill": True, "kvflow": {"transfer_id": "t", "epoch": 1, "mode": "push"}}
    rng = random.Random(11)
    for _ in range(3000):
        json.dumps(hostile_params(genuine, rng))  # ValueError on a circular reference
    assert repr(HOSTILE_VALUES) == table
