"""An engine process that dies (SIGKILL, as an OOM kill) under vLLM's hooks.

Stand-in vLLM engines (vLLM's scheduler, KV allocation and hooks) with kvflow's engines in
processes of their own over NIXL-UCX on 127.0.0.1.  When a rank's engine process dies, the
worker fails every transfer it held, gives every block back to vLLM (the dead process's
registrations died with it: nothing can write or read them any more), never raises out of
vLLM's step, and starts a new engine process under a new incarnation that serves the next
request.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvflow.integrations.vllm.connector import KVFlowConnector
from kvflow.integrations.vllm.links import ProcessLink
from kvflow_tools.standin import StandInEngine
from tests.vllm_pairs import (
    BLOCK_SIZE,
    dispatch,
    is_finished,
    make_pair,
    move_and_check,
    params,
    run,
    settle,
    stepping,
)

pytestmark = pytest.mark.timeout(180)


def engine_pid(engine: StandInEngine) -> int:
    assert isinstance(engine.worker, KVFlowConnector)
    side = engine.worker._worker
    assert side is not None and isinstance(side.link, ProcessLink), "an engine process is needed"
    return side.link.process.pid


def engine_address(engine: StandInEngine) -> str:
    assert isinstance(engine.worker, KVFlowConnector)
    return engine.worker.control_address


def kill(engine: StandInEngine) -> int:
    pid = engine_pid(engine)
    os.kill(pid, signal.SIGKILL)  # the link reaps it
    return pid


def pair() -> tuple[StandInEngine, StandInEngine]:
    return make_pair(transport="nixl", extra={"lease": 2.0, "transfer_timeout": 8.0})


def waiting_d_request(p: StandInEngine, d: StandInEngine, tid: str) -> Any:
    kv = params(p, d, tid)
    request = d.add(f"d-{tid}", 3 * BLOCK_SIZE, 4, {"do_remote_prefill": True, "kvflow": kv}, tag=tid)
    stepping((d,), lambda: request.status == RequestStatus.WAITING_FOR_REMOTE_KVS, limit=20.0)
    return request


def moves_again(p: StandInEngine, d: StandInEngine, limit: float = 60.0) -> None:
    """A request moves its KV between `p` and `d` again, within `limit` seconds.  The survivor
    meets the restarted engine's new incarnation: a request made before it saw the old one go (a
    grace of 1 s), or in the 5 s after, during which it does not associate with that peer again,
    fails, named, and P holds its KV to its deadline (8 s); a request after that moves."""
    deadline = time.monotonic() + limit
    for attempt in itertools.count():
        p_req, d_req = dispatch(p, d, f"after-{attempt}", 2 * BLOCK_SIZE)
        settle((p, d), [p_req, d_req], limit=limit)
        if d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            assert d.checked[d_req.request_id] == 0  # D's pages hold P's KV
            return
        assert d_req.status == RequestStatus.FINISHED_ERROR and time.monotonic() < deadline, attempt


def test_ds_engine_process_killed_while_it_waits_for_kv_fails_the_load_frees_the_blocks_and_restarts() -> None:
    p, d = pair()
    try:
        move_and_check(p, d, "warm", 2 * BLOCK_SIZE)  # the peers know each other
        request = waiting_d_request(p, d, "t-d-dies")
        assert d.free_blocks() < d.options.num_blocks - 1
        address = engine_address(d)
        old = kill(d)
        # D's steps go on: no exception out of vLLM's hooks, the load fails, the blocks come back
        stepping((d,), lambda: is_finished(request), limit=30.0)
        assert request.status == RequestStatus.FINISHED_ERROR
        run((p, d), lambda: d.idle() and p.idle(), limit=60.0)
        assert d.free_blocks() == d.options.num_blocks - 1
        assert engine_pid(d) != old and engine_address(d) == address  # a new engine process, where P knows it
        moves_again(p, d)
    finally:
        d.close()
        p.close()


def test_ps_engine_process_killed_while_it_holds_kv_for_d_frees_ps_blocks_and_restarts() -> None:
    p, d = pair()
    try:
        move_and_check(p, d, "warm", 2 * BLOCK_SIZE)
        kv = params(p, d, "t-p-dies")
        # P alone: its KV is computed and held for a D that never registers
        p_req = p.add("p-t-p-dies", 3 * BLOCK_SIZE, 1, {"do_remote_decode": True, "kvflow": kv}, tag="t-p-dies")
        run((p,), lambda: is_finished(p_req), limit=20.0)
        assert p.free_blocks() < p.options.num_blocks - 1  # held for D
        address = engine_address(p)
        old = kill(p)
        # killed before the hand-over reached it, the failed hand-over frees the blocks a step
        # before the next step's supervision restarts the process: wait for both
        stepping((p,), lambda: p.free_blocks() == p.options.num_blocks - 1 and engine_pid(p) != old, limit=30.0)
        assert engine_address(p) == address  # where D and routers know it
        moves_again(p, d)
    finally:
        d.close()
        p.close()
