"""kvflow's figures in vLLM's own metrics: both tensor-parallel ranks' stats aggregated by vLLM's
`KVOutputAggregator` (in the stand-in engine), shipped by vLLM's scheduler in its
`SchedulerStats` through vLLM's msgpack codec, and read by vLLM's `LoggingStatLogger` (the log
line) and `PrometheusStatLogger` (the rendered registry); real transfers, bytes checked."""

from __future__ import annotations

from collections.abc import Callable

import zmq
from vllm.v1.request import RequestStatus

from kvflow.integrations.vllm.stats import IN_FLIGHT_STATES, KVFlowConnectorStats
from kvflow.transports.loopback import FaultPlan, LoopbackFabric
from kvflow_tools.standin.fabrics import install_fabric
from tests.vllm_compat_stats import StatLoggers, expected_bytes
from tests.vllm_pairs import BLOCK_SIZE, dispatch, fabric, make_pair, params, settle, stepping, stopped


def test_both_ranks_figures_reach_vllms_log_line_and_prometheus() -> None:
    p, d = make_pair(tensor_parallel=2, log_stats=True)
    try:
        loggers = StatLoggers(p, d)
        prompts = [3 * BLOCK_SIZE + 7, 2 * BLOCK_SIZE]
        for index, prompt in enumerate(prompts):  # one after the other
            p_req, d_req = dispatch(p, d, f"t{index}", prompt)
            settle((p, d), [p_req, d_req])
            assert d.checked[d_req.request_id] == 0, "D read pages that do not hold P's KV"
            assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        moved = sum(expected_bytes(p, prompt) for prompt in prompts)

        # P posted the WRITEs: one timed transfer per request and rank, each rank its own half
        sent = loggers.total(0)
        assert sent.num_timed_transfers == 2 * len(prompts)
        assert sum(sent.data["bytes_transferred"]) == moved
        # timed by the engine loop's clock (uvloop's: whole milliseconds, read once per loop
        # turn), so a loopback transfer finished within the same millisecond takes 0 s; what a
        # duration is made of is checked on an injected clock in tests/test_meter.py
        assert all(0 <= seconds < 60 for seconds in sent.data["transfer_duration"])
        assert loggers.metric("vllm:kvflow_xfer_time_seconds_count", 0) == 2 * len(prompts)
        assert loggers.metric("vllm:kvflow_bytes_transferred_sum", 0) == moved
        assert loggers.metric("vllm:kvflow_num_descriptors_count", 0) == 2 * len(prompts)
        assert loggers.metric("vllm:kvflow_xfer_time_seconds_count", 1) == 0  # D posts nothing when pushed to

        # every rank's verdicts, on both sides; nothing left in flight once each engine steps again
        def settled() -> bool:
            return all(
                loggers.metric("vllm:kvflow_num_successful_transfers_total", engine) == 2 * len(prompts)
                and sum(loggers.metric("vllm:kvflow_transfers_in_flight", engine, state=s) for s in IN_FLIGHT_STATES)
                == 0
                for engine in (0, 1)
            )

        stepping((p, d), settled)  # every rank's verdict, and the gauges, at vLLM's Prometheus logger
        assert loggers.total(1).data["outcomes"] == {"succeeded": 2 * len(prompts)}
        assert loggers.metric("vllm:kvflow_num_failed_transfers_total", 0) == 0

        [line] = loggers.log_lines(0)
        assert f"Transfers succeeded={2 * len(prompts)}" in line and f"Timed transfers={2 * len(prompts)}" in line
        assert "Transfers failed=0" in line and "Avg xfer time (ms)=" in line, line
        [line] = loggers.log_lines(1)
        assert f"Transfers succeeded={2 * len(prompts)}" in line and "Timed transfers=0" in line, line
        assert loggers.log_lines(0) == []  # the interval's figures were logged once
    finally:
        d.close()
        p.close()


