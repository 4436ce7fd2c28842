"""The GPU seam, driven on CPU: a device that runs the forward's KV writes after the hooks
return, as kernels on a GPU do.

A WRITE that does not wait for the gate of its layers moves pages the device has not written
(D's byte check fails); a hook that waits for the device raises (the stand-in's device refuses
waits from the model-runner thread); a thread kvflow starts without binding it to the device
shows in the device's list of bound threads.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from kvflow.errors import TransferTimeout, TransportError
from kvflow.integrations.vllm.device import GateWaiter, HostDevice
from kvflow.integrations.vllm.links import ProcessLink
from kvflow_tools.standin import LaggingDevice, ModelShape
from tests.vllm_pairs import BLOCK_SIZE, make_pair, move_and_check
from tests.waiting import eventually


class ManualGate:
    """A gate the test opens."""

    def __init__(self, error: Exception | None = None) -> None:
        self.opened = threading.Event()
        self.error = error
        self.waiters: list[str] = []

    def done(self) -> bool:
        return self.opened.is_set()

    def wait(self) -> None:
        self.waiters.append(threading.current_thread().name)
        self.opened.wait()
        if self.error is not None:
            raise self.error


@pytest.mark.asyncio
async def test_the_waiter_wakes_a_coroutine_when_the_gate_opens_and_not_before() -> None:
    waiter = GateWaiter(HostDevice(), "kvflow-gates-test")
    try:
        gate = ManualGate()
        waiting = asyncio.ensure_future(waiter.wait(gate, timeout=10))
        await eventually(lambda: gate.waiters == ["kvflow-gates-test"], "the waiter thread blocks on the gate")
        assert not waiting.done()  # the gate is shut: the coroutine cannot have woken
        gate.opened.set()
        await asyncio.wait_for(waiting, 5)
        opened = ManualGate()
        opened.opened.set()
        await waiter.wait(opened, timeout=10)
        assert opened.waiters == []  # an open gate costs no thread hop
        await waiter.wait(None, timeout=10)
    finally:
        waiter.close()


@pytest.mark.asyncio
async def test_a_gate_that_never_opens_times_out_a_device_error_is_mapped_and_a_bug_is_not() -> None:
    waiter = GateWaiter(HostDevice(), "kvflow-gates-test")
    try:
        stuck = ManualGate()
        with pytest.raises(TransferTimeout, match="device did not finish"):
            await waiter.wait(stuck, timeout=0.05)
        stuck.opened.set()  # the waiter thread moves on
        failing = ManualGate(RuntimeError("CUDA error: an illegal memory access"))
        task = asyncio.ensure_future(waiter.wait(failing, timeout=5))
        await eventually(lambda: failing.waiters == ["kvflow-gates-test"], "the waiter thread blocks on the gate")
        failing.opened.set()
        with pytest.raises(TransportError, match="illegal memory access") as caught:
            await task
        assert isinstance(caught.value.__cause__, RuntimeError)
        buggy = ManualGate(AttributeError("'Event' object has no attribute 'sync'"))  # a bug, not the device
        task = asyncio.ensure_future(waiter.wait(buggy, timeout=5))
        await asyncio.sleep(0.01)
        buggy.opened.set()
        with pytest.raises(AttributeError, match="no attribute"):
            await task
        after = ManualGate()  # the waiter goes on after either
        task = asyncio.ensure_future(waiter.wait(after, timeout=5))
        await asyncio.sleep(0.01)
        after.opened.set()
        await task
    finally:
        waiter.close()


def test_the_stand_in_device_refuses_a_wait_from_the_model_runner_thread() -> None:
    device = LaggingDevice(0.01)
    try:
        ran: list[int] = []
        device.launch(lambda: ran.append(1))
        gate = device.record()
        assert not gate.done()
        device.host_threads.add(threading.get_ident())
        with pytest.raises(AssertionError, match="waited for the device"):
            gate.wait()
        device.host_threads.clear()
        gate.wait()
        assert ran == [1] and gate.done() and device.pending() == 0
    finally:
        device.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("hook_order", ["v1", "v2"])
@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("transport", ["loopback", "nixl"])
def test_writes_wait_for_the_device_and_no_hook_does(
    mode: str, hook_order: str, speculative: bool, transport: str
) -> None:
    """Kernels run 50 ms after their launch; D still reads exactly P's KV, and no hook of P
    waited (the device raises in a hook that does).  Over the loopback fabric the engine is on
    a thread and its agent waits for the gate; over NIXL it is in a process of its own, and the
    link holds the gated orders here until the device has run their kernels."""
    model = ModelShape(draft_layers=1 if speculative else 0)
    p, d = make_pair(transport, device_lag=0.05, hook_order=hook_order, model=model)
    try:
        move_and_check(p, d, f"t-{mode}-{hook_order}-{speculative}-{transport}", 4 * BLOCK_SIZE + 9, mode)
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("transport", ["loopback", "nixl"])
def test_every_thread_kvflow_starts_is_bound_to_the_device(transport: str) -> None:
    """Over the loopback fabric (a transport handed in) each engine runs on threads of this
    process; over NIXL in a process of its own, and the one thread kvflow starts here is P's
    gate waiter."""
    p, d = make_pair(transport, device_lag=0.01)
    try:
        move_and_check(p, d, f"t-bound-{transport}", 2 * BLOCK_SIZE + 1)
        for engine in (p, d):
            device = engine.ranks[0].device
            assert device is not None
            engine_id = f"{engine.options.name}-tp0"
            started = {t.name for t in threading.enumerate() if t.name.startswith("kvflow") and engine_id in t.name}
            if transport == "nixl":
                assert isinstance(engine.ranks[0].worker._worker.link, ProcessLink)
                expected = {f"kvflow-gates-{engine_id}"} if engine is p else set()
                assert started == expected and started <= device.bound, (started, device.bound)
                continue
            expected = {f"kvflow-{engine_id}", f"kvflow-peers-{engine_id}"}
            expected |= {f"kvflow-connections-{engine_id}"}  # the control channel's connection monitor
            expected |= {f"kvflow-nixl-{engine_id}"} if transport == "nixl" else set()
            # only P waits for gates, and only P (pushing) posted an op: a writer starts with its first
            expected |= {f"kvflow-gates-{engine_id}", f"kvflow-writer-{engine_id}"} if engine is p else set()
            assert started == expected and started <= device.bound, (started, device.bound)
    finally:
        d.close()
        p.close()


def test_a_layer_group_is_posted_once_all_its_layers_are_saved_counted_by_name() -> None:
    """Layer 2 attends over layer 1's KV (KV sharing): it owns no KV, vLLM appends it last to
    its dict, and the forward saves it between layers 1 and 3.  With two layer groups (layers
    0-1 and 3-4), the first is posted when layer 1 is saved, the second when layer 4 is, never
    on layer 2's save."""
    p, d = make_pair(model=ModelShape(layers=5, shared=((2, 1),)), extra={"push_layer_groups": 2})
    side = p.ranks[0].worker._worker
    posted: list[tuple[str, int]] = []
    save_layer = side.save_layer

    def spy(orders: Any, layer_name: str) -> None:
        save_layer(orders, layer_name)
        if orders.ready:
            posted.append((layer_name.split(".")[2], max(side.producer.step.sent.values(), default=0)))

    side.save_layer = spy
    try:
        move_and_check(p, d, "t-groups", 3 * BLOCK_SIZE)
        assert posted == [("0", 0), ("1", 1), ("2", 1), ("3", 1), ("4", 2)]
    finally:
        d.close()
        p.close()


