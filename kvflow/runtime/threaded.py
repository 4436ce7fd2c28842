"""Run an engine on its own thread and loop, for synchronous hosts such as vLLM's hooks.

Why: an inference engine's scheduler and workers call their connector from plain threads and
must never block on I/O.  `EngineThread` owns a dedicated thread running an event loop (uvloop
when installed) with the engine on it.  Any thread may submit work: each call returns a
`concurrent.futures.Future` at once, to be ignored or waited on with a deadline.  Outcomes and
released blocks are queued and read with the non-blocking `poll_*` methods.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

from kvflow.errors import EngineClosed, EngineTimeout
from kvflow.protocol.actions import ReleaseBlocks
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.requests import Abort, Expect, KvReady, Request
from kvflow.protocol.state import Mode, Role
from kvflow.runtime.engine import Engine
from kvflow.runtime.loop import new_event_loop
from kvflow.runtime.results import TransferHandle, TransferResult
from kvflow.transports.base import drain

__all__ = ("EngineThread",)

T = TypeVar("T")
_Call = tuple[Callable[[Engine], Awaitable[Any]], concurrent.futures.Future[Any]]


class EngineThread:
    """`factory` builds the engine on the engine thread (so it binds to that loop), after
    `thread_setup` has run there (a GPU host binds the thread to its device).

    Each submitting method returns a future that carries what the engine method it calls
    returns or raises (see `Engine`); the method itself raises only `EngineClosed`.

    :raises EngineTimeout: the engine did not start within `start_timeout`.
    :raises TransportError: the transport refused the engine's memory (from `Engine.start`);
        whatever `factory` or `thread_setup` raised propagates as it is.
    """

    def __init__(
        self,
        factory: Callable[[], Engine],
        *,
        name: str = "kvflow-engine",
        start_timeout: float = 30.0,
        thread_setup: Callable[[], None] | None = None,
    ):
        self._loop = new_event_loop()
        self._ready: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        self._tasks: set[asyncio.Task[None]] = set()  # the calls running, referenced until done
        self._batching = threading.local()  # per calling thread: the calls of its open `batch`
        self._thread = threading.Thread(target=self._run, args=(factory, thread_setup), name=name, daemon=True)
        self._thread.start()
        try:
            self.engine = self._ready.result(timeout=start_timeout)
        except concurrent.futures.TimeoutError:
            raise EngineTimeout(f"engine thread {name!r} did not start within {start_timeout}s") from None

    def _run(self, factory: Callable[[], Engine], thread_setup: Callable[[], None] | None) -> None:
        asyncio.set_event_loop(self._loop)

        async def boot() -> None:
            if thread_setup is not None:
                thread_setup()
            engine = factory()
            await engine.start()
            self._ready.set_result(engine)

        try:
            self._loop.run_until_complete(boot())
        except BaseException as exc:
            self._ready.set_exception(exc)
            self._loop.close()
            return
        self._loop.run_forever()
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

    # ------------------------------------------------------------------ submitting work

    def call(self, fn: Callable[[Engine], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the engine's loop; returns at once.  Inside `batch`, on the
        thread that opened it, the call starts when the batch ends.

        :raises EngineClosed: the engine thread has stopped.
        """
        if not self._thread.is_alive() or self._loop.is_closed():
            raise EngineClosed("engine thread is not running")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        pending: list[_Call] | None = getattr(self._batching, "calls", None)
        if pending is not None:
            pending.append((fn, future))
        else:
            self._wake([(fn, future)])
        return future

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """The calls this thread makes inside start together when it ends, in their order: one
        wake-up of the engine thread for them all.  A wake-up costs the caller a write to the
        loop's wake-up pipe (tens of microseconds); a host engine's hook pays it once.  Nested
        batches join the outer one.  Never raises (calls the closed thread cannot take fail
        their futures with `EngineClosed`)."""
        if getattr(self._batching, "calls", None) is not None:
            yield
            return
        self._batching.calls = []
        try:
            yield
        finally:
            calls, self._batching.calls = self._batching.calls, None
            if calls:
                self._wake(calls)

    def _wake(self, calls: list[_Call]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._start, calls)
        except RuntimeError:  # the loop closed meanwhile
            for _, future in calls:
                if future.set_running_or_notify_cancel():
                    future.set_exception(EngineClosed("engine thread is not running"))

    def _start(self, calls: list[_Call]) -> None:
        """On the engine thread: start each call, in order (each runs to its first await)."""
        for fn, future in calls:
            if future.set_running_or_notify_cancel():
                task = self._loop.create_task(self._run_call(fn, future))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _run_call(self, fn: Callable[[Engine], Awaitable[Any]], future: concurrent.futures.Future[Any]) -> None:
        try:
            result = await fn(self.engine)
        except BaseException as exc:  # the caller's future carries whatever `fn` raised
            future.set_exception(exc)
        else:
            future.set_result(result)

    def connect(self, peer: str) -> concurrent.futures.Future[None]:
        """`Engine.connect` on the engine thread.  :raises EngineClosed: the thread has stopped."""
        return self.call(lambda e: e.connect(peer))

    @overload
    def submit(self, request: Expect | KvReady) -> concurrent.futures.Future[TransferHandle]: ...

    @overload
    def submit(self, request: Abort) -> concurrent.futures.Future[None]: ...

    def submit(self, request: Request) -> concurrent.futures.Future[Any]:
        """`Engine.submit` on the engine thread.  :raises EngineClosed: the thread has stopped."""
        return self.call(lambda e: e.submit(request))

    def expect(
        self,
        transfer_id: str,
        epoch: int,
        *,
        peer: str,
        block_ids: Sequence[int],
        mode: Mode = Mode.PUSH,
        expected_batches: int = 1,
        timeout: float | None = None,
        first_position: int = 0,
        share: str = "",
        layers: tuple[int, int] | None = None,
    ) -> concurrent.futures.Future[TransferHandle]:
        """`submit` of an `Expect` of these fields, as `Engine.expect` makes it.
        :raises EngineClosed: the thread has stopped."""
        key = TransferKey(transfer_id, epoch)
        return self.submit(Expect(key, peer, block_ids, mode, expected_batches, first_position, share, layers, timeout))

    def kv_ready(
        self,
        transfer_id: str,
        epoch: int,
        *,
        block_ids: Sequence[int],
        final: bool = True,
        first_position: int = 0,
        layers: tuple[int, int] | None = None,
        mode: Mode = Mode.PUSH,
        peer: str | None = None,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[TransferHandle]:
        """`submit` of a `KvReady` of these fields, as `Engine.kv_ready` makes it.
        :raises EngineClosed: the thread has stopped."""
        key = TransferKey(transfer_id, epoch)
        return self.submit(KvReady(key, block_ids, final, first_position, layers, mode, peer, timeout))

    def abort(
        self,
        transfer_id: str,
        epoch: int,
        role: Role,
        reason: str = "aborted by caller",
        *,
        peer: str | None = None,
        mode: Mode = Mode.PUSH,
    ) -> concurrent.futures.Future[None]:
        """`submit` of an `Abort` of these fields, as `Engine.abort` makes it.
        :raises EngineClosed: the thread has stopped."""
        return self.submit(Abort(TransferKey(transfer_id, epoch), role, reason, peer, mode))

    # ------------------------------------------------------------------ reading results

    def poll_finished(self) -> list[TransferResult]:
        """Outcomes decided since the last call (never blocks)."""
        return drain(self.engine.finished)

    def poll_released(self) -> list[ReleaseBlocks]:
        """Blocks handed back since the last call (never blocks)."""
        return drain(self.engine.released)

    def close(self, timeout: float = 60.0) -> None:
        """Close the engine (draining it) and stop the thread; waits at most `timeout` seconds.

        :raises EngineCrashed: the engine recorded a background failure.
        :raises EngineTimeout: closing took longer than `timeout`.
        :raises EngineClosed: the engine thread had stopped without closing the engine.
        """
        if self._loop.is_closed():
            return
        future = self.call(lambda e: e.aclose())
        try:
            future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise EngineTimeout(f"engine did not close within {timeout}s") from None
        finally:
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=timeout)
