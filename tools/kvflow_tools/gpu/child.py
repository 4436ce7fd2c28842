"""The GPU check's child processes: an engine (P or D), and phase A's environment child.

Why they report everything as JSON lines on a stdout of their own: UCX and NIXL write logs to
stdout too, so the children move fd 1 onto stderr and keep a copy of it for their replies, and
a child that cannot even import torch, kvflow or NIXL still answers with what went wrong rather
than a traceback the parent would have to dig out of its stderr.  That is why this module
imports neither torch nor kvflow before it can report a failure to.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import platform
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO

__all__ = ("child_entry", "env_entry", "environment", "own_stdout")


def own_stdout() -> TextIO:
    """Keep fd 1 for the JSON lines: native libraries (UCX logs on stdout) write to stderr instead.

    :raises OSError: the descriptors cannot be duplicated.
    """
    events = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return events


def child_entry(args: argparse.Namespace) -> int:
    """An engine child (``--role p|d``) until the parent closes it: 0, or 1 once it has reported
    an error at start (the line ``{"event": "error", "id": "start", ...}``).  Never raises."""
    events = own_stdout()
    try:
        import kvflow

        if args.engine_process:  # P's engine in an engine process over the memory this child owns
            from kvflow_tools.gpu.process_child import serve_owner

            kvflow.run(serve_owner(args, events))
        else:
            from kvflow_tools.gpu.engine_child import serve

            kvflow.run(serve(args, events))
        return 0
    except BaseException as exc:
        line = {
            "event": "error",
            "id": "start",
            "error": f"{type(exc).__name__}: {exc}",
            "trace": traceback.format_exc(),
        }
        events.write(json.dumps(line) + "\n")
        events.flush()
        return 1


def env_entry(args: argparse.Namespace) -> int:
    """Phase A's child (``--role env``): `environment` as one JSON line; 0.  Never raises."""
    events = own_stdout()
    events.write(json.dumps(environment(args.device)) + "\n")
    events.flush()
    return 0


def environment(device: str) -> dict[str, Any]:
    """What this Python sees: torch and CUDA, nixl (its API's path, its memory types) and the
    UCX bundled with it (its version, whether its CUDA modules load), kvflow's path, versions.
    A part that fails is reported in the result (``torch_error``, ``kvflow_nixl_error``).
    Never raises."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
    }
    info["env"] = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("UCX_", "NIXL_", "CUDA_", "KVFLOW_")) and k != "KVFLOW_SECRET"
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        if device == "cuda" and torch.cuda.is_available():
            torch.cuda.set_device(0)
            torch.zeros(1, device="cuda:0")
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = {
                "name": p.name,
                "capability": f"{p.major}.{p.minor}",
                "memory_gib": round(p.total_memory / 2**30, 1),
            }
            info["torch_allocator_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    except Exception as exc:
        info["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        nixl_environment(device, info)
    except Exception as exc:
        info["kvflow_nixl_error"] = f"{type(exc).__name__}: {exc}"
        info["trace"] = traceback.format_exc()
    return info


def nixl_environment(device: str, info: dict[str, Any]) -> None:
    """Into `info`, step by step (what came before a failure stays): kvflow's path, nixl's API
    and a NIXL agent's memory types, versions of what kvflow needs, then UCX as bundled with the
    nixl wheel.

    :raises Exception: kvflow, nixl or zmq cannot be imported, or no NIXL agent can be made.
    """
    import kvflow
    from kvflow.transports import nixl as kvnixl

    info["kvflow"] = kvflow.__file__
    api = kvnixl.load_nixl(device == "cuda")
    info["nixl_api"] = api.__file__
    pkg = api.__name__.split(".")[0]
    from importlib.metadata import version

    for dist in ("nixl-cu13", "pyzmq", "msgpack", "uvloop", "xxhash", "numpy"):
        try:
            info[f"version_{dist}"] = version(dist)
        except Exception as exc:
            info[f"version_{dist}"] = f"not found ({type(exc).__name__})"
    import zmq

    info["zmq"] = {"pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "curve": bool(zmq.has("curve"))}
    bind = None
    if device == "cuda":
        import torch

        def bind() -> None:
            torch.cuda.set_device(0)

    t = kvnixl.NixlTransport("gpucheck-env", thread_setup=bind, cuda=device == "cuda")
    info["nixl_memory_types"] = sorted(m.value for m in t.capabilities.memory_types)
    t.close()
    # UCX as bundled with the nixl wheel: its version, and whether its CUDA modules load here
    # (after the agent above, so that loading them by hand cannot change what the agent saw)
    spec = importlib.util.find_spec("nixl_cu13") or importlib.util.find_spec(pkg)
    libs = Path(spec.origin).parent.parent / "nixl_cu13.libs" if spec and spec.origin else None
    if libs and libs.is_dir():
        ucp = sorted(libs.glob("libucp-*.so*"))
        if ucp:
            lib = ctypes.CDLL(str(ucp[0]))
            lib.ucp_get_version_string.restype = ctypes.c_char_p
            info["ucx_version"] = lib.ucp_get_version_string().decode()
        modules = {}
        for name in ("libuct_cuda.so.0.0.0", "libucm_cuda.so.0.0.0", "libuct_cma.so.0.0.0"):
            try:
                ctypes.CDLL(str(libs / "ucx" / name))
                modules[name] = "loads"
            except OSError as exc:
                modules[name] = f"does not load: {exc}"
        info["ucx_modules"] = modules
