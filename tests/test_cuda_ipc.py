"""GPU memory shared with another process by legacy CUDA IPC (`kvflow.runtime.cuda_ipc`): the pure part.

Which allocations a set of KV regions needs shared (each once, however many regions it holds),
where each region lands in the process that opened them, and the shares' wire form, hostile
entries refused by name.  The driver calls themselves run only on a GPU (the GPU check's phase
G); here the driver is absent and says so.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.errors import ConfigError, TransportError, TransportUnavailable
from kvflow.layout import MemoryType, Region
from kvflow.runtime.cuda_ipc import (
    HANDLE_BYTES,
    CudaDriver,
    Share,
    plan_shares,
    shares_from_wire,
    shares_to_wire,
    translate,
)

MiB = 1 << 20
ALLOCATIONS = {0: [(0x7F00_0000_0000, 64 * MiB), (0x7F00_1000_0000, 32 * MiB)], 1: [(0x7E00_0000_0000, 16 * MiB)]}


def allocation_of(address: int) -> tuple[int, int]:
    for spans in ALLOCATIONS.values():
        for base, length in spans:
            if base <= address < base + length:
                return base, length
    raise AssertionError(f"no allocation holds {address:#x}")


def vram(base: int, length: int, device: int = 0) -> Region:
    return Region(base, length, MemoryType.VRAM, device)


def test_regions_in_one_allocation_share_it_once_and_land_at_their_offsets() -> None:
    (first, _), (second, _) = ALLOCATIONS[0]
    regions = [vram(first, MiB), vram(first + 8 * MiB, 2 * MiB), vram(second + 4096, MiB), vram(first + MiB, MiB)]
    shares = plan_shares(regions, allocation_of)
    assert shares == [Share(0, first, 64 * MiB), Share(0, second, 32 * MiB)]
    opened = [0x1000_0000, 0x9000_0000]  # where the other process mapped them
    moved = [translate(r, shares, opened) for r in regions]
    assert [m.base for m in moved] == [0x1000_0000, 0x1000_0000 + 8 * MiB, 0x9000_0000 + 4096, 0x1000_0000 + MiB]
    assert all(m.length == r.length and m.memory is MemoryType.VRAM for m, r in zip(moved, regions, strict=True))


def test_what_cannot_be_shared_is_refused_by_name() -> None:
    (first, length), _ = ALLOCATIONS[0]
    with pytest.raises(ConfigError, match="DRAM, not GPU memory"):
        plan_shares([Region(first, MiB, MemoryType.DRAM, 0)], allocation_of)
    with pytest.raises(ConfigError, match="spills out of its allocation"):
        plan_shares([vram(first + length - MiB, 2 * MiB)], allocation_of)
    shares = plan_shares([vram(first, MiB)], allocation_of)
    with pytest.raises(ConfigError, match="outside what was shared"):
        translate(vram(first, MiB, device=1), shares, [0x1000])  # same address, another GPU
    with pytest.raises(ConfigError, match="outside what was shared"):
        translate(vram(first + length - 4096, 8192), shares, [0x1000])


@given(
    st.lists(st.tuples(st.sampled_from([(0, 0), (0, 1), (1, 0)]), st.integers(0, 15), st.integers(1, 16)), min_size=1)
)
def test_every_region_lands_inside_its_opened_allocation_at_its_own_offset(picks: list[Any]) -> None:
    regions = []
    for (device, which), start, size in picks:
        base, length = ALLOCATIONS[device][which]
        unit = length // 32
        regions.append(vram(base + start * unit, min(size, 32 - start) * unit, device))
    shares = plan_shares(regions, allocation_of)
    assert len({(s.device, s.base) for s in shares}) == len(shares)  # each allocation once
    opened = [0x1_0000_0000 * (i + 1) for i in range(len(shares))]
    for region in regions:
        moved = translate(region, shares, opened)
        (index,) = [
            i
            for i, s in enumerate(shares)
            if s.device == region.device_id and s.base <= region.base < s.base + s.length
        ]
        assert moved.base - opened[index] == region.base - shares[index].base
        assert moved.base + moved.length <= opened[index] + shares[index].length


def test_shares_cross_the_wire_whole_and_hostile_entries_are_refused() -> None:
    shares = [Share(0, 0x7F00_0000_0000, 64 * MiB, bytes(range(HANDLE_BYTES))), Share(1, 4096, 4096, bytes(64))]
    assert shares_from_wire(shares_to_wire(shares)) == shares
    for hostile in (
        "not a list",
        [[0, 4096, 4096]],
        [[0, 4096, 4096, b"short"]],
        [[True, 4096, 4096, bytes(64)]],
        [[0, -1, 4096, bytes(64)]],
        [[0, 4096, 0, bytes(64)]],
        [[0, 4096, 4096, "x" * 64]],
    ):
        with pytest.raises(ConfigError, match="CUDA IPC share"):
            shares_from_wire(hostile)


def test_without_a_cuda_driver_the_driver_says_what_is_missing() -> None:
    """On CI there is none; on a GPU host the driver starts (both are right answers here)."""
    try:
        CudaDriver()
    except TransportUnavailable as exc:
        assert "libcuda.so.1" in str(exc)


def test_an_engine_process_handed_gpu_memory_it_cannot_open_refuses_to_start_and_leaves_nothing() -> None:
    """The shares cross to a real engine process, which opens them before anything else: here
    there is no CUDA driver (on a GPU host the made-up handle is refused); either way the host
    gets the transport's error by class and no process stays."""
    import os
    import subprocess

    import kvflow
    from kvflow.errors import TransportError
    from kvflow.runtime.process import EngineProcess, ProcessSpec

    spec = kvflow.KVSpec(num_layers=1, block_size=16, num_kv_heads=1, head_dim=64)
    (base, length), _ = ALLOCATIONS[0]
    region = vram(base, 2 * 4 * spec.block_len)
    layout = kvflow.KVLayout.per_layer_regions(spec, 4, [region])
    before = subprocess.run(
        ["pgrep", "-f", "kvflow.runtime.engine_process", "-P", str(os.getpid())], capture_output=True
    )
    with pytest.raises(TransportError, match="libcuda|cuIpcOpenMemHandle"):
        EngineProcess(
            ProcessSpec("gpu-less-0", layout, transport_options={"cuda": False}),
            [],
            cuda_shares=[Share(0, base, length, bytes(HANDLE_BYTES))],
        )
    after = subprocess.run(
        ["pgrep", "-f", "kvflow.runtime.engine_process", "-P", str(os.getpid())], capture_output=True
    )
    assert after.stdout == before.stdout


