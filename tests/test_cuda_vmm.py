"""GPU chunks an engine process maps through exported file descriptors (`kvflow.runtime.cuda_vmm`).

The driver calls run only on a GPU (the GPU check's phase V); here a stand-in driver records
them, so what is tested is the sequence an importer owes the driver (reserve once, import, map,
release the import's handle, unmap before the owner releases, map again at the same addresses,
free at the end), what it does on a refusal half-way (nothing left mapped, every descriptor
closed), and the wire form with hostile entries refused by name.  The descriptors are real
memory files, so a descriptor left open or closed twice is seen.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.errors import ConfigError, TransportError, TransportUnavailable
from kvflow.layout import MemoryType, Region
from kvflow.runtime.cuda_vmm import Chunk, ImportedChunks, VmmDriver, chunks_from_wire, chunks_to_wire, open_gpu_memory

MiB = 1 << 20
CHUNKS = [(0, 0x7F00_0000_0000, 64 * MiB), (0, 0x7F00_0400_0000, 32 * MiB)]  # two segments, one chunk each


class StandIn:
    """Records the driver calls; refuses the `fail_at`-th import or map."""

    def __init__(self, fail_at: tuple[str, int] | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail_at = fail_at
        self.mapped: dict[int, int] = {}  # local address -> handle
        self.reserved: dict[int, int] = {}  # local address -> length
        self.handles = 0
        self.counts: dict[str, int] = {}
        self.imported_fds: list[int] = []

    def _count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1
        if self.fail_at == (name, self.counts[name]):
            raise TransportError(f"{name} failed: CUDA_ERROR_INVALID_VALUE")

    def bind(self, device: int) -> None:
        self.calls.append(("bind", device))

    def reserve(self, length: int) -> int:
        address = 0x1_0000_0000 * (len(self.reserved) + 1)
        self.reserved[address] = length
        self.calls.append(("reserve", length))
        return address

    def import_fd(self, fd: int) -> int:
        os.fstat(fd)  # the descriptor is open when imported
        self._count("import")
        self.handles += 1
        self.imported_fds.append(fd)
        self.calls.append(("import", fd))
        return self.handles

    def map(self, device: int, address: int, length: int, handle: int) -> None:
        assert self.reserved.get(address) == length and address not in self.mapped
        self._count("map")
        self.mapped[address] = handle
        self.calls.append(("map", address, handle))

    def release(self, handle: int) -> None:
        self.calls.append(("release", handle))

    def unmap(self, address: int, length: int) -> None:
        assert self.reserved[address] == length
        del self.mapped[address]
        self.calls.append(("unmap", address))

    def free(self, address: int, length: int) -> None:
        assert address not in self.mapped and self.reserved.pop(address) == length
        self.calls.append(("free", address))


INODES: dict[int, int] = {}  # descriptor -> the inode of the memory file it was made for


def memfd(name: str) -> int:
    fd = os.memfd_create(name)
    INODES[fd] = os.fstat(fd).st_ino
    return fd


def exported(specs: list[tuple[int, int, int]] = CHUNKS) -> list[Chunk]:
    """The chunks as the owner exports them, each with a real descriptor (a memory file)."""
    return [Chunk(device, base, length, memfd("chunk")) for device, base, length in specs]


def is_open(fd: int) -> bool:
    """Whether `fd` still holds its memory file (a number reused by another thread's file is not)."""
    try:
        return os.fstat(fd).st_ino == INODES[fd]
    except OSError:
        return False


def test_chunks_are_mapped_once_each_then_unmapped_and_mapped_again_at_the_same_addresses() -> None:
    driver = StandIn()
    first = exported()
    gpu = ImportedChunks(first, driver)
    assert [call[0] for call in driver.calls] == ["bind", "reserve", "reserve", "bind"] + [
        "import",
        "map",
        "release",
    ] * 2
    assert not any(is_open(chunk.fd) for chunk in first)  # imported: this process's copies closed
    local = list(gpu.local)
    region = Region(CHUNKS[1][1] + 4096, MiB, MemoryType.VRAM, 0)
    assert gpu.translate(region) == Region(local[1] + 4096, MiB, MemoryType.VRAM, 0)
    gpu.unmap()  # before the owner releases the memory (sleep mode)
    assert driver.mapped == {} and len(driver.reserved) == 2
    gpu.unmap()  # twice: nothing more
    again = exported()
    gpu.remap(again)
    assert sorted(driver.mapped) == sorted(local) and gpu.local == local  # where the engine registered them
    assert gpu.translate(region).base == local[1] + 4096
    gpu.close()
    assert driver.mapped == {} and driver.reserved == {}
    assert not any(is_open(chunk.fd) for chunk in again)


@pytest.mark.parametrize("fail_at", [("import", 1), ("import", 2), ("map", 1), ("map", 2)])
def test_a_refusal_half_way_leaves_nothing_mapped_or_reserved_and_no_descriptor_open(fail_at: tuple[str, int]) -> None:
    driver = StandIn(fail_at)
    chunks = exported()
    with pytest.raises(TransportError, match="CUDA_ERROR_INVALID_VALUE"):
        ImportedChunks(chunks, driver)
    assert driver.mapped == {} and driver.reserved == {}
    assert not any(is_open(chunk.fd) for chunk in chunks)
    handles = [call[1] for call in driver.calls if call[0] == "release"]
    assert handles == list(range(1, driver.handles + 1))  # every imported handle released once


def test_a_remap_refused_half_way_keeps_the_ranges_and_can_be_tried_again() -> None:
    driver = StandIn()
    gpu = ImportedChunks(exported(), driver)
    gpu.unmap()
    driver.fail_at, driver.counts = ("map", 2), {}
    chunks = exported()
    with pytest.raises(TransportError):
        gpu.remap(chunks)
    assert driver.mapped == {} and len(driver.reserved) == 2
    assert not any(is_open(chunk.fd) for chunk in chunks)
    driver.fail_at = None
    gpu.remap(exported())
    assert sorted(driver.mapped) == sorted(gpu.local)
    gpu.close()


def test_chunks_other_than_those_reserved_for_or_a_second_map_are_refused_and_their_descriptors_closed() -> None:
    driver = StandIn()
    gpu = ImportedChunks(exported(), driver)
    twice = exported()
    with pytest.raises(ConfigError, match="mapped already"):
        gpu.remap(twice)
    gpu.unmap()
    moved = exported([(0, CHUNKS[0][1], 64 * MiB), (0, CHUNKS[1][1] + MiB, 32 * MiB)])
    with pytest.raises(ConfigError, match="do not match"):
        gpu.remap(moved)
    assert not any(is_open(chunk.fd) for chunk in twice + moved)
    assert driver.mapped == {}
    gpu.close()


def test_chunks_of_two_gpus_are_refused() -> None:
    chunks = exported([(0, 0x1000_0000, MiB), (1, 0x2000_0000, MiB)])
    with pytest.raises(ConfigError, match=r"one GPU, not on \[0, 1\]"):
        ImportedChunks(chunks, StandIn())
    assert not any(is_open(chunk.fd) for chunk in chunks)


def test_the_wire_carries_chunks_beside_their_descriptors_and_refuses_hostile_entries() -> None:
    chunks = [Chunk(d, b, n) for d, b, n in CHUNKS]
    wire = chunks_to_wire(chunks)
    assert chunks_from_wire(wire, [7, 9]) == [Chunk(d, b, n, fd) for (d, b, n), fd in zip(CHUNKS, [7, 9], strict=True)]
    with pytest.raises(ConfigError, match="2 exported GPU chunks came with 1 file descriptors"):
        chunks_from_wire(wire, [7])
    for hostile in ([[0, 1, 0]], [[0, -1, 4096]], [[0, 1]], [[True, 1, 4096]], [["0", 1, 4096]], [None]):
        with pytest.raises(ConfigError, match="an exported GPU chunk is"):
            chunks_from_wire(hostile, [3])
    with pytest.raises(ConfigError, match="must be a list"):
        chunks_from_wire({"chunks": 1}, [])


@given(st.lists(st.integers(0, 3), max_size=6))
def test_a_spec_with_both_kinds_or_bad_descriptors_is_refused_and_closes_every_descriptor(picks: list[int]) -> None:
    fds = [memfd("spec") for _ in picks]
    shares = [[0, 0x1000, 4096, bytes(64)]]
    spec: dict[str, Any] = {
        "cuda_chunks": [[0, 0x10_0000 * (i + 1), 4096] for i in range(len(fds))],
        "cuda_chunk_fds": fds,
    }
    if fds:
        spec["cuda_shares"] = shares
    else:
        spec["cuda_chunk_fds"] = ["3"]
    with pytest.raises(ConfigError):
        open_gpu_memory(spec)
    assert not any(is_open(fd) for fd in fds)


def test_no_gpu_memory_is_none_and_this_machine_has_no_driver() -> None:
    assert open_gpu_memory({}) is None
    with pytest.raises(TransportUnavailable, match="libcuda"):
        VmmDriver()
    chunks = exported()
    with pytest.raises(TransportUnavailable):
        open_gpu_memory({"cuda_chunks": chunks_to_wire(chunks), "cuda_chunk_fds": [c.fd for c in chunks]})
    assert not any(is_open(chunk.fd) for chunk in chunks)
