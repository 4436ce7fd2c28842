"""The compatibility matrix's router rows: how routers hand requests to P and D.

A sequential router (vLLM's toy proxy, llm-d, Dynamo) sends P vLLM's own params and hands P's
answer to D; kvflow's router sends both legs at once with one kvflow entry; a D handed another
connector's params says so instead of silently computing the prompt again.
"""

from __future__ import annotations

import logging

import pytest
from vllm.v1.request import RequestStatus

from tests.vllm_compat_registry import moves, scenario
from tests.vllm_pairs import consecutive_free_ports, make_pair, sequential_move, settle


@scenario("router-sequential")
def _sequential(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    p, d = make_pair(p_extra={"port": consecutive_free_ports(1)})
    try:
        sequential_move(p, d, "toy-proxy", 100)
        assert p.connector._book.counters["assigned"] == 1
    finally:
        d.close()
        p.close()


@scenario("router-concurrent")
def _concurrent(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    moves("concurrent")


@scenario("params-foreign")
def _foreign(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    p, d = make_pair()
    answer = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p", "remote_block_ids": [1]}
    try:
        with caplog.at_level(logging.ERROR, logger="kvflow.vllm"):
            d_req = d.add("d-foreign", 70, 4, answer)
            settle((d,), [d_req])
        assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED  # computed locally
        assert d.connector._book.counters["unservable"] == 1
        assert fragment in caplog.text and "request d-foreign" in caplog.text, caplog.text
    finally:
        d.close()
        p.close()
