"""A rank's link to an engine in a process of its own (`links.ProcessLink`) and the device's gates.

A gate is an object of the host, so the link keeps a command that carries one here until the
device has run the gate's work, and every command given after it behind it (the engine sees
them in the order the hooks gave them); the gate never crosses.  A real engine process over NIXL
runs `RankAgent`; the gates are opened by the test.  (That a WRITE so held carries the bytes the
device wrote is `tests/test_vllm_device.py`'s, over a lagging device.)
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvflow
from kvflow.errors import ConfigError, EngineBusy, EngineClosed, EngineCrashed, TransportError
from kvflow.integrations.vllm.links import ProcessLink, send_request
from kvflow.integrations.vllm.supervision import RestartPolicy
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.requests import Abort
from kvflow.protocol.state import Role
from kvflow.runtime.host_memory import share_in_place
from kvflow.runtime.process import MAX_UNANSWERED, EngineProcess, ProcessSpec
from tests.waiting import eventually_sync

SPEC = kvflow.KVSpec(num_layers=1, block_size=16, num_kv_heads=1, head_dim=64)


class TestGate:
    """A gate the test opens (or fails, as a device error does)."""

    __test__ = False

    def __init__(self, error: Exception | None = None) -> None:
        self.opened = threading.Event()
        self.error = error

    def done(self) -> bool:
        return self.opened.is_set()

    def wait(self) -> None:
        self.opened.wait()
        if self.error is not None:
            raise self.error


class GpuLike:
    """A device whose hooks record gates (as a GPU's do); the gates themselves are the test's."""

    def bind_thread(self) -> None:
        return None

    def record(self) -> TestGate | None:
        return None


def linked(max_unanswered: int = MAX_UNANSWERED) -> ProcessLink:
    """A rank agent's engine in a process of its own, over 4 blocks of host memory."""
    cache = np.zeros((2, 4, SPEC.block_len), np.uint8)
    regions = [kvflow.region_of(cache)]
    spans = share_in_place(regions)
    try:
        layout = kvflow.KVLayout.per_layer_regions(SPEC, 4, regions)
        spec = ProcessSpec(
            "linked-0",
            layout,
            transport_options={"cuda": False},
            agent="kvflow.integrations.vllm.rank_agent:RankAgent",
            agent_options={"transfer_timeout": 10.0},
        )
        process = EngineProcess(spec, spans, max_unanswered=max_unanswered)
    finally:
        for span in spans:
            os.close(span.fd)
    return ProcessLink(process, GpuLike())


@pytest.fixture
def link() -> Iterator[ProcessLink]:
    link = linked()
    yield link
    link.close(timeout=10.0)


def settled(link: ProcessLink, *futures: concurrent.futures.Future[object]) -> None:
    def done() -> bool:
        link.poll_released()  # reads the engine process's answers
        return all(future.done() for future in futures)

    eventually_sync(done, "the engine process's answers")


def test_a_gated_command_and_those_after_it_wait_for_the_device_then_go_in_order(link: ProcessLink) -> None:
    gate = TestGate()
    gated = link.command("post_groups", gate, [])
    after = link.command("post_groups", None, [])  # no gate of its own: it must not overtake
    time.sleep(0.3)
    link.poll_released()
    assert not gated.done() and not after.done()
    gate.opened.set()
    settled(link, gated, after)
    assert gated.result() == [] and after.result() == []
    now = link.command("post_groups", None, [])  # nothing held: straight to the engine process
    settled(link, now)


def test_a_gate_already_open_holds_nothing(link: ProcessLink) -> None:
    gate = TestGate()
    gate.opened.set()
    future = link.command("post_groups", gate, [])
    settled(link, future)
    assert future.result() == [] and link._waiter is None  # no waiter thread was needed


def test_a_device_error_fails_its_command_unsent_and_the_next_goes(link: ProcessLink) -> None:
    gate = TestGate(error=RuntimeError("CUDA error: an illegal memory access was encountered"))
    failed = link.command("post_groups", gate, [])
    after = link.command("post_groups", None, [])
    gate.opened.set()
    settled(link, failed, after)
    with pytest.raises(TransportError, match="illegal memory access"):
        failed.result()
    assert after.result() == []


def test_close_fails_what_a_device_that_never_finishes_still_holds() -> None:
    cache = np.zeros((2, 4, SPEC.block_len), np.uint8)
    regions = [kvflow.region_of(cache)]
    spans = share_in_place(regions)
    try:
        layout = kvflow.KVLayout.per_layer_regions(SPEC, 4, regions)
        spec = ProcessSpec("stuck-0", layout, transport_options={"cuda": False})
        link = ProcessLink(EngineProcess(spec, spans), GpuLike())
    finally:
        for span in spans:
            os.close(span.fd)
    held = link.command("stats", TestGate())
    started = time.monotonic()
    link.close(timeout=2.0)
    assert time.monotonic() - started < 10.0  # bounded: half the timeout for the device, then the process
    with pytest.raises(EngineClosed, match="before the device ran"):
        held.result(timeout=0)
    assert not link.process.alive


def test_a_command_to_a_dead_engine_process_fails_its_future_and_never_raises(link: ProcessLink) -> None:
    """A hook that gives a command after the engine process died (an OOM kill) must not raise
    out of vLLM's step: the future fails, and the worker ends the transfer (supervision.py)."""
    os.kill(link.process.pid, signal.SIGKILL)
    eventually_sync(lambda: not link.process.alive, "the engine process gone")
    link.poll_released()  # the link reads the end of its socket
    for gated in (None, TestGate()):
        future = link.command("describe", *(() if gated is None else (gated,)))
        if gated is not None:
            gated.opened.set()
        settled(link, future)
        with pytest.raises((EngineClosed, EngineCrashed)):
            future.result()


def test_a_stopped_engine_process_costs_the_host_a_bounded_queue_and_what_frees_work_still_goes() -> None:
    """An engine process that lives but does not answer (SIGSTOP here; a native call that hangs,
    a starved CPU) is not seen from its socket.  Before the bound, each call the host made
    meanwhile queued a future and a record (20,000 in 6 s).  Now new work is refused once
    `max_unanswered` calls wait (each hook's future fails at once with `EngineBusy`, nothing
    sent); a command that ends or frees work (`always`) still goes, gated or not; once the
    process answers again, everything it owed is answered and new work is taken."""
    link = linked(max_unanswered=16)
    process = link.process
    os.kill(process.pid, signal.SIGSTOP)
    try:
        taken = [link.command("describe") for _ in range(16)]
        refused = [link.command("describe") for _ in range(500)]
        assert all(future.done() for future in refused) and not any(future.done() for future in taken)
        with pytest.raises(EngineBusy, match=r"owes answers to 16 calls \(max_unanswered 16\): 'describe' refused"):
            refused[0].result()
        assert process.refused_busy == 500 and len(process._futures) == 16 and len(process._backlog) <= 16
        gate = TestGate()
        freeing = [send_request(link, Abort(TransferKey("t", 1), Role.DECODE, "ended"), always=True) for _ in range(2)]
        gated = link.command("post_groups", gate, [], always=True)
        gate.opened.set()
        eventually_sync(lambda: len(process._futures) == 19, "the gated command sent")
    finally:
        os.kill(process.pid, signal.SIGCONT)
    try:
        settled(link, *taken, *freeing, gated)
        assert all(future.exception() is None for future in [*taken, *freeing, gated])
        again = link.command("describe")
        settled(link, again)
        assert again.exception() is None and process.refused_busy == 500
    finally:
        link.close(timeout=10.0)
    with pytest.raises(ConfigError, match="max_unanswered"):
        layout = kvflow.KVLayout.per_layer_regions(
            SPEC, 4, [kvflow.region_of(np.zeros((2, 4, SPEC.block_len), np.uint8))]
        )
        EngineProcess(ProcessSpec("x", layout), [], max_unanswered=0)


def test_restarts_are_allowed_up_to_the_limit_within_the_window() -> None:
    policy = RestartPolicy(limit=2, window=60.0)
    assert policy.allow(0.0) and policy.allow(10.0)
    assert not policy.allow(20.0) and not policy.allow(59.9)  # two within the last 60 s
    assert policy.allow(60.0)  # the first has left the window
    assert not policy.allow(65.0)
    assert policy.allow(130.0)
