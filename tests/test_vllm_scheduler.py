"""kvflow's connector inside vLLM's real Scheduler: a P engine and a D engine in this process.

The scheduler-role connector is created by vLLM itself from ``kv_connector_module_path``; the
worker-role connector registers CPU KV tensors; real bytes move over the loopback transport (or
NIXL-UCX) and a real ZeroMQ control plane on 127.0.0.1.  See `vllm_harness` for the stand-in
model runner.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup")

from vllm.v1.request import RequestStatus

from kvflow.integrations.vllm.connector import KVFlowConnector
from tests.vllm_harness import BLOCK_SIZE, VllmEngine, is_finished, make_engine

_fabrics = itertools.count()


def pair(transport: str = "loopback", failure_policy: str = "fail", **extra: Any) -> tuple[VllmEngine, VllmEngine]:
    common = {"transport": transport, "port": 0, "fabric": f"f{next(_fabrics)}", **extra}
    p = make_engine("prefill", "kv_producer", common)
    d = make_engine("decode", "kv_consumer", common, failure_policy=failure_policy)
    return p, d


def params(p: VllmEngine, d: VllmEngine, transfer_id: str, mode: str = "push") -> dict[str, Any]:
    assert isinstance(p.worker, KVFlowConnector) and isinstance(d.worker, KVFlowConnector)
    return {
        "transfer_id": transfer_id,
        "epoch": 1,
        "mode": mode,
        "prefill": {"engine": "prefill", "address": p.worker.control_address},
        "decode": {"engine": "decode", "address": d.worker.control_address},
    }


def run(engines: tuple[VllmEngine, ...], until: Any, limit: float = 20.0) -> None:
    """Step every engine (as EngineCore would while it has work) until `until()` holds."""
    deadline = time.monotonic() + limit
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError("the engines did not get there in time")
        for engine in engines:
            if engine.scheduler.has_requests():
                engine.step()
        time.sleep(0.001)


@pytest.fixture
def engines() -> Iterator[tuple[VllmEngine, VllmEngine]]:
    p, d = pair()
    yield p, d
    d.close()
    p.close()


def dispatch(p: VllmEngine, d: VllmEngine, tid: str, prompt_len: int, mode: str = "push") -> tuple[Any, Any]:
    """The router: both legs at once, the same transfer id, each told where the other is."""
    kv = params(p, d, tid, mode)
    d_req = d.add(f"d-{tid}", prompt_len, max_tokens=4, params={"do_remote_prefill": True, "kvflow": kv})
    p.transfers[f"p-{tid}"] = tid
    p_req = p.add(f"p-{tid}", prompt_len, max_tokens=1, params={"do_remote_decode": True, "kvflow": kv})
    return p_req, d_req


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_kv_moves_from_prefill_to_decode_and_both_schedulers_end_empty(
    engines: tuple[VllmEngine, VllmEngine], mode: str
) -> None:
    p, d = engines
    prompt = 3 * BLOCK_SIZE + 5
    p_req, d_req = dispatch(p, d, "t1", prompt, mode)
    checked: list[bool] = []

    def landed() -> bool:
        if d_req.status == RequestStatus.RUNNING and not checked:
            checked.append(d.blocks_hold(d_req.request_id, "t1", 4))
        return is_finished(d_req) and is_finished(p_req) and p.idle() and d.idle()

    run((p, d), landed)
    assert checked == [True], "D's blocks did not hold P's KV when decoding started"
    assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(d_req.output_token_ids) == 4
    for engine in (p, d):
        assert not engine.connector.has_pending_push_work()
        assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63  # one null block


def test_connector_loaded_by_module_path(engines: tuple[VllmEngine, VllmEngine]) -> None:
    p, _ = engines
    assert type(p.connector).__name__ == "KVFlowConnector"
    assert type(p.connector).__module__ == "kvflow.integrations.vllm.connector"
