"""What an engine process is told to build, as the host sends it on the process's socket.

Why apart from `kvflow.runtime.process`: the spec is plain data that crosses to the child (the
engine, its transport, its control bind, the agent that runs the host's calls, where and how it
is scheduled), while `process` is the host's side of the link to a running child.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvflow.errors import KVFlowError
from kvflow.layout import KVLayout, layout_to_wire
from kvflow.runtime.config import EngineConfig
from kvflow.runtime.host_memory import SharedSpan

__all__ = ("SCHEDULING", "ProcessSpec")

SCHEDULING = ("batch", "normal")  # SCHED_BATCH, SCHED_OTHER


@dataclass(frozen=True)
class ProcessSpec:
    """What the engine process builds: the engine (id, layout at the host's addresses, config),
    its transport (a name `transports.registry` knows, and keyword arguments), its control
    channel's bind address, the agent that runs the host's calls (``module:Class``, built as
    ``Class(engine, **agent_options)``), and the CPUs it runs on (`cpus`)."""

    engine_id: str
    layout: KVLayout
    transport: str = "nixl"
    transport_options: dict[str, Any] = field(default_factory=dict)
    bind: str = "tcp://127.0.0.1:0"
    config: EngineConfig = field(default_factory=EngineConfig)
    agent: str = "kvflow.runtime.engine_agent:EngineAgent"
    agent_options: dict[str, Any] = field(default_factory=dict)
    log_level: int = logging.WARNING
    cpus: tuple[int, ...] = ()  # the CPUs the engine process runs on; empty: the host's
    scheduling: str = "batch"  # its Linux policy (`SCHEDULING`): "batch" never preempts the host on waking
    bell: str = ""  # a `kvflow.runtime.bell` it rings when it gives blocks back or a call fails ("": none)

    def to_wire(self, spans: Sequence[SharedSpan]) -> dict[str, Any]:
        """The spec as the child reads it (`spans`: the host memory handed over with it).

        :raises KVFlowError: the config has a `thread_setup` (host code the child cannot run).
        """
        config = {k: v for k, v in asdict(self.config).items() if k != "thread_setup"}
        if self.config.thread_setup is not None:
            raise KVFlowError("an engine process runs no host code: its config cannot have a thread_setup")
        return {
            "engine_id": self.engine_id,
            "layout": layout_to_wire(self.layout),
            "spans": [[i, span.base, span.length] for i, span in enumerate(spans)],
            "transport": self.transport,
            "transport_options": self.transport_options,
            "bind": self.bind,
            "config": config,
            "agent": self.agent,
            "agent_options": self.agent_options,
            "log_level": self.log_level,
            "cpus": list(self.cpus),
            "scheduling": self.scheduling,
            "bell": self.bell,
            "host_pid": os.getpid(),  # the engine process's parent, until the host dies
        }
