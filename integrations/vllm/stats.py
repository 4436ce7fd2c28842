"""kvflow's transfer metrics in vLLM's own connector-stats API.

The periodic log line and the ``vllm:kvflow_*`` Prometheus metrics, as vLLM's NIXL connector
reports ``vllm:nixl_*``.

How they travel (vLLM 0.33): each worker's ``get_kv_connector_stats`` returns a
`KVFlowConnectorStats` after every step; vLLM's ``KVOutputAggregator`` aggregates the ranks'
(``aggregate``), the scheduler adds its own (``get_kv_connector_stats`` on the scheduler side)
and ships ``to_dict()`` in its ``SchedulerStats`` (msgpack to the API process: the payload is
plain dicts, lists and numbers); there ``LoggingStatLogger`` rebuilds the stats with
``build_kv_connector_stats``, aggregates them over its interval and logs ``reduce()``, and
``PrometheusStatLogger`` hands the payload to `KVFlowPromMetrics.observe`.

What a worker reports (`RankMeter`), each since its previous report: per transfer the side
that posted its data ops timed (P pushing, D pulling; see `kvflow.runtime.meter`), how
transfers ended on this rank, the control frames and messages it refused, by reason; and a
snapshot of this rank's gauges (transfers in flight by state, quarantined blocks, peer teardowns
by phase and the seconds until the last held block goes back by the fencing rule).  The
snapshot is taken on the engine's thread (asked for at most every `SNAPSHOT_INTERVAL`) and
read by a later step, so a hook never waits for the engine; a step with nothing new returns
None.  A rank's gauges go out with each snapshot while they are non-zero, and once when they
drop to zero: the Prometheus gauges sum each rank's latest, and a log interval holds every
busy rank's (a rank missing from it had none in flight).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvflow.errors import KVFlowError
from kvflow.integrations.vllm.links import EngineLink
from kvflow.protocol.state import Outcome, State
from kvflow.protocol.teardown import Phase
from kvflow.runtime.meter import quantile

__all__ = (
    "IN_FLIGHT_STATES",
    "TEARDOWN_PHASES",
    "KVFlowConnectorStats",
    "KVFlowPromMetrics",
    "RankMeter",
    "counter_deltas",
)

# seconds between two gauge snapshots of a rank's engine, at least: vLLM logs its stats every
# few seconds and Prometheus scrapes every few more; each snapshot costs the step that reads it
SNAPSHOT_INTERVAL = 0.5
SAMPLE_KEYS = ("transfer_duration", "post_duration", "bytes_transferred", "num_descriptors")
COUNT_KEYS = ("outcomes", "rejected_frames", "scheduler")
TERMINAL = {State.ABORTED, State.FAILED, State.EXPIRED}
IN_FLIGHT_STATES = tuple(state.value for state in State if state not in TERMINAL)
TEARDOWN_PHASES = tuple(phase.value for phase in Phase if phase is not Phase.ENDED)


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = {key: [] for key in SAMPLE_KEYS}
    data.update({key: {} for key in COUNT_KEYS})
    data["samples_dropped"] = 0
    # rank -> {"quarantined_blocks": n, "in_flight": {state: n}, "teardowns": {phase: n},
    #          "hold_release_in_s": seconds}
    data["ranks"] = {}
    return data


@dataclass
class KVFlowConnectorStats(KVConnectorStats):
    """One interval's figures, of one rank or aggregated over ranks and steps.  ``data`` holds
    plain values only (see the module docstring for its keys)."""

    def __post_init__(self) -> None:
        data = _empty()
        for key, value in (self.data or {}).items():  # a copy: vLLM's loggers share the payload
            data[key] = copy.deepcopy(value)
        self.data = data

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add `other` (another rank's, or a later step's) into this one; a rank's gauges in
        `other` replace this one's of the same rank (they are newer)."""
        theirs = other.data
        for key in SAMPLE_KEYS:
            self.data[key].extend(theirs.get(key, ()))
        for key in COUNT_KEYS:
            mine: dict[str, int] = self.data[key]
            for name, count in theirs.get(key, {}).items():
                mine[name] = mine.get(name, 0) + int(count)
        self.data["samples_dropped"] += int(theirs.get("samples_dropped", 0))
        self.data["ranks"].update(copy.deepcopy(theirs.get("ranks", {})))
        return self

    def is_empty(self) -> bool:
        data = self.data
        return not (
            any(data[key] for key in SAMPLE_KEYS)
            or any(any(data[key].values()) for key in COUNT_KEYS)
            or data["samples_dropped"]
            or data["ranks"]
        )

    @property
    def num_timed_transfers(self) -> int:
        return len(self.data["transfer_duration"])

    def _summed(self, gauge: str) -> dict[str, int]:
        """A gauge counted by label (`gauge` of each rank), summed over the ranks in this payload."""
        total: Counter[str] = Counter()
        for rank in self.data["ranks"].values():
            total.update(rank.get(gauge, {}))
        return dict(total)

    def in_flight(self) -> dict[str, int]:
        """Transfers in flight by state, summed over the ranks in this payload."""
        return self._summed("in_flight")

    def quarantined_blocks(self) -> int:
        return sum(int(rank.get("quarantined_blocks", 0)) for rank in self.data["ranks"].values())

    def teardowns(self) -> dict[str, int]:
        """Peer teardowns under way by phase, summed over the ranks in this payload."""
        return self._summed("teardowns")

    def hold_release_in(self) -> float:
        """Seconds until the last block held for a torn-down peer goes back, over the ranks (as
        each rank's latest snapshot said it)."""
        return max((float(rank.get("hold_release_in_s", 0.0)) for rank in self.data["ranks"].values()), default=0.0)

    def reduce(self) -> dict[str, int | float]:
        """The log line's figures: transfer counts by outcome, time and size of the timed
        transfers, refused frames, and the latest gauges."""
        data = self.data
        outcomes = data["outcomes"]
        summary: dict[str, int | float] = {
            "Transfers succeeded": outcomes.get(Outcome.SUCCEEDED.value, 0),
            "Transfers failed": outcomes.get(Outcome.FAILED.value, 0) + outcomes.get(Outcome.EXPIRED.value, 0),
            "Transfers aborted": outcomes.get(Outcome.ABORTED.value, 0),
            "Timed transfers": self.num_timed_transfers,
        }
        if self.num_timed_transfers:
            seconds = np.asarray(data["transfer_duration"], dtype=np.float64)
            posting = np.asarray(data["post_duration"], dtype=np.float64)
            mb = np.asarray(data["bytes_transferred"], dtype=np.float64) / 2**20
            total = float(seconds.sum())
            summary.update(
                {
                    "Avg xfer time (ms)": round(float(seconds.mean()) * 1e3, 3),
                    "P90 xfer time (ms)": round(quantile(seconds.tolist(), 0.9) * 1e3, 3),
                    "Avg post time (ms)": round(float(posting.mean()) * 1e3, 3),
                    "Avg MB per transfer": round(float(mb.mean()), 3),
                    "Throughput (MB/s)": round(float(mb.sum()) / total, 3) if total > 0 else 0.0,
                    "Avg number of descriptors": round(float(np.mean(data["num_descriptors"])), 1),
                }
            )
        summary["Rejected frames"] = sum(data["rejected_frames"].values())
        summary["In flight"] = sum(self.in_flight().values())
        summary["Quarantined blocks"] = self.quarantined_blocks()
        summary["Peer teardowns"] = sum(self.teardowns().values())
        summary["Hold ends in (s)"] = round(self.hold_release_in(), 1)
        for name, count in sorted(data["scheduler"].items()):
            summary[f"Scheduler {name}"] = count
        return summary


