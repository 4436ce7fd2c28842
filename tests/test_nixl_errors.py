"""NIXL's own failures become `TransportError` at the edge; anything else raised there is a bug and
escapes as it is.  Real NIXL (UCX over host memory) where it can be, a stand-in agent method where
a bug has to be provoked."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from kvflow.errors import TransportError
from kvflow.layout import plan_transfer
from kvflow.protocol.actions import OpKind
from kvflow.transports.nixl import NixlTransport, load_nixl, nixl_failures
from tests.test_transport_conformance import Ends, make_ends, wait

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
