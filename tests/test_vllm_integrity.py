"""The integrity check through the vLLM connector (``kv_connector_extra_config``
``{"integrity": true}`` on P and D), on vLLM's real scheduler and KV allocation (the stand-in,
whose D checks every page it decodes from against P's).

A byte flipped in flight fails D's request (vLLM's load-failure policy "fail") before D decodes
a token; the same byte without the check reaches decode, which is what the check is for.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.request import RequestStatus

from kvflow.transports.loopback import FaultPlan, LoopbackFabric
from kvflow_tools.standin.fabrics import install_fabric
from tests.vllm_compat_stats import StatLoggers
from tests.vllm_pairs import BLOCK_SIZE, dispatch, fabric, make_pair, move_and_check, settle, stepping


def test_with_the_setting_on_both_sides_a_push_moves_checked_pages() -> None:
    p, d = make_pair(extra={"integrity": True})
    try:
        move_and_check(p, d, "t-ok", 3 * BLOCK_SIZE)
    finally:
        d.close()
        p.close()


def flipped(integrity: bool) -> tuple[Any, dict[str, int], float]:
    """One request whose WRITE lands with a byte flipped: D's request, the pages D's stand-in
    found wrong when it decoded, and D's count of integrity mismatches in vLLM's metrics."""
    name = fabric()
    install_fabric(name, LoopbackFabric(faults=FaultPlan(corrupt_ops={1})))
    p, d = make_pair(extra={"fabric": name, "integrity": integrity, "transfer_timeout": 600.0}, log_stats=True)
    try:
        loggers = StatLoggers(p, d)
        p_req, d_req = dispatch(p, d, "t-flip", 2 * BLOCK_SIZE)
        settle((p, d), [p_req, d_req], limit=30.0)

        def mismatches() -> float:
            return loggers.metric("vllm:kvflow_rejected_frames_total", 1, reason="integrity_mismatch")

        stepping((p, d), lambda: mismatches() == int(integrity))
        return d_req, dict(d.checked), mismatches()
    finally:
        d.close()
        p.close()


def test_a_byte_flipped_in_flight_fails_ds_request_before_it_decodes_and_is_counted() -> None:
    d_req, checked, mismatches = flipped(integrity=True)
    assert d_req.status == RequestStatus.FINISHED_ERROR and len(d_req.output_token_ids) == 0
    assert checked == {} and mismatches == 1  # D never decoded from the pages; vLLM's metrics say why


def test_without_the_check_the_flipped_byte_reaches_decode() -> None:
    d_req, checked, mismatches = flipped(integrity=False)
    assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED and mismatches == 0
    assert checked[d_req.request_id] > 0  # the stand-in found pages that do not hold P's KV