def test_a_failed_write_shows_in_the_failures_on_both_sides() -> None:
    name = fabric()
    install_fabric(name, LoopbackFabric(faults=FaultPlan(fail_ops={1})))
    p, d = make_pair(extra={"fabric": name, "transfer_timeout": 600.0}, log_stats=True)
    try:
        loggers = StatLoggers(p, d)
        p_req, d_req = dispatch(p, d, "t-fail", 2 * BLOCK_SIZE)
        settle((p, d), [p_req, d_req], limit=30.0)
        assert d_req.status == RequestStatus.FINISHED_ERROR

        def failed_on_both() -> bool:
            return all(loggers.metric("vllm:kvflow_num_failed_transfers_total", e) == 1 for e in (0, 1))

        stepping((p, d), failed_on_both)
        assert loggers.total(0).num_timed_transfers == 0  # a failed transfer is not timed
        assert loggers.metric("vllm:kvflow_num_successful_transfers_total", 0) == 0
        for engine in (0, 1):
            [line] = loggers.log_lines(engine)
            assert "Transfers failed=1" in line and "Transfers succeeded=0" in line, line
    finally:
        d.close()
        p.close()


def test_in_flight_gauges_and_rejected_frames() -> None:
    """D's registrations wait for a P that has not started the request: both ranks show a
    transfer in flight; a stranger's frame to P's control port counts as rejected."""
    p, d = make_pair(tensor_parallel=2, log_stats=True)
    try:
        loggers = StatLoggers(p, d)
        kv = params(p, d, "t-wait")
        d_req = d.add("d-t-wait", 2 * BLOCK_SIZE, 4, {"do_remote_prefill": True, "kvflow": kv}, tag="t-wait")

        def registered() -> bool:
            return loggers.metric("vllm:kvflow_transfers_in_flight", 1, state="registered") == 2

        stepping((d,), registered)  # both D ranks' registrations in vLLM's in-flight gauge

        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        with context.socket(zmq.DEALER) as stranger:
            stranger.setsockopt(zmq.LINGER, 0)
            stranger.connect(p.worker.control_address)
            stranger.send(b"not a kvflow frame")

            def rejected() -> bool:
                return loggers.metric("vllm:kvflow_rejected_frames_total", 0, reason="shape") >= 1

            stepping((p,), rejected)

        p_req = p.add("p-t-wait", 2 * BLOCK_SIZE, 1, {"do_remote_decode": True, "kvflow": kv}, tag="t-wait")
        settle((p, d), [p_req, d_req])
        assert d.checked[d_req.request_id] == 0

        def drained() -> bool:
            return all(
                loggers.metric("vllm:kvflow_transfers_in_flight", e, state=s) == 0
                for e in (0, 1)
                for s in IN_FLIGHT_STATES
            )

        stepping((p, d), drained)  # the in-flight gauges back at zero
    finally:
        d.close()
        p.close()


def test_stats_aggregate_add_up_and_keep_each_ranks_latest_gauges() -> None:
    """What vLLM's aggregator and log line do with two ranks' payloads and a later step's."""
    rank0 = KVFlowConnectorStats(
        data={
            "transfer_duration": [0.01],
            "post_duration": [0.001],
            "bytes_transferred": [2**20],
            "num_descriptors": [4],
            "outcomes": {"succeeded": 1},
            "ranks": {"p-tp0": {"quarantined_blocks": 0, "in_flight": {"writing": 1}}},
        }
    )
    rank1 = KVFlowConnectorStats(
        data={
            "outcomes": {"failed": 1},
            "rejected_frames": {"bad_mac": 2},
            "ranks": {
                "p-tp1": {
                    "quarantined_blocks": 3,
                    "in_flight": {"failing": 1},
                    "teardowns": {"holding": 1, "grace": 1},
                    "hold_release_in_s": 61.5,
                }
            },
        }
    )
    held = {"quarantined_blocks": 0, "in_flight": {}, "teardowns": {"holding": 1}, "hold_release_in_s": 12.0}
    later = KVFlowConnectorStats(data={"ranks": {"p-tp0": held}})
    total = rank0.aggregate(rank1).aggregate(later)
    assert isinstance(total, KVFlowConnectorStats)
    assert total.in_flight() == {"failing": 1} and total.quarantined_blocks() == 3
    summary = total.reduce()
    assert summary["Transfers succeeded"] == 1 and summary["Transfers failed"] == 1
    assert summary["Timed transfers"] == 1 and summary["Avg MB per transfer"] == 1.0
    assert summary["Rejected frames"] == 2 and summary["In flight"] == 1
    # teardowns summed over the ranks; the hold ends when the last rank's ends
    assert total.teardowns() == {"holding": 2, "grace": 1} and total.hold_release_in() == 61.5
    assert summary["Peer teardowns"] == 3 and summary["Hold ends in (s)"] == 61.5
    assert not total.is_empty() and KVFlowConnectorStats().is_empty()
    assert rank1.data["outcomes"] == {"failed": 1}  # the other payload is left as it was


