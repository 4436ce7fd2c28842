"""A worker rank's link to its engine, wherever the engine runs: in a process of its own, or on a thread.

Why two: an engine on a thread of the model runner's process (`EngineThread`) shares the host's
interpreter, and its Python work lengthens the host's steps (`kvflow bench host`); an engine in
its own process (`kvflow.runtime.process.EngineProcess`) does not, but needs the KV memory to
be shareable (host memory, moved onto shared memory in place) and a transport that crosses
processes.  So a rank runs its engine in a process when it can, and on a thread for what a
process cannot serve yet: GPU memory (CUDA IPC is not built), a transport the host injected
(the in-process loopback fabric of tests), and a fake device.  Both run the same `RankAgent`
commands, so the worker is written once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any, Protocol

from kvflow.errors import EngineTimeout
from kvflow.integrations.vllm.rank_agent import RankAgent
from kvflow.protocol.actions import ReleaseBlocks
from kvflow.runtime.engine import Engine
from kvflow.runtime.meter import MeterReading
from kvflow.runtime.process import EngineProcess
from kvflow.runtime.threaded import EngineThread

__all__ = ("ProcessLink", "EngineLink", "ThreadLink")


class EngineLink(Protocol):
    """A rank's engine and agent, driven from the model runner's thread without blocking it."""

    address: str

    def command(self, name: str, *args: Any, lazy: bool = False) -> concurrent.futures.Future[Any]:
        """Run `RankAgent.<name>(*args)` with the engine; returns at once.  A `lazy` command
        may wait for the next one that is not, or for the step's results.
        :raises EngineClosed: the engine has stopped."""

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """The commands given inside start together when it ends.  Never raises."""

    def wait(self, future: concurrent.futures.Future[Any], timeout: float) -> Any:
        """Block until a command's `future` is settled (for what is not on a step's path, such
        as sleep mode's hooks); its result.  Released blocks stay for `poll_released`.
        :raises EngineTimeout: not within `timeout` seconds.
        :raises KVFlowError: what the command raised, or the engine has stopped."""

    def poll_released(self) -> list[ReleaseBlocks]:
        """Blocks handed back since the last call.  Never blocks."""

    def meter_take(self) -> MeterReading:
        """The engine's per-transfer figures since the last call.  Never blocks."""

    @property
    def engine(self) -> Engine | None:
        """The engine object, where it lives in this process (for inspection), else None."""

    def close(self, timeout: float) -> None:
        """Close the engine (draining it).  :raises EngineCrashed, EngineTimeout: see the implementations."""


class ThreadLink:
    """The engine on a thread of this process (`EngineThread`), its agent with it."""

    def __init__(self, thread: EngineThread, transfer_timeout: float, device: Any) -> None:
        self.thread = thread
        self.address = thread.engine.control.address
        self._options = (transfer_timeout, device)
        self._agent: RankAgent | None = None  # made on the engine thread, by the first command

    def command(self, name: str, *args: Any, lazy: bool = False) -> concurrent.futures.Future[Any]:
        def run(engine: Engine) -> Any:
            if self._agent is None:
                self._agent = RankAgent(engine, *self._options)
            return getattr(self._agent, name)(*args)

        return self.thread.call(run)

    def batch(self) -> contextlib.AbstractContextManager[None]:
        return self.thread.batch()

    def wait(self, future: concurrent.futures.Future[Any], timeout: float) -> Any:
        """:raises EngineTimeout, KVFlowError: see `EngineLink.wait`."""
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise EngineTimeout(f"engine thread: no answer within {timeout}s") from None

    def poll_released(self) -> list[ReleaseBlocks]:
        self.thread.poll_finished()  # outcomes are read from releases; keep the queue short
        return self.thread.poll_released()

    def meter_take(self) -> MeterReading:
        return self.thread.engine.meter.take()

    @property
    def engine(self) -> Engine | None:
        return self.thread.engine

    def close(self, timeout: float) -> None:
        """:raises EngineCrashed, EngineTimeout: see `EngineThread.close`."""
        agent = self._agent
        try:
            self.thread.close(timeout=timeout)
        finally:
            if agent is not None:
                agent.close()


class ProcessLink:
    """The engine in a process of its own (`EngineProcess`), its agent there."""

    def __init__(self, process: EngineProcess) -> None:
        self.process = process
        self.address = process.address

    def command(self, name: str, *args: Any, lazy: bool = False) -> concurrent.futures.Future[Any]:
        return self.process.call(name, *args, lazy=lazy)

    def batch(self) -> contextlib.AbstractContextManager[None]:
        return self.process.batch()

    def wait(self, future: concurrent.futures.Future[Any], timeout: float) -> Any:
        """:raises EngineTimeout, KVFlowError: see `EngineProcess.wait`."""
        return self.process.wait(future, timeout)

    def poll_released(self) -> list[ReleaseBlocks]:
        return self.process.poll_released()

    def meter_take(self) -> MeterReading:
        return self.process.meter_take()

    @property
    def engine(self) -> Engine | None:
        return None

    def close(self, timeout: float) -> None:
        """:raises EngineCrashed: see `EngineProcess.close`."""
        self.process.close(timeout=timeout)