def test_a_rank_with_gpu_caches_takes_an_engine_process_only_when_asked_and_says_what_is_missing() -> None:
    """ "auto" keeps GPU caches on a thread (CUDA IPC into a process is not yet run on a GPU);
    "process" takes the process, which needs the CUDA driver to export them."""
    import kvflow
    from kvflow.integrations.vllm.gpu_export import export_gpu_memory
    from kvflow.integrations.vllm.settings import Settings
    from kvflow.integrations.vllm.worker import WorkerSide

    spec = kvflow.KVSpec(num_layers=1, block_size=16, num_kv_heads=1, head_dim=64)
    (base, _), _ = ALLOCATIONS[0]
    layout = kvflow.KVLayout.per_layer_regions(spec, 4, [vram(base, 2 * 4 * spec.block_len)])
    auto = WorkerSide("gpu-0", 0, Settings.from_extra({}))
    assert "GPU memory" in (auto._why_not_a_process(layout, injected_transport=False) or "")
    asked = WorkerSide("gpu-0", 0, Settings.from_extra({"engine_process": "process"}))
    assert asked._why_not_a_process(layout, injected_transport=False) is None
    with pytest.raises(TransportError, match="libcuda.so.1|cuPointerGetAttribute|cuMemGetAddressRange"):
        export_gpu_memory(
            layout.regions, asked.settings.gpu_export
        )  # no driver here; on a GPU host, no allocation there