def test_scheduler_side_counts_join_the_workers_in_vllms_scheduler_stats() -> None:
    """vLLM's scheduler adds its connector's own stats to the workers': what the book's
    cumulative ``counters`` gained (here a decode request whose params kvflow cannot serve,
    counted ``unservable``) is reported once, in vLLM's stats, log line and metrics."""
    p, d = make_pair(log_stats=True)
    try:
        loggers = StatLoggers(p, d)
        foreign = {"do_remote_prefill": True, "remote_engine_id": "elsewhere", "remote_block_ids": [1]}
        local = d.add("d-foreign", 2 * BLOCK_SIZE, 2, foreign)
        p_req, d_req = dispatch(p, d, "t-book", 2 * BLOCK_SIZE)
        settle((p, d), [p_req, d_req, local])
        assert loggers.total(1).data["scheduler"] == {"unservable": 1}
        assert loggers.metric("vllm:kvflow_scheduler_events_total", 1, event="unservable") == 1
        assert "Scheduler unservable=1" in "\n".join(loggers.log_lines(1))
        assert not loggers.total(0).data.get("scheduler")  # P served everything
    finally:
        d.close()
        p.close()


def test_the_fencing_rules_gauges_reach_prometheus_per_engine_and_phase() -> None:
    """A rank's hold, as its snapshot reports it, in the gauges a scrape renders; back at zero
    once the rank reports its hold over."""
    p, d = make_pair(log_stats=True)
    try:
        loggers = StatLoggers(p, d)
        prom = loggers.prometheus.kv_connector_prom
        held = {"quarantined_blocks": 94, "in_flight": {}, "teardowns": {"holding": 1}, "hold_release_in_s": 47.5}
        prom.observe({"ranks": {"d-tp0": held}}, engine_idx=1)
        assert loggers.metric("vllm:kvflow_peer_teardowns", 1, phase="holding") == 1
        assert loggers.metric("vllm:kvflow_peer_teardowns", 1, phase="grace") == 0
        assert loggers.metric("vllm:kvflow_hold_release_seconds", 1) == 47.5
        assert loggers.metric("vllm:kvflow_quarantined_blocks", 1) == 94
        assert loggers.metric("vllm:kvflow_hold_release_seconds", 0) == 0  # P holds nothing
        over = {"quarantined_blocks": 0, "in_flight": {}, "teardowns": {}, "hold_release_in_s": 0.0}
        prom.observe({"ranks": {"d-tp0": over}}, engine_idx=1)
        assert loggers.metric("vllm:kvflow_peer_teardowns", 1, phase="holding") == 0
        assert loggers.metric("vllm:kvflow_hold_release_seconds", 1) == 0
    finally:
        d.close()
        p.close()


def test_a_silent_ps_hold_on_ds_blocks_shows_in_ds_metrics() -> None:
    """Over NIXL, which cannot fence a removed peer's WRITEs: P's engine process stops while D
    waits for its KV; D tears P down, its grace passes, and the blocks stay held.  D's Prometheus gauges
    show the teardown's phase and when the blocks go back by the fencing rule."""
    p, d = make_pair(transport="nixl", extra={"lease": 1.0, "transfer_timeout": 600.0}, log_stats=True)
    try:
        loggers = StatLoggers(p, d)
        kv = params(p, d, "t-silent")
        d.add("d-t-silent", 2 * BLOCK_SIZE, 4, {"do_remote_prefill": True, "kvflow": kv}, tag="t-silent")
        stepping((d,), lambda: loggers.metric("vllm:kvflow_transfers_in_flight", 1, state="registered") == 1)
        with stopped(p):

            def phase(name: str) -> Callable[[], bool]:
                return lambda: loggers.metric("vllm:kvflow_peer_teardowns", 1, phase=name) == 1

            stepping((d,), phase("grace"), limit=20.0)
            # in the grace: the grace's rest and then the whole hold (120 s by default)
            assert 120.0 < loggers.metric("vllm:kvflow_hold_release_seconds", 1) <= 125.0
            stepping((d,), phase("holding"), limit=20.0)
            assert 100.0 < loggers.metric("vllm:kvflow_hold_release_seconds", 1) <= 120.0
            assert loggers.metric("vllm:kvflow_quarantined_blocks", 1) == 2
            [line] = loggers.log_lines(1)[-1:]
            assert "Peer teardowns=1" in line and "Hold ends in (s)=" in line, line
    finally:
        d.close()
        p.close()
