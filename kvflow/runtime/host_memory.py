"""Host memory another process can map: KV caches moved, in place, onto shared memory.

Why in place: a host engine (vLLM) allocates its KV caches itself and keeps views of them
everywhere (attention layers, kernel-block views, captured graphs), so the caches cannot be
swapped for new tensors.  Their *pages* can be: `share_in_place` copies each run of pages under
the regions into a memory file (``memfd_create``) and maps that file over the same addresses
(``MAP_FIXED | MAP_SHARED``), chunk by chunk, so every pointer and view the host holds stays
valid and now reads and writes memory that a child process may map too (`MappedSpans`).  At most
one chunk is held twice while it moves; chunks that are all zeros (fresh caches) are not copied.

Linux only (memfd and ``MAP_FIXED``).  Nothing may write the memory while it moves: call it
before the engine's first forward (vLLM: `register_kv_caches`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvflow.errors import ConfigError, TransportError
from kvflow.layout import MemoryType, Region
from kvflow.transports.shm_files import can_map, map_shared

__all__ = ("MappedSpans", "SharedSpan", "share_in_place", "supported")

PAGE = mmap.PAGESIZE
CHUNK = 64 << 20  # bytes moved at a time (the most held twice)


@dataclass(frozen=True, slots=True)
class SharedSpan:
    """Pages ``[base, base + length)`` of the host, backed by memory file `fd` from offset 0."""

    fd: int
    base: int
    length: int


def supported() -> bool:
    """Whether this platform can share host memory in place (Linux with memfd)."""
    return can_map() and hasattr(os, "memfd_create")


def _spans(regions: Sequence[Region]) -> list[tuple[int, int]]:
    """The page runs covering the regions, merged where they touch or overlap."""
    runs = sorted((r.base // PAGE * PAGE, -(-(r.base + r.length) // PAGE) * PAGE) for r in regions)
    merged: list[list[int]] = []
    for start, end in runs:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]


def share_in_place(regions: Sequence[Region]) -> list[SharedSpan]:
    """Back the pages under `regions` (host memory) with memory files, at the same addresses.

    Whole pages move: a region that does not start or end on a page boundary takes the rest of
    its first and last page with it, so regions shared with different live engines must not
    share a page (the later call would take the page from the earlier one's engine, which would
    then read and write memory the host no longer sees).  KV caches are allocations of their
    own, page-aligned; small arrays from a heap may lie side by side.

    The caller owns the returned files (``os.close`` each once a child has them); the host's
    mapping keeps the memory alive after that.

    :raises ConfigError: a region is not host memory, or the platform cannot share memory.
    :raises TransportError: the kernel refused a memory file or a mapping.
    """
    if not supported():
        raise ConfigError("sharing host memory with an engine process needs Linux (memfd_create)")
    if any(region.memory is not MemoryType.DRAM for region in regions):
        raise ConfigError("only host (DRAM) memory can be shared with an engine process")
    spans = []
    try:
        for base, length in _spans(regions):
            fd = os.memfd_create(f"kvflow-kv-{base:x}", os.MFD_CLOEXEC)
            spans.append(SharedSpan(fd, base, length))
            os.ftruncate(fd, length)
            for offset in range(0, length, CHUNK):
                _move_chunk(fd, base, offset, min(CHUNK, length - offset))
    except OSError as exc:
        for span in spans:
            os.close(span.fd)
        raise TransportError(f"cannot share host memory with an engine process: {exc}") from exc
    return spans


def _move_chunk(fd: int, base: int, offset: int, size: int) -> None:
    """Copy one chunk of the host's pages into the file (unless all zero) and map the file over it."""
    here = (ctypes.c_char * size).from_address(base + offset)
    view = memoryview(here).cast("B")
    if np.frombuffer(view, np.uint8).any():  # a fresh file reads as zeros already
        os.pwrite(fd, view, offset)
    map_shared(fd, size, offset=offset, at=base + offset, flags=getattr(mmap, "MAP_POPULATE", 0))  # faulted in now


class MappedSpans:
    """The host's spans mapped into this process (an engine process): host addresses translate
    to local ones (`translate`)."""

    def __init__(self, spans: Sequence[tuple[int, int, int]]) -> None:
        """`spans`: (memory file descriptor, host base, length) each; the files are closed once mapped.

        :raises TransportError: a file cannot be mapped.
        """
        self._maps: list[tuple[int, int, mmap.mmap, int]] = []  # host base, length, mapping, local base
        try:
            for fd, base, length in spans:
                try:
                    # populated: every page faulted in now, not by the first WRITE into it
                    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                    mapping = mmap.mmap(fd, length, flags, mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
                local = int(np.frombuffer(mapping, np.uint8).ctypes.data)
                self._maps.append((base, length, mapping, local))
        except OSError as exc:
            raise TransportError(f"cannot map the host's KV memory: {exc}") from exc

    def translate(self, region: Region) -> Region:
        """The region at its address in this process.

        :raises ConfigError: no mapped span holds the whole region.
        """
        for base, length, _, local in self._maps:
            if base <= region.base and region.base + region.length <= base + length:
                return Region(local + region.base - base, region.length, region.memory, region.device_id)
        raise ConfigError(f"region at {region.base:#x} ({region.length} bytes) lies outside the shared memory")
