"""The one seam between kvflow's vLLM worker and the GPU.

Why a seam: on a GPU the forward only *enqueues* the kernels that write a layer's KV; the hooks
return long before the device has run them.  A WRITE posted then moves stale bytes.  So each
hook that hands KV to kvflow records an event on the current stream (`Device.record`), and the
WRITE waits for that event on a waiter thread that blocks in ``cudaEventSynchronize`` with the
GIL released (`GateWaiter`): no stream synchronize on the model runner's thread (async
scheduling keeps its overlap), no polling.  And every thread kvflow starts that touches GPU
memory or NIXL is bound to the device first (`Device.bind_thread`), as vLLM does for its NIXL
threads: UCX disables CUDA IPC on a thread with no CUDA device set.

Everything GPU-only is here.  `device_for` picks the device of the KV tensors; a host that
builds the connector itself may hand it another (`KVFlowConnector.inject`): the stand-in's fake
device, whose kernels run when the test says, so the gate's order is tested on CPU: a WRITE
posted before its gate opens moves bytes the fake device has not written.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from typing import TYPE_CHECKING, Any, Protocol

from kvflow.errors import TransferTimeout, TransportError

if TYPE_CHECKING:
    import torch

__all__ = ("CudaDevice", "Device", "Gate", "GateWaiter", "HostDevice", "device_for", "is_gate")


class Gate(Protocol):
    """The device work enqueued before the gate was recorded."""

    def done(self) -> bool:
        """Whether that work has run (never blocks)."""

    def wait(self) -> None:
        """Block until it has run (releasing the GIL while blocked).

        :raises RuntimeError: the device reported an error (torch raises CUDA errors so).
        """


class Device(Protocol):
    """Where the KV caches live."""

    def bind_thread(self) -> None:
        """Make the calling thread use this device."""

    def record(self) -> Gate | None:
        """A gate after the work enqueued so far on the current stream; None when KV writes are
        done by the time the hook runs (host memory)."""


class HostDevice:
    """KV caches in host memory: written when the forward returns, nothing to bind."""

    def bind_thread(self) -> None:
        return None

    def record(self) -> Gate | None:
        return None


class _CudaGate:
    def __init__(self, event: Any) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        self._event.synchronize()  # cudaEventSynchronize, GIL released by torch


class CudaDevice:
    """KV caches on CUDA device `index`."""

    def __init__(self, index: int) -> None:
        self.index = index

    def bind_thread(self) -> None:
        import torch

        torch.cuda.set_device(self.index)

    def record(self) -> Gate | None:
        import torch

        # blocking: the waiter sleeps in cudaEventSynchronize instead of spinning a core on it
        event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        # the hooks run inside the forward (or right after it), on its thread: the current
        # stream is the one the forward enqueued the layer's KV writes on
        event.record(torch.cuda.current_stream(self.index))
        return _CudaGate(event)


def is_gate(value: object) -> bool:
    """Whether `value` is a `Gate` (what a hook recorded), not plain data."""
    return callable(getattr(value, "done", None)) and callable(getattr(value, "wait", None))


def device_for(tensor: torch.Tensor) -> Device:
    """The device holding `tensor`."""
    if tensor.device.type == "cuda":
        return CudaDevice(int(tensor.device.index or 0))
    return HostDevice()


class GateWaiter:
    """One thread, bound to the device, that waits for gates in the order they were recorded
    (the order a stream runs them in) and wakes the awaiting coroutine."""

    def __init__(self, device: Device, name: str) -> None:
        self._device = device
        self._gates: queue.SimpleQueue[tuple[Gate, concurrent.futures.Future[None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._device.bind_thread()
        while (item := self._gates.get()) is not None:
            gate, future = item
            if future.set_running_or_notify_cancel():
                try:
                    gate.wait()
                except RuntimeError as exc:  # a device error: this transfer fails, the waiter goes on
                    error = TransportError(f"waiting for the device failed: {type(exc).__name__}: {exc}")
                    error.__cause__ = exc
                    future.set_exception(error)
                except Exception as exc:  # a bug: the waiting caller gets it as it is
                    future.set_exception(exc)
                else:
                    future.set_result(None)

    def submit(self, gate: Gate) -> concurrent.futures.Future[None]:
        """A future settled once the device has run the work before `gate` (gates are waited
        for in the order they were submitted); it fails with `TransportError` on a device error.
        Never blocks."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._gates.put((gate, future))
        return future

    async def wait(self, gate: Gate | None, timeout: float) -> None:
        """Return once the device has run the work before `gate` (at once when it has).

        :raises TransferTimeout: not within `timeout` seconds.
        :raises TransportError: the device reported an error (a `RuntimeError` from the gate);
            anything else the gate raises is a bug and reaches the caller as it is.
        """
        if gate is None or gate.done():
            return
        future = self.submit(gate)
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except TimeoutError:
            raise TransferTimeout(f"the device did not finish writing the KV within {timeout}s") from None

    def close(self, timeout: float = 5.0) -> None:
        self._gates.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
