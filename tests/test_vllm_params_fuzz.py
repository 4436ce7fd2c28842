"""A live fuzz of ``kv_transfer_params`` through kvflow's connector, on vLLM's real scheduler.

Hostile params (`kvflow.testing.params_fuzz`) arrive at P and D, as any HTTP client of vLLM's
server may send them, while a genuine transfer runs between the same two engines.  Whatever
they hold, no engine crashes, every request ends (computed locally, or its load fails under
D's policy), the genuine request decodes from P's KV, and no block stays held.  Params that
are not a mapping at all never reach a scheduler through vLLM's OpenAI server (it admits only a
JSON object), and vLLM's scheduler raises on them itself; the connector's answer to them is
checked in `test_vllm_mapping.py`.
"""

from __future__ import annotations

import logging
import random

import pytest
from vllm.v1.request import RequestStatus

from kvflow.testing.params_fuzz import hostile_params, single_field_variants
from tests.vllm_pairs import dispatch, is_finished, kvflow_engine, make_pair, params, settle

RANDOM = 60  # random variants at P and at D each, after the sweep
TIMEOUT = {"transfer_timeout": 2.0}
UNSERVABLE = "kvflow cannot serve its kv_transfer_params"  # a hostile request only one side holds fails in 2 s


def test_hostile_kv_transfer_params_change_nothing_for_a_genuine_transfer(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="kvflow.vllm")
    p, d = make_pair(p_extra=TIMEOUT, d_extra=TIMEOUT)
    rng = random.Random(7)
    try:
        p_req, d_req = dispatch(p, d, "genuine", 70)
        hostile, sent = [], {}
        for engine, flag, tokens in ((d, "do_remote_prefill", 4), (p, "do_remote_decode", 1)):
            genuine = {flag: True, "kvflow": params(p, d, "TID")}
            # every value that broke engines before in each field of a transfer's parameters,
            # then random mutations of one to three fields
            crafted_all = single_field_variants(genuine)
            crafted_all += [hostile_params(genuine, rng, mappings_only=True) for _ in range(RANDOM)]
            for n, crafted in enumerate(crafted_all):
                kv = crafted.get("kvflow") if isinstance(crafted, dict) else None
                if isinstance(kv, dict) and kv.get("transfer_id") == "TID":
                    kv["transfer_id"] = f"h{n}"  # a transfer of its own, unless its id is the mutation
                rid = f"{engine.options.name}-h{n}"
                sent[rid] = crafted
                hostile.append(engine.add(rid, 20 + n % 40, tokens, crafted, tag=f"h{n}"))  # type: ignore[arg-type]
        settle((p, d), [p_req, d_req, *hostile], limit=120)
        assert d.checked[d_req.request_id] == 0  # the genuine request decoded from P's KV
        assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED and all(map(is_finished, hostile))
        # a D request that started decoding read P's KV of its own transfer, or had its params
        # refused (the stand-in then decodes pages nobody wrote; vLLM would compute them)
        refused = {
            r.getMessage().split(":")[0].removeprefix("request ")
            for r in caplog.records
            if UNSERVABLE in r.getMessage()
        }
        local = {rid for rid, crafted in sent.items() if not crafted.get("do_remote_prefill")}  # type: ignore[attr-defined]
        odd = {rid: sent.get(rid) for rid, bad in d.checked.items() if bad and rid not in refused | local}
        assert not odd, odd
        assert len(refused) > len(hostile) // 2  # most were refused where they entered, each named and logged
        for engine in (p, d):
            kv_engine = kvflow_engine(engine)
            assert kv_engine.crashed == [] and kv_engine.stats()["live_transfers"] == 0, engine.options.name
            assert kv_engine.peers() == [("decode" if engine is p else "prefill") + "-tp0"]
    finally:
        p.close()
        d.close()
