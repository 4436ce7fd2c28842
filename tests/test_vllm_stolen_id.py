"""A push transfer's KV goes to the decode engine its parameters name, never to whoever registers
the transfer id first.

The attack: a client of another decode engine of the deployment (or that engine itself) learns a
transfer id and sends its own request with the victim's parameters, naming P, but itself as D.
Its registration reaches P before the victim's.  P must not WRITE the victim's KV into the
rogue engine's blocks (it would decode the victim's prompt).  Three stand-in vLLM engines (vLLM's
scheduler and allocation, kvflow's connector, real ZeroMQ), bytes over the loopback transport.
"""

from __future__ import annotations

from vllm.v1.request import RequestStatus

from kvflow_tools.standin import EngineOptions, StandInEngine
from tests.vllm_pairs import dispatch, is_finished, kvflow_engine, make_pair, params, run

TIMEOUT = {"transfer_timeout": 2.0}


def test_a_rogue_engine_registering_a_stolen_transfer_id_first_gets_none_of_ps_kv() -> None:
    p, d = make_pair(p_extra=TIMEOUT, d_extra=TIMEOUT)
    fabric = p.options.extra["fabric"]
    rogue = StandInEngine(
        EngineOptions("rogue", "kv_consumer", {"transport": "loopback", "port": 0, "fabric": fabric, **TIMEOUT})
    )
    try:
        stolen = params(p, d, "victim")
        stolen["decode"] = {"engine": "rogue", "address": rogue.worker.control_address, "tp_size": 1}
        x_req = rogue.add("x-victim", 70, 4, {"do_remote_prefill": True, "kvflow": stolen}, tag="victim")
        run((p, rogue), lambda: kvflow_engine(p).stats()["live_transfers"] == 1)  # the rogue registered first
        p_req, d_req = dispatch(p, d, "victim", 70)
        engines = (p, d, rogue)
        run(engines, lambda: all(map(is_finished, (x_req, p_req, d_req))) and all(e.idle() for e in engines), 30)
        assert "x-victim" not in rogue.checked  # the rogue never decoded from P's KV
        assert x_req.status == RequestStatus.FINISHED_ERROR  # its load failed (policy "fail")
        assert kvflow_engine(p).stats()["completed"] == 0
        for engine in engines:  # nothing held anywhere once it is over
            assert engine.free_blocks() == engine.options.num_blocks - 1, engine.options.name
    finally:
        rogue.close()
        p.close()
        d.close()
