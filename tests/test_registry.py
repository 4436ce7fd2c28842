"""Transports load lazily by name; missing libraries give an install hint; errors are mapped."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvflow.errors import KVFlowError, TransportError, TransportUnavailable, UnknownTransport, map_exceptions
from kvflow.transports import registry
from kvflow.transports.loopback import LoopbackTransport


def test_loopback_loads_by_name() -> None:
    assert registry.load_transport("loopback") is LoopbackTransport
    assert "loopback" in registry.available_transports()


def test_unknown_name_lists_what_exists() -> None:
    with pytest.raises(UnknownTransport, match="no transport named 'rdma9'; known: .*loopback"):
        registry.load_transport("rdma9")


def test_missing_library_gives_an_install_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "kvflow_fake_backend.py").write_text("import absent_library_xyz\nFake = object\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = registry._Entry("kvflow_fake_backend", "Fake", "pip install kvflow[fake]")
    monkeypatch.setitem(registry.BUILTIN_TRANSPORTS, "fake", entry)
    with pytest.raises(TransportUnavailable, match=r"'absent_library_xyz'.*pip install kvflow\[fake\]"):
        registry.load_transport("fake")
    sys.modules.pop("kvflow_fake_backend", None)


def test_map_exceptions_translates_and_chains_but_lets_bugs_through() -> None:
    with (
        pytest.raises(TransportError, match="nixl: OSError: link down") as caught,
        map_exceptions({OSError: TransportError}, "nixl"),
    ):
        raise OSError("link down")
    assert isinstance(caught.value.__cause__, OSError)
    with pytest.raises(ZeroDivisionError), map_exceptions({OSError: TransportError}):
        _ = 1 / 0
    with pytest.raises(UnknownTransport), map_exceptions({LookupError: TransportError}):
        raise UnknownTransport("kvflow errors pass through unchanged")
    assert issubclass(TransportUnavailable, KVFlowError)
