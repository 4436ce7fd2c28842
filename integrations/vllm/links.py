"""A worker rank's link to its engine, wherever the engine runs: in a process of its own, or on a thread.

Why two: an engine on a thread of the model runner's process (`EngineThread`) shares the host's
interpreter, and its Python work lengthens the host's steps (`kvflow bench host`); an engine in
its own process (`kvflow.runtime.process.EngineProcess`) does not, but needs the KV memory to
be shareable (host memory, moved onto shared memory in place) and a transport that crosses
processes.  So a rank runs its engine in a process when it can, and on a thread for what a
process cannot serve yet: GPU memory (CUDA IPC is not built) and a transport the host injected
(the in-process loopback fabric of tests).  Both run the same `RankAgent` commands, so the
worker is written once.

Gates and the engine process: a device gate (what a hook recorded after enqueueing the KV's
kernels) is an object of this process.  The thread link hands it to the agent, which waits for
it before its WRITE; the process link keeps a command that carries one here, with every command
given after it (their order is the engine's), until a waiter thread of this process has seen
the device run the gate's work, and only then sends them, the gate left out.  A WRITE can
therefore not start before its bytes are written, whichever side waits; a device that never
finishes keeps the commands until `close`, and the engine's transfer deadlines fail what they
held meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from kvflow.errors import EngineBusy, EngineClosed, EngineTimeout, KVFlowError
from kvflow.integrations.vllm.device import Device, Gate, GateWaiter, HostDevice, is_gate
from kvflow.integrations.vllm.rank_agent import RankAgent, Reach
from kvflow.protocol.actions import ReleaseBlocks
from kvflow.protocol.requests import Request
from kvflow.runtime.bell import Bell
from kvflow.runtime.engine import Engine
from kvflow.runtime.meter import MeterReading
from kvflow.runtime.process import EngineProcess
from kvflow.runtime.threaded import EngineThread

__all__ = ("EngineLink", "ProcessLink", "ThreadLink", "failed_future", "send_request")


class EngineLink(Protocol):
    """A rank's engine and agent, driven from the model runner's thread without blocking it."""

    address: str

    def command(
        self, name: str, *args: Any, lazy: bool = False, always: bool = False
    ) -> concurrent.futures.Future[Any]:
        """Run `RankAgent.<name>(*args)` with the engine; returns at once.  A `lazy` command
        may wait for the next one that is not, or for the step's results.  An engine that has
        stopped (or whose process died) fails the future with `EngineClosed`, and an engine
        process that owes too many answers fails one that starts work with `EngineBusy`,
        unless it is `always` (it ends, frees or continues work the engine took): a hook that
        gives a command never raises for it."""

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """The commands given inside start together when it ends.  Never raises."""

    def wait(self, future: concurrent.futures.Future[Any], timeout: float) -> Any:
        """Block until a command's `future` is settled (for what is not on a step's path, such
        as sleep mode's hooks); its result.  Released blocks stay for `poll_released`.
        :raises EngineTimeout: not within `timeout` seconds.
        :raises KVFlowError: what the command raised, or the engine has stopped."""

    def poll_released(self) -> list[ReleaseBlocks]:
        """Blocks handed back since the last call.  Never blocks."""

    def wait_for_engine(self, timeout: float, ready: Callable[[], bool]) -> None:
        """Sleep until the engine has news for `poll_released` (or a command's answer), or
        `timeout` seconds pass: for a step with nothing else to do; not at all if `ready()`
        (the caller's own look, made after this link can no longer miss news).  Never raises."""

    @property
    def woken(self) -> int:
        """How many of those sleeps the engine's news ended (not their deadline)."""

    def meter_take(self) -> MeterReading:
        """The engine's per-transfer figures since the last call.  Never blocks."""

    @property
    def engine(self) -> Engine | None:
        """The engine object, where it lives in this process (for inspection), else None."""

    def close(self, timeout: float) -> None:
        """Close the engine (draining it).  :raises EngineCrashed, EngineTimeout: see the implementations."""


def send_request(
    link: EngineLink, request: Request, reach: Reach | None = None, gate: Gate | None = None, *, always: bool = False
) -> concurrent.futures.Future[Any]:
    """Give `request` to the rank's agent through its one door for the engine's requests
    (`RankAgent.submit`), in its wire form, with the other side's rank it names (`reach`) and
    the device's `gate` it waits for (`always`: see `EngineLink.command`).  Returns at once.
    :raises ConfigError: see `EngineLink.command`."""
    wire = (request.to_wire(), None if reach is None else reach.to_wire(), gate)
    return link.command("submit", *wire, always=always)


class ThreadLink:
    """The engine on a thread of this process (`EngineThread`), its agent with it."""

    def __init__(
        self,
        thread: EngineThread,
        transfer_timeout: float,
        device: Any,
        news: threading.Event,
        bell: Bell | None = None,
    ) -> None:
        """`news` is set by the engine whenever it gives blocks back (its `on_release`); `bell`
        (its engine core's) is rung when a command fails, as the engine rings it for blocks."""
        self.thread = thread
        self._news = news
        self._bell = bell
        self.woken = 0  # waits of `wait_for_engine` the engine's news ended
        self.address = thread.engine.control.address
        self._options = (transfer_timeout, device)
        self._agent: RankAgent | None = None  # made on the engine thread, by the first command

    def command(
        self, name: str, *args: Any, lazy: bool = False, always: bool = False
    ) -> concurrent.futures.Future[Any]:
        def run(engine: Engine) -> Any:
            if self._agent is None:
                self._agent = RankAgent(engine, *self._options)
            return getattr(self._agent, name)(*args)

        try:
            future = self.thread.call(run)
        except EngineClosed as exc:
            return failed_future(exc)
        future.add_done_callback(partial(self._answered, news=name in RankAgent.NEWS))
        return future

    def _answered(self, future: concurrent.futures.Future[Any], news: bool = False) -> None:
        self._news.set()  # a step asleep in `wait_for_engine` acts on the answer
        if self._bell is not None and not future.cancelled() and (news or future.exception() is not None):
            self._bell.ring()  # a failed registration fails its load at the next step; a first token frees one

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

    def wait_for_engine(self, timeout: float, ready: Callable[[], bool]) -> None:
        self._news.clear()  # before the looks: news after it sets it again
        if self.thread.engine.released or ready():
            return
        if self._news.wait(max(0.0, timeout)):
            self.woken += 1

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
            if self._bell is not None:
                self._bell.close()


@dataclass(slots=True)
class _Held:
    """A command the process link keeps until the device has run its gate's work."""

    name: str
    args: tuple[Any, ...]
    lazy: bool
    always: bool
    future: concurrent.futures.Future[Any]  # the caller's
    gate: concurrent.futures.Future[None] | None  # settled once the device ran the work (None: no gate)


def failed_future(exc: BaseException) -> concurrent.futures.Future[Any]:
    """A future already failed with `exc`."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_exception(exc)
    return future


def _settle_from(outer: concurrent.futures.Future[Any], inner: concurrent.futures.Future[Any]) -> None:
    error = inner.exception()
    if error is not None:
        outer.set_exception(error)
    else:
        outer.set_result(inner.result())


class ProcessLink:
    """The engine in a process of its own (`EngineProcess`), its agent there; gates are waited
    for here (see the module's header)."""

    def __init__(self, process: EngineProcess, device: Device) -> None:
        self.process = process
        self.address = process.address
        self._device = device
        self._gated = not isinstance(device, HostDevice)  # host memory records no gates: no look at each call
        self._waiter: GateWaiter | None = None  # started by the first gate not yet done
        self._held: deque[_Held] = deque()
        self._lock = threading.Lock()  # taken before the process's own, never after it

    def command(
        self, name: str, *args: Any, lazy: bool = False, always: bool = False
    ) -> concurrent.futures.Future[Any]:
        """:raises ConfigError: see `EngineProcess.call` (a command held behind a gate fails its
        future with it instead, once sent)."""
        if not self._gated:  # the hooks' common case, kept as cheap as a direct call
            return self._call(name, args, lazy, always)
        gate = next((arg for arg in args if is_gate(arg)), None)
        if gate is not None:
            args = tuple(None if arg is gate else arg for arg in args)
        waiting = None if gate is None or gate.done() else self._gates().submit(gate)
        with self._lock:
            if waiting is None and not self._held:
                return self._call(name, args, lazy, always)
            held = _Held(name, args, lazy, always, concurrent.futures.Future(), waiting)
            self._held.append(held)
        if waiting is not None:
            waiting.add_done_callback(lambda _: self._flush())
        return held.future

    def _call(self, name: str, args: tuple[Any, ...], lazy: bool, always: bool) -> concurrent.futures.Future[Any]:
        """The call sent; a dead engine process, or one owing too many answers, fails its
        future.  :raises ConfigError: see `EngineProcess.call`."""
        try:
            return self.process.call(name, *args, lazy=lazy, always=always)
        except (EngineClosed, EngineBusy) as exc:
            return failed_future(exc)

    def _gates(self) -> GateWaiter:
        if self._waiter is None:
            self._waiter = GateWaiter(self._device, f"kvflow-gates-{self.process.engine_id}")
        return self._waiter

    def _flush(self) -> None:
        """Send the held commands, in order, up to the first whose gate is still closed; one
        whose gate failed (a device error) fails with it, unsent."""
        with self._lock:
            while self._held and (self._held[0].gate is None or self._held[0].gate.done()):
                held = self._held.popleft()
                error = held.gate.exception() if held.gate is not None else None
                if error is not None:
                    held.future.set_exception(error)
                    continue
                try:
                    inner = self.process.call(held.name, *held.args, lazy=held.lazy, always=held.always)
                except KVFlowError as exc:
                    held.future.set_exception(exc)
                    continue
                inner.add_done_callback(partial(_settle_from, held.future))

    def batch(self) -> contextlib.AbstractContextManager[None]:
        return self.process.batch()

    def wait(self, future: concurrent.futures.Future[Any], timeout: float) -> Any:
        """:raises EngineTimeout, KVFlowError: see `EngineProcess.wait`."""
        return self.process.wait(future, timeout)

    def poll_released(self) -> list[ReleaseBlocks]:
        return self.process.poll_released()

    def wait_for_engine(self, timeout: float, ready: Callable[[], bool]) -> None:
        if not ready():  # an answer coming after this look wakes the sleep (`wait_for_answers`)
            self.process.wait_for_answers(timeout)

    @property
    def woken(self) -> int:
        return self.process.woken

    def meter_take(self) -> MeterReading:
        return self.process.meter_take()

    @property
    def engine(self) -> Engine | None:
        return None

    def close(self, timeout: float) -> None:
        """Send what the device lets go within half of `timeout`, fail the rest (EngineClosed),
        then close the process.  :raises EngineCrashed: see `EngineProcess.close`."""
        if self._waiter is not None:
            with self._lock:
                gates = [entry.gate for entry in self._held if entry.gate is not None]
            concurrent.futures.wait(gates, timeout=timeout / 2)
            self._flush()
            with self._lock:
                left, self._held = list(self._held), deque()
            for entry in left:
                entry.future.set_exception(EngineClosed("the engine closed before the device ran the KV's kernels"))
            self._waiter.close(timeout=1.0)
        self.process.close(timeout=timeout / 2 if self._waiter is not None else timeout)
