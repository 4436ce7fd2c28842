"""How a rank's GPU KV caches reach its engine process, as the ``gpu_export`` setting says.

Why apart from the worker: the worker decides where its engine runs; what crosses to an engine
process depends on how vLLM allocated the caches, which is what kvflow declared
(`KVFlowConnector.kv_cache_access`).  ``legacy-ipc``: vLLM's plain cache (0.32 and 0.33 always,
0.34 when kvflow declares ``LEGACY_IPC``), one legacy CUDA IPC handle per allocation
(`kvflow.runtime.cuda_ipc`).  ``fd``: vLLM 0.34's exportable extensible cache (declared
``EXPORTS_FD``), one file descriptor per physical chunk (`kvflow.runtime.cuda_vmm`), exported
again after vLLM remapped the chunks (sleep mode, a weight update) and sent to the running
engine process over its socket.  Not yet run on a GPU (the GPU check's phases G and V are the
test there), so a rank takes either only when asked (``engine_process: "process"``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvflow.errors import ConfigError, KVFlowError
from kvflow.layout import MemoryType, Region
from kvflow.runtime.cuda_ipc import CudaDriver, Share, plan_shares
from kvflow.runtime.cuda_vmm import Chunk, VmmDriver, chunks_to_wire
from kvflow.runtime.process import EngineProcess

__all__ = ("GPU_EXPORTS", "GpuExport", "export_gpu_memory")

GPU_EXPORTS = ("legacy-ipc", "fd")


@dataclass
class GpuExport:
    """What carries a rank's GPU regions to its engine process: `shares` (legacy IPC) or
    `chunks` (descriptors this process owns until `close_fds`); both empty: no GPU memory."""

    kind: str
    regions: Sequence[Region] = ()
    shares: list[Share] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def what(self) -> str:
        """How the memory crossed, for the log ("" for none)."""
        if self.shares:
            return "GPU memory by CUDA IPC"
        return "GPU memory by exported descriptors" if self.chunks else ""

    def close_fds(self) -> None:
        """Close this process's descriptors (the engine process has its own).  Never raises."""
        for chunk in self.chunks:
            with contextlib.suppress(OSError):
                os.close(chunk.fd)
        self.chunks = [Chunk(c.device, c.base, c.length) for c in self.chunks]

    def send_again(self, process: EngineProcess) -> list[list[int]] | None:
        """After vLLM remapped the cache: the chunks exported again and their descriptors sent to
        `process`; the wire form its ``restore_memory`` takes (None: nothing to send, legacy IPC
        shares stay valid, or no GPU memory).

        :raises KVFlowError: the driver refused, or the engine process did not take them.
        """
        if self.kind != "fd" or not self.regions:
            return None
        again = _export_chunks(self.regions)
        try:
            process.send_fds([chunk.fd for chunk in again])
        finally:
            GpuExport(self.kind, chunks=again).close_fds()
        return chunks_to_wire(again)


def export_gpu_memory(regions: Sequence[Region], kind: str) -> GpuExport:
    """The GPU regions among `regions`, exported as `kind` (one of `GPU_EXPORTS`) says.

    :raises ConfigError: an unknown kind, or a region that spills out of its allocation.
    :raises TransportError: no CUDA driver, or it refused (memory not allocated for `kind`).
    """
    if kind not in GPU_EXPORTS:
        raise ConfigError(f"kvflow gpu_export must be one of {list(GPU_EXPORTS)}, not {kind!r}")
    on_gpu = [region for region in regions if region.memory is MemoryType.VRAM]
    if not on_gpu:
        return GpuExport(kind)
    if kind == "fd":
        return GpuExport(kind, on_gpu, chunks=_export_chunks(on_gpu))
    driver = CudaDriver()
    return GpuExport(kind, on_gpu, shares=driver.export(plan_shares(on_gpu, driver.allocation_of)))


def _export_chunks(on_gpu: Sequence[Region]) -> list[Chunk]:
    """:raises ConfigError, TransportError: see `plan_shares`, `VmmDriver.export_fd` (no descriptor left open)."""
    driver = VmmDriver()
    chunks: list[Chunk] = []
    try:
        for share in plan_shares(on_gpu, driver.allocation_of):
            chunks.append(driver.export_fd(Chunk(share.device, share.base, share.length)))
    except KVFlowError:
        GpuExport("fd", chunks=chunks).close_fds()
        raise
    return chunks
