"""What a vLLM worker connector remembers between steps stays bounded over a long run.

P and D are the stand-in engines of `tests.vllm_pairs` (vLLM's real scheduler, kvflow's
connector, the loopback transport): after every request has ended, neither worker still holds
the ids of requests vLLM reported finished.
"""

from __future__ import annotations

import pytest

from kvflow.integrations.vllm.connector import KVFlowConnector
from kvflow.integrations.vllm.worker import WorkerSide
from kvflow_tools.standin import StandInEngine
from tests.vllm_pairs import BLOCK_SIZE, dispatch, make_pair, settle


def worker(engine: StandInEngine) -> WorkerSide:
    assert isinstance(engine.worker, KVFlowConnector)
    side = engine.worker._worker
    assert side is not None
    return side


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_workers_forget_finished_requests_once_kvflow_is_done_with_them(mode: str) -> None:
    p, d = make_pair()
    try:
        for i in range(4):
            settle((p, d), list(dispatch(p, d, f"t{i}", 2 * BLOCK_SIZE + i, mode)))
            # every request so far has ended on both sides and its blocks are free
            assert (worker(p).finished_waiting, worker(d).finished_waiting) == (0, 0), i
        assert sorted(d.checked.values()) == [0] * 4  # and D decoded P's KV every time
    finally:
        d.close()
        p.close()
