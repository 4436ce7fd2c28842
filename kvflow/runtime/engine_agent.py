"""The engine's API as commands (`EngineAgent`), and the agent an engine process is told to run.

Why a module of its own: the agent is the contract between a host and the engine it drives,
not part of the program that serves it.  An embedder extends it with its own commands (vLLM's
connector: `kvflow.integrations.vllm.rank_agent`), and the same agent runs on an engine thread
or in an engine process (`kvflow.runtime.engine_process`), so an embedder imports it from here
without the process's rings, sockets and memory mappings.  Only the names an agent lists in
`COMMANDS` can be called; the engine's requests (`kvflow.protocol.requests`) all come through
one of them, `submit`, in their wire form, and their type is the one their tag names in that
module's table, never a method the host names.  `agent_class` finds the agent a process's spec
names (``module:Class``) and refuses anything that is not an `EngineAgent`.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

from kvflow.errors import ConfigError
from kvflow.protocol.requests import request_from_wire
from kvflow.runtime.engine import Engine

__all__ = ("EngineAgent", "agent_class")


class EngineAgent:
    """The engine's API as commands the host may call (arguments and results plain data)."""

    COMMANDS: ClassVar[frozenset[str]] = frozenset(
        {"connect", "submit", "promise", "stats", "unregister_memory", "restore_memory"}
    )

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def connect(self, peer: str, address: str = "") -> None:
        await self.engine.connect(peer, address)

    async def submit(self, wire: Any) -> None:
        """The engine's requests' one door: `wire`, a request's wire form (`Expect`, `KvReady`,
        `Abort` of `kvflow.protocol.requests`), is made the request its tag names and submitted.

        :raises MalformedRequest: `wire` is not a request's wire form (nothing is submitted).
        :raises KVFlowError: see `Engine.submit`.
        """
        await self.engine.submit(request_from_wire(wire))

    async def promise(self, transfer_id: str, epoch: int, peer: str) -> None:
        await self.engine.promise(transfer_id, epoch, peer=peer)

    async def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    async def unregister_memory(self) -> None:
        """:raises KVFlowError: see `Engine.unregister_memory`."""
        await self.engine.unregister_memory()

    async def restore_memory(self) -> None:
        """:raises KVFlowError: see `Engine.restore_memory`."""
        await self.engine.restore_memory()

    def close(self) -> None:
        """The engine is about to close: let go of anything the agent runs itself."""


def agent_class(path: str) -> type[EngineAgent]:
    """:raises ConfigError: `path` (``module:Class``) names no `EngineAgent`."""
    module, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"no engine agent {path!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, EngineAgent)):
        raise ConfigError(f"{path!r} is not an EngineAgent")
    return cls
