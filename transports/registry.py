"""The registry that loads transports by name.

Why lazily: a backend's library (NIXL, UCX) is heavy and often absent.  `load_transport(name)`
imports the backend on first use and, when its library is missing, raises `TransportUnavailable`
with the command that installs it (anyio's backend loading).  Third-party transports register
under the `kvflow.transports` entry-point group.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any, cast

from kvflow.errors import TransportUnavailable, UnknownTransport

__all__ = ("BUILTIN_TRANSPORTS", "available_transports", "load_transport")


@dataclass(frozen=True, slots=True)
class _Entry:
    module: str
    attribute: str
    install_hint: str


BUILTIN_TRANSPORTS: dict[str, _Entry] = {
    "loopback": _Entry("kvflow.transports.loopback", "LoopbackTransport", "pip install kvflow"),
    "shm": _Entry("kvflow.transports.shm", "ShmTransport", "pip install kvflow"),
    "nixl": _Entry("kvflow.transports.nixl", "NixlTransport", "pip install 'kvflow[nixl]'"),
}

_loaded: dict[str, Callable[..., Any]] = {}


def available_transports() -> list[str]:
    """Names `load_transport` knows: built-ins plus the `kvflow.transports` entry-point group."""
    names = set(BUILTIN_TRANSPORTS)
    names.update(ep.name for ep in metadata.entry_points(group="kvflow.transports"))
    return sorted(names)


def load_transport(name: str) -> Callable[..., Any]:
    """The transport class (or factory) registered under `name`, imported on first use.

    :raises UnknownTransport: no transport has that name; the message lists those that exist.
    :raises TransportUnavailable: its library is not installed; the message says how to get it.
    """
    if name in _loaded:
        return _loaded[name]
    entry = BUILTIN_TRANSPORTS.get(name)
    if entry is not None:
        try:
            module = importlib.import_module(entry.module)
        except ModuleNotFoundError as exc:
            missing = exc.name or "?"
            if missing == "kvflow" or missing.startswith("kvflow."):
                raise
            raise TransportUnavailable(
                f"transport {name!r} needs the {missing!r} package, which is not installed; "
                f"install it with: {entry.install_hint}"
            ) from exc
        require = getattr(module, "require", None)
        if callable(require):
            require()  # a backend whose library loads lazily says here if it is missing
        factory = cast(Callable[..., Any], getattr(module, entry.attribute))
    else:
        points = [ep for ep in metadata.entry_points(group="kvflow.transports") if ep.name == name]
        if not points:
            raise UnknownTransport(f"no transport named {name!r}; known: {', '.join(available_transports())}")
        try:
            factory = points[0].load()
        except ModuleNotFoundError as exc:
            raise TransportUnavailable(
                f"transport {name!r} from {points[0].value} cannot be imported: the {exc.name!r} package is missing"
            ) from exc
    _loaded[name] = factory
    return factory
