"""NIXL on this host: which build to import, how its calls fail, which devices UCX may use.

Why apart from the transport (nixl.py): these answer questions about the installation and the
host, asked before any agent exists (by the transport registry, `kvflow doctor`, the GPU check
and the benchmarks), and they change with NIXL's releases rather than with the data plane.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

from kvflow.errors import TransportUnavailable

__all__ = ("INSTALL_HINT", "LOOPBACK_DEVICE", "load_nixl", "net_devices", "nixl_failures", "require")

INSTALL_HINT = (
    "pip install 'kvflow[nixl]' (on a machine without CUDA, install the CPU torch first, "
    "or use: pip install --no-deps nixl-cu13==1.5.1 numpy)"
)
LOOPBACK_DEVICE = "lo"  # Linux's loopback interface
UCX_DEVICES = "UCX_NET_DEVICES"  # the network devices UCX may use, comma-separated


def load_nixl(cuda: bool = True) -> Any:
    """NIXL's Python API module (`nixl._api`, else a CUDA-specific build of it).  With `cuda`
    False (host memory only, which every build moves), a build is imported directly: the `nixl`
    package picks the build matching the CUDA stack and, on a machine without one, imports
    torch to find that out (over a second).

    :raises TransportUnavailable: NIXL is not installed; the message says how to install it.
    """
    names = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
    for name in names if cuda else names[1:] + names[:1]:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise TransportUnavailable(f"the NIXL transport needs the 'nixl' package; install it with: {INSTALL_HINT}")


def require() -> None:
    """:raises TransportUnavailable: NIXL is not installed (used by `load_transport`).  Nothing is
    imported: the transport imports the build it needs (see `load_nixl`)."""
    if not any(importlib.util.find_spec(name) for name in ("nixl", "nixl_cu13", "nixl_cu12")):
        raise TransportUnavailable(f"the NIXL transport needs the 'nixl' package; install it with: {INSTALL_HINT}")


def nixl_failures(api: Any) -> tuple[type[Exception], ...]:
    """The exceptions by which NIXL reports a failed call: its bindings raise one type per error
    status (`nixlNotFoundError`, `nixlBackendError`, `nixlInvalidParamError`, ...).

    Nothing else is a NIXL failure.  The Python wrapper also raises `KeyError` for an unknown
    memory type, operation or backend name and pybind11 a `TypeError` for an argument of the
    wrong type: both mean kvflow passed something wrong, so they are left to propagate.
    """
    bindings = importlib.import_module(api.__name__.rsplit(".", 1)[0] + "._bindings")
    return tuple(
        cls
        for name, cls in vars(bindings).items()
        if isinstance(cls, type) and issubclass(cls, Exception) and name.startswith("nixl") and name.endswith("Error")
    )


@contextlib.contextmanager
def net_devices(loopback_only: bool) -> Iterator[None]:
    """While UCX's backend is made inside: with `loopback_only`, and unless the deployment chose
    devices itself (``UCX_NET_DEVICES``), UCX's network devices are the loopback one only.  UCX
    reads the variable when the backend starts; it is put back after.  (NIXL's ``ucx_devices``
    backend param does not keep UCX's TCP listener off the other interfaces; the variable
    does.)  Never raises."""
    if not loopback_only or UCX_DEVICES in os.environ:
        yield
        return
    os.environ[UCX_DEVICES] = LOOPBACK_DEVICE
    try:
        yield
    finally:
        os.environ.pop(UCX_DEVICES, None)
