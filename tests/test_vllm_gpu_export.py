"""How a rank's GPU KV caches reach its engine process (`kvflow.integrations.vllm.gpu_export`).

The driver calls themselves run only on a GPU (the GPU check's phases G and V); here: which
kind each setting takes, that vLLM before 0.34 is refused the descriptor kind it cannot
allocate, that host memory needs nothing, and that GPU regions on a host without a CUDA driver
fail at start naming the driver, whichever kind.
"""

from __future__ import annotations

import pytest

from kvflow.errors import ConfigError, TransportUnavailable
from kvflow.integrations.vllm.gpu_export import GPU_EXPORTS, GpuExport, export_gpu_memory
from kvflow.integrations.vllm.releases import cache_access, check_gpu_export
from kvflow.layout import MemoryType, Region


def test_each_kind_declares_what_vllm_must_allocate_and_host_memory_asks_nothing() -> None:
    assert cache_access(gpu=True) == cache_access(gpu=True, export="legacy-ipc") == ("REGISTERS", "LEGACY_IPC")
    assert cache_access(gpu=True, export="fd") == ("REGISTERS", "EXPORTS_FD")
    assert cache_access(gpu=False, export="fd") == cache_access(gpu=False) == ()


def test_descriptors_are_refused_before_vllm_034_which_alone_allocates_them() -> None:
    for version in ("0.34.0", "0.34.1rc1"):
        check_gpu_export("fd", version)
    for version in ("0.32.0", "0.33.0", "0.33.1"):
        check_gpu_export("legacy-ipc", version)
        with pytest.raises(
            ConfigError, match=f"gpu_export 'fd' exports vLLM 0.34's extensible KV cache, which vLLM {version}"
        ):
            check_gpu_export("fd", version)


def test_host_memory_crosses_without_any_gpu_export() -> None:
    dram = [Region(0x1000, 4096, MemoryType.DRAM, 0)]
    for kind in GPU_EXPORTS:
        gpu = export_gpu_memory(dram, kind)
        assert (gpu.shares, gpu.chunks, gpu.what) == ([], [], "")
        assert gpu.send_again(None) is None  # type: ignore[arg-type]  # nothing to send, nothing touched
    with pytest.raises(ConfigError, match="gpu_export must be one of"):
        export_gpu_memory(dram, "fabric")


@pytest.mark.parametrize("kind", GPU_EXPORTS)
def test_gpu_regions_without_a_cuda_driver_fail_at_start_naming_it(kind: str) -> None:
    vram = [Region(0x7F00_0000_0000, 1 << 20, MemoryType.VRAM, 0)]
    with pytest.raises(TransportUnavailable, match="no CUDA driver"):
        export_gpu_memory(vram, kind)
    assert GpuExport("legacy-ipc", vram).send_again(None) is None  # type: ignore[arg-type]  # shares stay valid


def test_after_a_remap_the_chunks_go_to_the_running_engine_process_and_none_stays_open_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a wake-up sends (the driver's export stood in by memory files): the descriptors
    reach the engine process, this process keeps none, and the wire form names the chunks; an
    engine process over host memory, which maps no chunk, refuses them by name."""
    import os

    import kvflow.integrations.vllm.gpu_export as gpu_export
    from kvflow.runtime.cuda_vmm import Chunk
    from tests.test_cuda_vmm import INODES, is_open
    from tests.test_engine_process import answered, cache, engine, until
    from tests.test_fd_passing import _memory_files_of

    made: list[int] = []

    def export(regions: object) -> list[Chunk]:
        fd = os.memfd_create("kvflow-remapped")
        INODES[fd] = os.fstat(fd).st_ino
        made.append(fd)
        return [Chunk(0, 0x7F00_0000_0000, 1 << 21, fd)]

    monkeypatch.setattr(gpu_export, "_export_chunks", export)
    vram = [Region(0x7F00_0000_0000, 1 << 20, MemoryType.VRAM, 0)]
    process = engine("remap-0", cache())
    try:
        wire = GpuExport("fd", vram).send_again(process)
        assert wire == [[0, 0x7F00_0000_0000, 1 << 21]]
        assert not is_open(made[0])  # closed here once sent
        until(lambda: _memory_files_of(process.pid, "kvflow-remapped") == 1, "the descriptor in the engine process")
        refused = process.call("restore_memory", wire)
        answered(process, refused)
        with pytest.raises(ConfigError, match="come back to the engine process that maps them"):
            refused.result()
    finally:
        process.close(timeout=20.0)
