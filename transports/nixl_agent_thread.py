"""The thread that owns a NIXL agent: other threads hand it jobs and wait for them.

Why a module of its own: NIXL's default thread-sync mode is NONE, and in RW mode a long
synchronous post in one thread blocks notification polling in another, so one thread makes the
agent's calls and every other thread goes through it.  How that thread runs (a queue of jobs, a
call that waits for its job with a timeout, the pace at which it polls between jobs, and its
death, which must fail every caller waiting and to come rather than leave one hanging) does not
depend on which calls the NIXL transport (`kvflow.transports.nixl`) makes; apart, each of the
two reads as one concern.  The transport owns an `AgentThread` and hands it, as `AgentWork`,
what to run on it: the thread knows nothing of the transport but those five callables.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvflow.errors import TransportError

__all__ = ("AgentThread", "AgentWork")


@dataclass(frozen=True, slots=True)
class AgentWork:
    """What the agent thread runs for its owner, every one of them on the agent thread."""

    start_agent: Callable[[], None]  # first: what it raises, `AgentThread.start` raises
    progress: Callable[[], None]  # after every job and every wait that found none
    busy: Callable[[], bool]  # whether the owner has ops of its own in flight (then no wait)
    die: Callable[[BaseException], None]  # last act after what raised: calls `fail`, then `bury`
    teardown: Callable[[], None]  # last act after `close`


class AgentThread:
    """One thread, ``kvflow-nixl-<name>``, that owns a NIXL agent and runs `work` on it.

    The owner sets itself up, then calls `start`: the thread runs ``work.start_agent`` first,
    then each job handed to it by `call` (or a wake-up, `wake`), and ``work.progress`` after
    each.  It waits for the next job not at all while ``work.busy()``, `idle_poll` while the
    engine has transfers under way (`expect_traffic`), `lazy_poll` while it has none (NIXL
    cannot wake a thread when a notification arrives: it is polled).  `close` ends it, and
    ``work.teardown`` is its last act.  Whatever raises on it ends it too, and ``work.die`` is
    its last act: that calls `fail` and, once what was in flight has failed, `bury`, which wakes
    every `call` waiting.
    """

    def __init__(self, name: str, work: AgentWork, *, idle_poll: float, lazy_poll: float, call_timeout: float) -> None:
        self.name = name
        self._work = work
        self._idle_poll = idle_poll
        self._lazy_poll = lazy_poll
        self._traffic = True  # transfers under way, until the engine says otherwise
        self.call_timeout = call_timeout  # how long `call` and `start` wait, and `close` joins
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._closed = False
        self._failure: BaseException | None = None  # what ended the agent thread, once something has
        self._death: concurrent.futures.Future[None] = concurrent.futures.Future()  # wakes `call`s

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    def start(self) -> None:
        """Start the agent thread and wait until ``work.start_agent`` has run on it.

        :raises TransportError: the thread did not start within `call_timeout`.
        """
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._run, args=(started,), name=f"kvflow-nixl-{self.name}", daemon=True)
        self.thread.start()
        try:
            started.result(timeout=self.call_timeout)
        except concurrent.futures.TimeoutError:
            raise TransportError(f"NIXL agent {self.name!r} did not start within {self.call_timeout}s") from None

    def _run(self, started: concurrent.futures.Future[None]) -> None:
        try:
            self._work.start_agent()
        except BaseException as exc:
            started.set_exception(exc)
            return
        started.set_result(None)
        try:
            while True:
                try:
                    job = self.jobs.get(
                        timeout=0 if self._work.busy() else self._idle_poll if self._traffic else self._lazy_poll
                    )
                except queue.Empty:
                    job = None if self._closed else _noop
                if job is None:
                    break
                job()
                self._work.progress()
        except BaseException as exc:  # a bug (kvflow's, NIXL's, the listener's): nothing may hang on it
            self._work.die(exc)
            return
        self._work.teardown()

    def fail(self, exc: BaseException) -> None:
        """Record what ended the agent thread: `check_alive`, and every `call` to come, raise naming it."""
        self._failure = exc

    def bury(self) -> None:
        """After `fail`: every `call` waiting wakes and raises naming the failure."""
        self._death.set_result(None)

    def dead_message(self) -> str:
        return f"NIXL agent thread of {self.name!r} died: {type(self._failure).__name__}: {self._failure}"

    def check_alive(self) -> None:
        """:raises TransportError: the agent thread died (chained to what ended it)."""
        if self._failure is not None:
            raise TransportError(self.dead_message()) from self._failure

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the agent thread and wait for its result.

        :raises TransportError: the transport is closed, its agent thread died (before or while
            `fn` waited), `fn` failed, or it took too long.
        """
        self.check_alive()
        if self._closed:
            raise TransportError(f"NIXL transport {self.name!r} is closed")
        if threading.current_thread() is self.thread:
            return fn()
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def job() -> None:
            try:
                result.set_result(fn())
            except BaseException as exc:
                result.set_exception(exc)

        self.jobs.put(job)
        concurrent.futures.wait((result, self._death), self.call_timeout, concurrent.futures.FIRST_COMPLETED)
        if not result.done():
            self.check_alive()
            raise TransportError(f"NIXL {what} took longer than {self.call_timeout}s")
        return result.result()

    def wake(self) -> None:
        """Wake the agent thread from its wait: it makes progress at once."""
        self.jobs.put(_noop)

    def expect_traffic(self, active: bool) -> None:
        was, self._traffic = self._traffic, active
        if active and not was:
            self.wake()  # from its lazy wait: poll at the idle rate now

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.jobs.put(None)
        self.thread.join(timeout=self.call_timeout)


def _noop() -> None:
    return None
