"""The compatibility matrix's metrics row, and the harness that reads kvflow's figures the way
vLLM's API process does.

`StatLoggers` stands where vLLM's API process stands: each `SchedulerStats` a stand-in
engine's scheduler makes crosses vLLM's msgpack codec inside ``EngineCoreOutputs`` (as it
crosses from the engine core to the API process), then goes to vLLM's own `LoggingStatLogger`
(one per engine) and `PrometheusStatLogger` (P is engine 0, D engine 1 of the registry).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from kvflow.integrations.vllm.connector import KVFlowConnector
from kvflow.integrations.vllm.stats import KVFlowConnectorStats
from kvflow_tools.standin import StandInEngine
from tests.vllm_compat_registry import scenario
from tests.vllm_pairs import BLOCK_SIZE, make_pair, move_and_check


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class StatLoggers:
    """vLLM's stat loggers fed by P (engine 0) and D (engine 1)."""

    def __init__(self, p: StandInEngine, d: StandInEngine) -> None:
        self.encoder, self.decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
        self.prometheus = PrometheusStatLogger(p.config, engine_indexes=[0, 1])
        self.logging = [LoggingStatLogger(p.config, 0), LoggingStatLogger(d.config, 1)]
        self.payloads: list[list[dict[str, Any]]] = [[], []]
        for index, engine in enumerate((p, d)):
            engine.stats_listeners.append(functools.partial(self._record, index))

    def _record(self, index: int, stats: Any) -> None:
        wire = self.decoder.decode(self.encoder.encode(EngineCoreOutputs(scheduler_stats=stats)))
        shipped = wire.scheduler_stats
        assert shipped is not None
        if shipped.kv_connector_stats:
            self.payloads[index].append(shipped.kv_connector_stats)
        self.logging[index].record(shipped, None, engine_idx=index)
        self.prometheus.record(shipped, None, engine_idx=index)

    def total(self, index: int) -> KVFlowConnectorStats:
        """Every payload engine `index` shipped, aggregated as vLLM's log line aggregates them."""
        stats = KVFlowConnector.build_kv_connector_stats()
        assert isinstance(stats, KVFlowConnectorStats)
        for payload in self.payloads[index]:
            rebuilt = KVFlowConnector.build_kv_connector_stats(payload)
            assert rebuilt is not None
            stats.aggregate(rebuilt)
        return stats

    def log_lines(self, index: int) -> list[str]:
        """What vLLM's `LoggingStatLogger.log` of engine `index` prints now (at any level: an
        engine without token throughput logs at debug)."""
        handler = _Lines()
        vllm_logger = logging.getLogger("vllm.v1.metrics.loggers")
        level = vllm_logger.level
        vllm_logger.addHandler(handler)
        vllm_logger.setLevel(logging.DEBUG)
        try:
            self.logging[index].log()  # type: ignore[no-untyped-call]
        finally:
            vllm_logger.removeHandler(handler)
            vllm_logger.setLevel(level)
        return [line for line in handler.lines if line.startswith("KV Transfer metrics")]

    @staticmethod
    def metric(name: str, engine: int, **labels: str) -> float:
        """A sample of the Prometheus registry as a scrape renders it (0 if absent)."""
        text = generate_latest(REGISTRY).decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                wanted = {"engine": str(engine), **labels}
                if sample.name == name and all(sample.labels.get(k) == v for k, v in wanted.items()):
                    return float(sample.value)
        return 0.0


def expected_bytes(engine: StandInEngine, prompt: int) -> int:
    """Bytes of one request's KV over every rank: its blocks' pages of each layer."""
    pages = -(-prompt // engine.options.block_size) * len(engine.owners) * len(engine.ranks)
    return int(pages * engine.ranks[0].pages.page_bytes)


@scenario("metrics")
def _metrics(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    p, d = make_pair(tensor_parallel=2, log_stats=True)
    try:
        loggers = StatLoggers(p, d)
        prompt = 3 * BLOCK_SIZE + 7
        move_and_check(p, d, "t-metrics", prompt)
        assert loggers.metric("vllm:kvflow_xfer_time_seconds_count", 0) == 2  # one per rank
        assert loggers.metric("vllm:kvflow_bytes_transferred_sum", 0) == expected_bytes(p, prompt)
        assert any(fragment in line for line in loggers.log_lines(0))
    finally:
        d.close()
        p.close()
