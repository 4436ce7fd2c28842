"""`kvflow doctor`: which NIXL backends and memory types actually work on this machine.

Why: NIXL's plugin list says what is *built*, not what runs: LIBFABRIC needs libfabric and
(in the PyPI wheel) libcuda, GDS needs cuFile, VRAM needs a GPU.  The doctor creates each
backend, moves real bytes where a backend can (host memory always, GPU memory when a CUDA device
is present), and reports devices relevant to kvflow: CUDA GPUs, AWS EFA NICs, Neuron devices.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.errors import KVFlowError

__all__ = ("BackendReport", "Report", "diagnose", "render")

TRANSFER_BACKENDS = ("UCX", "LIBFABRIC")  # network backends kvflow can move KV with
# What a plugin in NIXL's PyPI wheel needs that a machine may lack (read off its shared objects).
NEEDS = {
    "LIBFABRIC": "needs libfabric >= 1.21 (AWS EFA installer), hwloc, and the CUDA driver libraries",
    "GDS": "needs NVIDIA cuFile (GPUDirect Storage)",
    "GDS_MT": "needs NVIDIA cuFile (GPUDirect Storage)",
    "GPUNETIO": "needs NVIDIA DOCA and the CUDA driver",
    "OBJ": "needs libcuobjclient",
    "INFINIA": "needs libred_client",
    "AZURE_BLOB": "needs Azure Blob configuration",
    "GUSLI": "needs a GUSLI block device",
}


@dataclass
class BackendReport:
    name: str
    loads: bool
    memory_types: list[str] = field(default_factory=list)
    dram: str = "-"
    vram: str = "-"
    note: str = ""


@dataclass
class Report:
    nixl: str
    backends: list[BackendReport]
    cuda_devices: int
    efa_devices: list[str]
    neuron_devices: list[str]


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _efa_devices() -> list[str]:
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir() if "efa" in p.name) if root.is_dir() else []


def _neuron_devices() -> list[str]:
    return sorted(p.name for p in Path("/dev").glob("neuron*"))


@contextlib.contextmanager
def _agents(api: Any, backend: str) -> Iterator[tuple[Any, Any]]:
    config = api.nixl_agent_config(enable_prog_thread=False, backends=[])
    stamp = f"{os.getpid()}-{time.monotonic_ns()}"
    a, b = api.nixl_agent(f"doctor-a-{stamp}", config), api.nixl_agent(f"doctor-b-{stamp}", config)
    a.create_backend(backend)
    b.create_backend(backend)
    yield a, b


def _write_test(api: Any, backend: str, memory: str) -> str:
    """Move 1 MiB between two agents of this process with `backend`; "ok <ms>" or the error."""
    size = 1 << 20
    if memory == "VRAM":
        import torch

        src_t = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
        dst_t = torch.zeros(size, dtype=torch.uint8, device="cuda")
        src, dst, dev = src_t.data_ptr(), dst_t.data_ptr(), src_t.device.index or 0
    else:
        src_a = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        dst_a = np.zeros(size, dtype=np.uint8)
        src, dst, dev = src_a.ctypes.data, dst_a.ctypes.data, 0
    with _agents(api, backend) as (a, b):
        a.register_memory([(src, size, dev, "")], memory)
        b.register_memory([(dst, size, dev, "")], memory)
        a.add_remote_agent(b.get_agent_metadata())
        b.add_remote_agent(a.get_agent_metadata())
        handle = a.initialize_xfer(
            "WRITE",
            a.get_xfer_descs([(src, size, dev)], memory),
            a.get_xfer_descs([(dst, size, dev)], memory),
            b.name,
            b"doctor",
        )
        started = time.perf_counter()
        state = a.transfer(handle)
        deadline = started + 10
        while state == "PROC" and time.perf_counter() < deadline:
            state = a.check_xfer_state(handle)
            b.get_new_notifs()
        elapsed = (time.perf_counter() - started) * 1e3
        handle.release()
    if state != "DONE":
        return f"failed ({state})"
    same = bool(torch.equal(src_t, dst_t)) if memory == "VRAM" else bool(np.array_equal(src_a, dst_a))
    return f"ok {elapsed:.2f} ms" if same else "bytes differ"


def diagnose() -> Report:
    """Probe NIXL and the devices.  Never raises for a missing piece: it is reported instead."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    from kvflow.transports.nixl import load_nixl

    cuda, efa, neuron = _cuda_devices(), _efa_devices(), _neuron_devices()
    try:
        api = load_nixl()
    except KVFlowError as exc:
        return Report(f"not installed: {exc}", [], cuda, efa, neuron)
    probe = api.nixl_agent(f"doctor-{os.getpid()}", api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    reports = []
    for name in sorted(probe.get_plugin_list()):
        report = BackendReport(name, loads=False)
        try:
            probe.create_backend(name)
            report.loads = True
            report.memory_types = sorted(m.removesuffix("_SEG") for m in probe.get_backend_mem_types(name))
        except Exception as exc:  # NIXL raises its own types; any failure means "does not load here"
            report.note = f"{type(exc).__name__}: {exc}; {NEEDS.get(name, 'a library it needs is missing')}"
        if report.loads and name in TRANSFER_BACKENDS:
            report.dram = _try(lambda n=name: _write_test(api, n, "DRAM"))
            if "VRAM" in report.memory_types:
                report.vram = _try(lambda n=name: _write_test(api, n, "VRAM")) if cuda else "no CUDA device"
        reports.append(report)
    return Report(f"{api.__name__.split('.')[0]} (from {Path(api.__file__).parent})", reports, cuda, efa, neuron)


def _try(test: Any) -> str:
    try:
        return str(test())
    except Exception as exc:  # a failed probe is a finding, not a crash
        return f"failed: {type(exc).__name__}: {exc}"


def render(report: Report) -> str:
    lines = [f"NIXL: {report.nixl}", ""]
    if report.backends:
        lines.append(f"{'backend':<11} {'loads':<6} {'memory types':<16} {'DRAM write':<22} {'VRAM write':<22} note")
        for b in report.backends:
            mems = " ".join(b.memory_types) or "-"
            lines.append(f"{b.name:<11} {'yes' if b.loads else 'no':<6} {mems:<16} {b.dram:<22} {b.vram:<22} {b.note}")
        lines.append("")
    lines.append(f"CUDA GPUs: {report.cuda_devices or 'none'}")
    lines.append(f"AWS EFA devices: {', '.join(report.efa_devices) or 'none'} (/sys/class/infiniband)")
    lines.append(f"Neuron devices: {', '.join(report.neuron_devices) or 'none'} (/dev/neuron*)")
    lines.append(
        "Trainium: NIXL has no Neuron memory type; Neuron HBM registers as VRAM through LIBFABRIC "
        "when the Neuron runtime is present (UCX cannot reach it)."
    )
    return "\n".join(lines)
