"""Where data-plane submissions run: a dedicated writer thread, or inline for tests.

Why a thread: planning descriptors and posting an RDMA op can take milliseconds for a long,
fragmented prompt (vLLM measured `postXfer` growing to 46 ms).  Doing that on the event loop
would stall every other transfer; doing it on the host engine's thread would stall inference.
Jobs run in submission order.  A peer's addition and removal run on another thread of the same
kind (see `kvflow.runtime.peering`); the transport contract makes a job still queued here for a
peer be refused once `remove_peer` has returned.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Protocol

from kvflow.errors import EngineClosed

__all__ = ("InlineSubmitter", "Submitter", "WriterThread")

Job = Callable[[], None]


class Submitter(Protocol):
    def submit(self, job: Job) -> None:
        """Run `job` soon, after every job submitted before it.  :raises EngineClosed: closed."""

    def idle(self) -> bool:
        """No job is queued or running (a job run elsewhere now keeps the order).  Never raises."""

    def close(self, timeout: float) -> None:
        """Run what is queued, then stop (waiting at most `timeout` seconds)."""


class WriterThread:
    """One daemon thread running jobs in order; a job's exception goes to `on_error`.
    `thread_setup` runs first on the thread (a GPU host binds it to its device there).  The
    thread starts with the first job, so that an engine never started (or whose start failed)
    leaves none behind."""

    def __init__(
        self, name: str, on_error: Callable[[BaseException], None], *, thread_setup: Callable[[], None] | None = None
    ) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._pending = 0  # jobs submitted and not finished (under `_count`)
        self._count = threading.Lock()
        self._on_error = on_error
        self._thread_setup = thread_setup
        self._closed = False
        self._started = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def submit(self, job: Job) -> None:
        with self._count:
            if self._closed:
                raise EngineClosed("writer thread is closed")
            self._pending += 1
            if not self._started:
                self._started = True
                self._thread.start()
        self._jobs.put(job)

    def idle(self) -> bool:
        return self._pending == 0

    def close(self, timeout: float) -> None:
        with self._count:
            if self._closed:
                return
            self._closed = True
            started = self._started
        if not started:
            return  # no thread to stop
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        if self._thread_setup is not None:
            try:
                self._thread_setup()
            except Exception as exc:
                self._on_error(exc)
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception as exc:
                self._on_error(exc)
            finally:
                with self._count:
                    self._pending -= 1


class InlineSubmitter:
    """Runs each job at once in the caller's thread: deterministic, for tests and simulation."""

    def __init__(self) -> None:
        self._closed = False

    def submit(self, job: Job) -> None:
        if self._closed:
            raise EngineClosed("submitter is closed")
        job()

    def idle(self) -> bool:
        return True

    def close(self, timeout: float) -> None:
        self._closed = True
