"""Loopback fabrics the stand-in's engines share by name.

Why here: engines of one process (a test's P and D) meet on one in-process `LoopbackFabric`,
named in their options as ``extra={"transport": "loopback", "fabric": NAME}``, which are the
stand-in's own keys, not the connector's: the stand-in takes them out of the connector's settings
and hands each rank's connector an endpoint of the fabric (`KVFlowConnector.inject`).  A fabric
lives while endpoints are on it and is forgotten with its last one, so that the registry holds
only fabrics in use.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from kvflow.errors import ConfigError
from kvflow.transports.loopback import LoopbackFabric

__all__ = ("fabric_of", "install_fabric", "named_fabric")

_NAMED: dict[str, LoopbackFabric] = {}
_LOCK = threading.Lock()


def named_fabric(name: str) -> LoopbackFabric:
    """The fabric named `name`, made on first use.  Never raises."""
    with _LOCK:
        fabric = _NAMED.get(name)
        if fabric is None:
            fabric = _NAMED[name] = _named(name, LoopbackFabric())
        return fabric


def install_fabric(name: str, fabric: LoopbackFabric) -> None:
    """Make `fabric` (one with a link model or faults, say) the fabric named `name`, for the
    endpoints that attach to that name from now on.

    :raises ConfigError: a fabric of that name is in use.
    """
    with _LOCK:
        if name in _NAMED:
            raise ConfigError(f"loopback fabric {name!r} is in use")
        _NAMED[name] = _named(name, fabric)


def _named(name: str, fabric: LoopbackFabric) -> LoopbackFabric:
    def forget() -> None:
        with _LOCK:
            if _NAMED.get(name) is fabric:
                del _NAMED[name]

    fabric.on_idle = forget
    return fabric


def fabric_of(extra: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """An engine's ``kv_connector_extra_config`` without the stand-in's keys, and the name of its
    loopback fabric (None: not on one).  Never raises."""
    loopback = extra.get("transport") == "loopback"
    settings = {k: v for k, v in extra.items() if k != "fabric" and not (loopback and k == "transport")}
    return settings, str(extra.get("fabric", "default")) if loopback else None
