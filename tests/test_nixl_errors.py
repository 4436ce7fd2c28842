"""NIXL's own failures become `TransportError` at the edge; anything else raised there is a bug and
escapes as it is.  Real NIXL (UCX over host memory) where it can be, a stand-in agent method where
a bug has to be provoked."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from kvflow.errors import TransportError
from kvflow.layout import plan_transfer
from kvflow.protocol.actions import OpKind
from kvflow.transports.nixl import NixlTransport, load_nixl, nixl_failures
from tests.transport_ends import Ends, make_ends, wait

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ends() -> Iterator[Ends]:
    made = make_ends("nixl-direct")
    yield made
    for close in made.closers:
        close()


def raising(exc: BaseException) -> Any:
    # A new instance per call: one instance raised again and again keeps every traceback, and
    # with them the NIXL handles and agents of the frames, alive until a garbage collection.
    def call(*args: object, **kwargs: object) -> NoReturn:
        raise type(exc)(*exc.args)

    return call


def failure(name: str) -> type[Exception]:
    return next(cls for cls in nixl_failures(load_nixl()) if cls.__name__ == name)


def test_nixl_failures_are_the_bindings_error_types_and_no_builtin_one() -> None:
    failures = nixl_failures(load_nixl())
    names = {cls.__name__ for cls in failures}
    assert {"nixlNotFoundError", "nixlBackendError", "nixlInvalidParamError", "nixlMismatchError"} <= names
    assert all(name.startswith("nixl") and name.endswith("Error") for name in names)
    assert not any(issubclass(cls, KeyError | TypeError | ValueError | RuntimeError) for cls in failures)


def test_what_nixl_reports_as_a_failure_becomes_a_transport_error(ends: Ends) -> None:
    with pytest.raises(TransportError, match="notifying 'nobody'.*nixlNotFoundError") as caught:
        ends.a.send_notification("nobody", b"x")
    assert type(caught.value.__cause__).__name__ == "nixlNotFoundError"
    with pytest.raises(TransportError, match="nixlMismatchError"):
        ends.a.add_peer("other", b"not nixl metadata", [])
    with pytest.raises(TransportError, match="nixlNotFoundError"):
        NixlTransport("no-such-backend", backends=("NO_SUCH_BACKEND",))


def test_a_bug_under_the_transport_escapes_unmapped(ends: Ends, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = plan_transfer(ends.a_layout, ends.b_layout, [0], [1])
    agent = ends.a._agent
    # the wrapper's KeyError for an unknown operation, pybind11's TypeError for a wrong argument
    monkeypatch.setattr(agent, "initialize_xfer", raising(KeyError("WRITEX")))
    with pytest.raises(KeyError, match="WRITEX"):
        ends.a.submit(1, OpKind.WRITE, ends.b.name, plan, b"")
    monkeypatch.setattr(agent, "send_notif", raising(TypeError("genNotif(): incompatible function arguments")))
    with pytest.raises(TypeError, match="incompatible"):
        ends.a.send_notification(ends.b.name, b"x")
    # the same call sites still map NIXL's own failure
    monkeypatch.setattr(agent, "initialize_xfer", raising(failure("nixlBackendError")("NIXL_ERR_BACKEND")))
    with pytest.raises(TransportError, match="NIXL_ERR_BACKEND"):
        ends.a.submit(2, OpKind.WRITE, ends.b.name, plan, b"")
    monkeypatch.setattr(agent, "send_notif", raising(failure("nixlNotAllowedError")("NIXL_ERR_NOT_ALLOWED")))
    with pytest.raises(TransportError, match="NIXL_ERR_NOT_ALLOWED"):
        ends.a.send_notification(ends.b.name, b"x")


def test_a_handle_nixl_cannot_release_costs_the_op_nothing(ends: Ends, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = plan_transfer(ends.a_layout, ends.b_layout, [0], [1])
    monkeypatch.setattr(
        load_nixl().nixl_xfer_handle, "release", raising(failure("nixlBackendError")("NIXL_ERR_BACKEND"))
    )
    for op_id in (1, 2):  # released in submit or by the agent thread, whichever finishes the op
        ends.a.submit(op_id, OpKind.WRITE, ends.b.name, plan, b"")
        done, _ = wait(ends.a)
        assert [(c.op_id, c.error) for c in done] == [(op_id, None)]


def test_nixl_without_any_backend_plugin_is_unavailable(tmp_path: Path) -> None:
    probe = (
        "from kvflow.errors import TransportUnavailable\n"
        "from kvflow.transports.nixl import NixlTransport\n"
        "try:\n"
        "    NixlTransport('bare')\n"
        "except TransportUnavailable as exc:\n"
        "    print('unavailable:', exc)\n"
    )
    env = dict(os.environ, NIXL_PLUGIN_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert "unavailable: NIXL on 'bare': No plugins available" in out.stdout, out.stderr[-2000:]
    assert "pip install" in out.stdout


def died(a: NixlTransport) -> None:
    a.agent_thread.thread.join(timeout=60)  # a guard against a hang; the thread ends as soon as it fails
    assert not a.agent_thread.thread.is_alive()


def assert_dead(ends: Ends, cause: str) -> None:
    """Every call into the transport fails at once with a `TransportError` naming `cause`."""
    a, b = ends.a, ends.b
    plan = plan_transfer(ends.a_layout, ends.b_layout, [0], [1])
    calls = {
        "submit": lambda: a.submit(99, OpKind.WRITE, b.name, plan, b""),
        "local_metadata": a.local_metadata,
        "send_notification": lambda: a.send_notification(b.name, b"x"),
        "add_peer": lambda: a.add_peer(b.name, b.local_metadata(), ends.b_layout.regions),
        "remove_peer": lambda: a.remove_peer(b.name),
    }
    for name, call in calls.items():
        with pytest.raises(TransportError, match=f"agent thread of {a.name!r} died: {cause}") as caught:
            call()
        assert type(caught.value.__cause__).__name__ == cause.split(":")[0], name


@pytest.mark.parametrize("call", ["check_xfer_state", "release"])
def test_a_bug_on_the_agent_thread_fails_the_op_in_flight_and_every_later_call(
    ends: Ends, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, call: str
) -> None:
    a, agent = ends.a, ends.a._agent
    real_transfer = agent.transfer

    def posted(*args: Any) -> str:
        real_transfer(*args)
        return "PROC"  # in flight: the agent thread drives it

    monkeypatch.setattr(agent, "transfer", posted)
    monkeypatch.setattr(a, "inline_poll", 0.0)  # submit never polls the op itself
    bug = RuntimeError(f"{call} went wrong")
    if call == "check_xfer_state":
        monkeypatch.setattr(agent, "check_xfer_state", raising(bug))
    else:  # the op is done, and releasing its handle fails
        monkeypatch.setattr(load_nixl().nixl_xfer_handle, "release", raising(bug))
    plan = plan_transfer(ends.a_layout, ends.b_layout, [0], [1])
    with caplog.at_level(logging.ERROR):
        a.submit(1, OpKind.WRITE, ends.b.name, plan, b"")
        died(a)
    completions, _ = a.poll()
    assert [c.op_id for c in completions] == [1]
    assert f"died: RuntimeError: {call} went wrong" in str(completions[0].error)
    assert any("agent thread died" in r.getMessage() and r.exc_info for r in caplog.records)
    assert_dead(ends, f"RuntimeError: {call} went wrong")


def test_a_listener_that_raises_ends_the_agent_thread_and_later_calls_fail(ends: Ends) -> None:
    ends.a.set_listener(raising(RuntimeError("listener went wrong")))
    ends.b.send_notification(ends.a.name, b"ping")  # a's agent thread signals the listener
    died(ends.a)
    assert [n.payload for n in ends.a.poll()[1]] == [b"ping"]  # what arrived before is still there
    assert_dead(ends, "RuntimeError: listener went wrong")


def test_a_call_waiting_on_the_agent_thread_fails_when_it_dies(ends: Ends, monkeypatch: pytest.MonkeyPatch) -> None:
    a = ends.a
    monkeypatch.setattr(a.agent_thread, "call_timeout", 3600.0)  # only the thread's death can end the wait
    inside, fail = threading.Event(), threading.Event()

    def stuck(*args: object) -> NoReturn:
        inside.set()
        fail.wait()
        raise RuntimeError("get_new_notifs went wrong")

    monkeypatch.setattr(a._agent, "get_new_notifs", stuck)
    assert inside.wait(timeout=60)  # the agent thread is inside the call now
    queued = a.agent_thread.jobs.qsize()
    outcome: list[BaseException] = []

    def caller() -> None:
        try:
            a.local_metadata()
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=caller, daemon=True)
    thread.start()
    end = time.monotonic() + 60
    while a.agent_thread.jobs.qsize() == queued and time.monotonic() < end:  # until its job waits in the queue
        time.sleep(0.001)
    assert a.agent_thread.jobs.qsize() > queued
    fail.set()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], TransportError), outcome
    assert "died: RuntimeError: get_new_notifs went wrong" in str(outcome[0])
