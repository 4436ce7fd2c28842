"""Sequential routers (vLLM's toy proxy, llm-d, Dynamo) on vLLM's real Scheduler (stand-in).

Such a router sends P ``do_remote_decode`` with vLLM's ``remote_*`` fields None and no kvflow
entry, then hands P's answer to D.  P assigns the transfer itself and holds its KV; D pulls.
Without that, D would silently compute the whole prompt again.
"""

from __future__ import annotations

import logging

import pytest
from vllm.v1.request import RequestStatus

from kvflow.integrations.vllm.mapping import Blocks, SchedulerBook
from kvflow.integrations.vllm.params import PeerRef
from kvflow.protocol.state import Mode
from kvflow_tools.standin import EngineOptions, StandInEngine
from tests.vllm_pairs import (
    TOY_PROXY_P_PARAMS,
    consecutive_free_ports,
    is_finished,
    kvflow_engine,
    make_pair,
    run,
    sequential_move,
    sequential_prefill,
    settle,
)


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_p_then_d_with_ps_answer_pulls_the_kv(tensor_parallel: int) -> None:
    port = consecutive_free_ports(tensor_parallel)
    p, d = make_pair(tensor_parallel=tensor_parallel, p_extra={"port": port})
    try:
        _, answer = sequential_prefill(p, "warm", 70)
        assert answer["do_remote_prefill"] is True and answer["do_remote_decode"] is False
        kv = answer["kvflow"]
        assert kv["mode"] == "pull" and "decode" not in kv
        assert kv["prefill"] == {"engine": "prefill", "address": f"tcp://127.0.0.1:{port}", "tp_size": tensor_parallel}
        assert answer["remote_engine_id"] == "prefill" and len(kv["transfer_id"]) >= 22  # unguessable
        d_req = d.add("d-warm", 70, 4, answer, tag="warm")
        settle((p, d), [d_req])
        assert d.checked == {"d-warm": 0}
        for rid in ("a", "b"):
            sequential_move(p, d, rid, 100)
        assert p.connector._book.counters == {"unservable": 0, "assigned": 3}
        assert d.connector._book.counters["unservable"] == 0
        for rank in range(tensor_parallel):
            assert kvflow_engine(p, rank).stats()["completed"] == 3
    finally:
        p.close()
        d.close()


def test_a_second_decode_engine_handed_the_same_answer_is_refused() -> None:
    p, d = make_pair(p_extra={"port": consecutive_free_ports(1)})
    other = StandInEngine(
        EngineOptions(
            "decode2", "kv_consumer", {"transport": "loopback", "port": 0, "fabric": p.options.extra["fabric"]}
        )
    )
    try:
        p_req, answer = sequential_prefill(p, "twice", 70)
        first = d.add("d-twice", 70, 4, answer, tag="twice")
        settle((p, d), [p_req, first])
        assert d.checked == {"d-twice": 0}
        second = other.add("d2-twice", 70, 4, answer, tag="twice")  # a replayed answer
        settle((p, other), [second])
        assert second.status == RequestStatus.FINISHED_ERROR  # kv_load_failure_policy "fail"
        assert kvflow_engine(p).stats()["refused_claims"] == 1
    finally:
        other.close()
        p.close()
        d.close()


def test_p_frees_the_kv_at_its_deadline_when_no_decode_engine_comes() -> None:
    p, d = make_pair(p_extra={"port": consecutive_free_ports(1), "transfer_timeout": 1.0})
    try:
        p_req, answer = sequential_prefill(p, "lonely", 70)
        assert answer["do_remote_prefill"] is True
        assert p.free_blocks() < p.options.num_blocks - 1  # kept for the decode engine
        settle((p,), [p_req])  # its deadline passes: every block is free again, nothing pending
        core = kvflow_engine(p).stats()
        assert (core["completed"], core["failed"]) == (0, 1)
    finally:
        p.close()
        d.close()


def test_d_with_another_connectors_params_says_so_and_computes_locally(caplog: pytest.LogCaptureFixture) -> None:
    p, d = make_pair()
    nixl_answer = {  # what vLLM's NixlConnector returns: no kvflow entry
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [1, 2, 3],
        "remote_engine_id": "nixl-p",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "remote_request_id": "r",
    }
    try:
        with caplog.at_level(logging.ERROR, logger="kvflow.vllm"):
            d_req = d.add("d-foreign", 70, 4, nixl_answer)
            settle((d,), [d_req])
        assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert d.connector._book.counters["unservable"] == 1
        said = [r.getMessage() for r in caplog.records if "d-foreign" in r.getMessage()]
        assert len(said) == 1, said  # once per request, though vLLM asks more than once
        assert "no kvflow entry" in said[0] and "computed locally" in said[0]
    finally:
        p.close()
        d.close()


def test_p_with_port_0_refuses_the_convention_with_a_clear_message(caplog: pytest.LogCaptureFixture) -> None:
    p, d = make_pair()  # port 0: the decode engine could not be told where P is
    try:
        with caplog.at_level(logging.ERROR, logger="kvflow.vllm"):
            p_req, answer = sequential_prefill(p, "port0", 70)
        run((p,), lambda: is_finished(p_req) and p.idle())
        assert answer is None and p.connector._book.counters["unservable"] == 1
        assert any("port 0" in r.getMessage() and "p-port0" in r.getMessage() for r in caplog.records)
    finally:
        p.close()
        d.close()


# ---------------------------------------------------------------- the book alone (pure)

P_REF = PeerRef("prefill-0", "tcp://10.0.0.1:5700")


def test_the_book_assigns_a_pull_transfer_and_answers_what_d_understands() -> None:
    p = SchedulerBook(32, producer=P_REF)
    answers = []
    for rid in ("r1", "r2"):
        p.new_request(rid, dict(TOY_PROXY_P_PARAMS), 40)
        p.scheduled(rid, 0, 40, [[3, 4]])
        (ready,) = p.take_orders().ready
        assert (ready.params.mode, ready.params.prefill, ready.params.decode, ready.blocks) == (
            Mode.PULL,
            P_REF,
            None,
            (Blocks(0, (3, 4)),),
        )
        delay_free, answer = p.finished(rid, aborted=False)
        assert delay_free and answer is not None  # the blocks are kept for D's read
        assert answer["kvflow"]["transfer_id"] == ready.params.transfer_id
        answers.append(answer)
    assert answers[0]["kvflow"]["transfer_id"] != answers[1]["kvflow"]["transfer_id"]
    assert p.counters == {"unservable": 0, "assigned": 2}

    d = SchedulerBook(32)
    assert d.matched_tokens("d1", answers[0], 40, 0) == (40, True)
    d.allocated("d1", answers[0], 40, [[7, 8]], 40)
    (expect,) = d.take_orders().expect
    assert (expect.params.prefill, expect.params.mode, expect.blocks) == (P_REF, Mode.PULL, (Blocks(0, (7, 8)),))
    assert d.counters["unservable"] == 0


def test_an_aborted_prefill_hands_nothing_to_d() -> None:
    p = SchedulerBook(32, producer=P_REF)
    p.new_request("r", dict(TOY_PROXY_P_PARAMS), 40)
    p.scheduled("r", 0, 40, [[3, 4]])
    p.take_orders()
    assert p.finished("r", aborted=True) == (True, None)  # freed once the abort is fenced
    (abort,) = p.take_orders().abort
    assert abort.producer and abort.request_id == "r"