def counter_deltas(now: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """What each cumulative counter gained since `before` (only those that did)."""
    return {name: value - before.get(name, 0) for name, value in now.items() if value > before.get(name, 0)}


@dataclass(frozen=True)
class _Snapshot:
    rejected: dict[str, int]  # cumulative, by reason
    gauges: dict[str, Any]  # see `_empty`'s "ranks"


def _stats_of(data: dict[str, Any]) -> KVFlowConnectorStats:
    """Stats around a payload built here (complete and not shared: no copy needed)."""
    stats = object.__new__(KVFlowConnectorStats)
    stats.data = data
    return stats


def _busy(gauges: Mapping[str, Any]) -> bool:
    return bool(
        gauges["quarantined_blocks"] or any(gauges["in_flight"].values()) or any(gauges.get("teardowns", {}).values())
    )


class RankMeter:
    """A worker rank's reports: `take` after each step, on the model runner's thread.  Never
    blocks: it reads the engine's meter (what its link gathered) and the gauge snapshot asked
    for at the previous call (the agent's ``snapshot``), and asks for the next one."""

    def __init__(self, rank: str) -> None:
        self.rank = rank
        self._pending: concurrent.futures.Future[dict[str, Any]] | None = None
        self._latest = _Snapshot(
            {}, {"quarantined_blocks": 0, "in_flight": {}, "teardowns": {}, "hold_release_in_s": 0.0}
        )
        self._rejected_reported: dict[str, int] = {}
        self._gauges_reported: dict[str, Any] = self._latest.gauges
        self._next_snapshot = 0.0

    def take(self, link: EngineLink | None) -> KVFlowConnectorStats | None:
        """This rank's figures since the previous call; None when there is nothing to say."""
        if link is None:
            return None
        reading = link.meter_take()
        fresh = self._refresh(link, urgent=bool(reading.outcomes))
        if not (fresh or reading.samples or reading.outcomes or reading.dropped):
            return None  # most steps: nothing new to say
        data = _empty()
        for sample in reading.samples:
            data["transfer_duration"].append(sample.seconds)
            data["post_duration"].append(sample.post_seconds)
            data["bytes_transferred"].append(sample.nbytes)
            data["num_descriptors"].append(sample.descriptors)
        data["outcomes"] = dict(reading.outcomes)
        data["samples_dropped"] = reading.dropped
        if fresh:
            data["rejected_frames"] = counter_deltas(self._latest.rejected, self._rejected_reported)
            self._rejected_reported = self._latest.rejected
            gauges = self._latest.gauges  # a new dict per snapshot, never changed: shared as it is
            if gauges != self._gauges_reported or _busy(gauges):
                data["ranks"] = {self.rank: gauges}
            self._gauges_reported = gauges
        stats = _stats_of(data)
        return None if stats.is_empty() else stats

    def _refresh(self, link: EngineLink, urgent: bool = False) -> bool:
        """Read the snapshot asked for earlier, if it came (True then); ask for the next one at
        most every `SNAPSHOT_INTERVAL` seconds (each wakes the engine's loop), or at once when
        `urgent` (a transfer ended: its gauges moved, and vLLM's engine core may sleep after
        this step, so the answer must be there for the next one, not wait for a later call)."""
        fresh = False
        pending = self._pending
        if pending is not None and pending.done():
            self._pending = None
            if not pending.cancelled() and pending.exception() is None:
                snapshot = pending.result()
                self._latest, fresh = _Snapshot(snapshot["rejected"], snapshot["gauges"]), True
        now = time.monotonic()
        if self._pending is None and (urgent or now >= self._next_snapshot):
            self._next_snapshot = now + SNAPSHOT_INTERVAL
            with contextlib.suppress(KVFlowError):  # the engine stopped: the last snapshot stands
                self._pending = link.command("snapshot", lazy=not urgent)
        return fresh


def _per_engine(metric: Any, per_engine_labelvalues: dict[int, list[object]]) -> dict[int, Any]:
    """vLLM's `create_metric_per_engine`, typed for this module's metrics."""
    children: dict[int, Any] = create_metric_per_engine(metric, per_engine_labelvalues)
    return children


class KVFlowPromMetrics(KVConnectorPromMetrics):
    """The ``vllm:kvflow_*`` metrics, labelled as vLLM labels its own (model_name, engine),
    plus ``state`` or ``reason`` where a metric is split."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        values = per_engine_labelvalues
        # vLLM passes prometheus_client's classes, or its Ray wrappers of them
        histogram: Any = self._histogram_cls
        counter: Any = self._counter_cls
        gauge: Any = self._gauge_cls
        seconds = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
        self.xfer_time = _per_engine(
            histogram(
                name="vllm:kvflow_xfer_time_seconds",
                documentation="Seconds from a kvflow transfer's first data op to its outcome "
                "(counted by the side posting the ops: P pushing, D pulling).",
                buckets=seconds[1:],
                labelnames=labelnames,
            ),
            values,
        )
        self.post_time = _per_engine(
            histogram(
                name="vllm:kvflow_post_time_seconds",
                documentation="Seconds spent planning and posting a kvflow transfer's data ops.",
                buckets=seconds,
                labelnames=labelnames,
            ),
            values,
        )
        self.bytes_transferred = _per_engine(
            histogram(
                name="vllm:kvflow_bytes_transferred",
                documentation="Bytes moved per kvflow transfer.",
                buckets=[2 ** (10 + i) for i in range(1, 25, 2)],
                labelnames=labelnames,
            ),
            values,
        )
        self.num_descriptors = _per_engine(
            histogram(
                name="vllm:kvflow_num_descriptors",
                documentation="Descriptors (coalesced byte ranges) posted per kvflow transfer.",
                buckets=[10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000],
                labelnames=labelnames,
            ),
            values,
        )
        self.succeeded = self._engine_counter(
            counter, "vllm:kvflow_num_successful_transfers", "kvflow transfers that succeeded (either side)."
        )
        self.failed = self._engine_counter(
            counter,
            "vllm:kvflow_num_failed_transfers",
            "kvflow transfers that failed or expired (either side); "
            "expiries are also in vllm:kvflow_num_expired_transfers.",
        )
        self.expired = self._engine_counter(
            counter,
            "vllm:kvflow_num_expired_transfers",
            "kvflow transfers that expired (no outcome before their deadline).",
        )
        self.aborted = self._engine_counter(
            counter, "vllm:kvflow_num_aborted_transfers", "kvflow transfers aborted (by vLLM, or by the peer)."
        )
        self.quarantined = _per_engine(
            gauge(
                name="vllm:kvflow_quarantined_blocks",
                documentation="KV blocks kvflow holds back until the peer's ops on them are fenced.",
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            ),
            values,
        )
        self.teardowns = gauge(
            name="vllm:kvflow_peer_teardowns",
            documentation="Peers kvflow tore down whose transfers' blocks it has not given back yet, by "
            "phase (removing, backing-off, grace, holding: see kvflow's fencing rule).",
            labelnames=[*labelnames, "phase"],
            multiprocess_mode="mostrecent",
        )
        self.hold_release = _per_engine(
            gauge(
                name="vllm:kvflow_hold_release_seconds",
                documentation="Seconds until the last KV block held for a torn-down peer goes back by "
                "kvflow's fencing rule as it stands (0: none held; a peer that comes back shortens it).",
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            ),
            values,
        )
        self.rejected = counter(
            name="vllm:kvflow_rejected_frames",
            documentation="Control frames and peer messages kvflow refused, by reason.",
            labelnames=[*labelnames, "reason"],
        )
        self.in_flight = gauge(
            name="vllm:kvflow_transfers_in_flight",
            documentation="kvflow transfers not finished yet, by state.",
            labelnames=[*labelnames, "state"],
            multiprocess_mode="mostrecent",
        )
        self.scheduler_events = counter(
            name="vllm:kvflow_scheduler_events",
            documentation="Events counted by kvflow's scheduler-side connector, by event.",
            labelnames=[*labelnames, "event"],
        )
        self._ranks: dict[int, KVFlowConnectorStats] = {}  # per engine: each rank's latest gauges
        for labels in values.values():
            for state in IN_FLIGHT_STATES:
                self.in_flight.labels(*labels, state).set(0)
            for phase in TEARDOWN_PHASES:
                self.teardowns.labels(*labels, phase).set(0)

    def _engine_counter(self, counter: Any, name: str, documentation: str) -> dict[int, Any]:
        metric = counter(name=name, documentation=documentation, labelnames=self._labelnames)
        return _per_engine(metric, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = KVFlowConnectorStats(data=transfer_stats_data)
        data, labels = stats.data, self.per_engine_labelvalues[engine_idx]
        for metric, key in (
            (self.xfer_time, "transfer_duration"),
            (self.post_time, "post_duration"),
            (self.bytes_transferred, "bytes_transferred"),
            (self.num_descriptors, "num_descriptors"),
        ):
            for value in data[key]:
                metric[engine_idx].observe(value)
        outcomes = data["outcomes"]
        expired = outcomes.get(Outcome.EXPIRED.value, 0)
        for metric, count in (
            (self.succeeded, outcomes.get(Outcome.SUCCEEDED.value, 0)),
            (self.failed, outcomes.get(Outcome.FAILED.value, 0) + expired),
            (self.expired, expired),
            (self.aborted, outcomes.get(Outcome.ABORTED.value, 0)),
        ):
            if count:
                metric[engine_idx].inc(count)
        for reason, count in data["rejected_frames"].items():
            self.rejected.labels(*labels, reason).inc(count)
        for event, count in data["scheduler"].items():
            self.scheduler_events.labels(*labels, event).inc(count)
        if data["ranks"]:  # each rank's latest gauges, summed (a rank reports only when they change)
            ranks = self._ranks.setdefault(engine_idx, KVFlowConnectorStats())
            ranks.aggregate(_stats_of({**_empty(), "ranks": data["ranks"]}))
            self.quarantined[engine_idx].set(ranks.quarantined_blocks())
            in_flight = ranks.in_flight()
            for state in IN_FLIGHT_STATES:
                self.in_flight.labels(*labels, state).set(in_flight.get(state, 0))
            teardowns = ranks.teardowns()
            for phase in TEARDOWN_PHASES:
                self.teardowns.labels(*labels, phase).set(teardowns.get(phase, 0))
            self.hold_release[engine_idx].set(ranks.hold_release_in())