def test_a_forward_without_saves_posts_every_group_at_wait_for_save_gated() -> None:
    """Under a full CUDA graph no layer is saved: wait_for_save posts all groups, each waiting
    for the gate recorded then."""
    p, d = make_pair(full_cudagraph=True, device_lag=0.05, hook_order="v2")
    try:
        move_and_check(p, d, "t-graph-lag", 2 * BLOCK_SIZE + 3)
    finally:
        d.close()
        p.close()


def test_a_device_injected_after_the_kv_caches_are_registered_is_refused_and_changes_nothing() -> None:
    """A host hands its connector the device before registering (no process-wide resolver: an
    engine beside it keeps its own); after, kvflow's engine already waits on the first device."""
    from kvflow.errors import ConfigError

    p, d = make_pair(device_lag=0.05)
    try:
        worker = d.ranks[0].worker
        with pytest.raises(ConfigError, match="before register_kv_caches"):
            worker.inject(device=HostDevice())
        move_and_check(p, d, "t-late-inject", 2 * BLOCK_SIZE + 3)  # the lagging device still gates
    finally:
        d.close()
        p.close()


def test_an_engine_asked_to_run_in_a_process_with_a_transport_handed_to_it_is_refused_by_name() -> None:
    """An injected transport (here the stand-in's loopback fabric) lives in this process only."""
    from kvflow.errors import ConfigError

    with pytest.raises(ConfigError, match="engine_process 'process' cannot serve .*does not cross processes"):
        make_pair(extra={"engine_process": "process"})
