"""GPU memory another process maps through POSIX file descriptors: vLLM 0.34's exportable KV cache.

Why: a connector that declares ``EXPORTS_FD`` gets vLLM 0.34's extensible KV cache, driver-mapped
memory (one reserved range, physical chunks from ``cuMemCreate``, one chunk per segment), which
legacy CUDA IPC (`cuda_ipc`) cannot share.  The owner (vLLM's worker) finds the chunk holding each
region (``cuMemGetAddressRange``, as for a legacy allocation: `cuda_ipc.plan_shares`), retains
its handle and exports it as a file descriptor (`VmmDriver.export_fd`).  The descriptors reach
the engine process at start as its host-memory spans do (inherited), and again after vLLM
remaps the cache (sleep mode, a weight update) over the Unix socket with ``SCM_RIGHTS``
(`kvflow.runtime.fd_passing`).  There each chunk is imported, mapped into a range reserved once
and kept, and made readable and writable on its device (`ImportedChunks`): a remapped chunk
lands at the same local address, so the engine's registered regions keep their addresses.
Regions move by their offsets (`cuda_ipc.translate`).  Only the driver calls differ from
`cuda_ipc`; they go through a seam (`ChunkDriver`) so that the import, roll-back and remap
sequence is tested without a GPU.

Not yet run on a GPU: the GPU check's phase V is its test there.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvflow.errors import ConfigError, TransportError
from kvflow.layout import Region
from kvflow.runtime.cuda_ipc import CudaDriver, OpenedShares, Share, load_cuda_runtime, shares_from_wire, translate

__all__ = (
    "Chunk",
    "ChunkDriver",
    "ImportedChunks",
    "VmmDriver",
    "chunks_from_wire",
    "chunks_to_wire",
    "open_gpu_memory",
)

log = logging.getLogger(__name__)

POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE


@dataclass(frozen=True, slots=True)
class Chunk:
    """One physical chunk of device `device`, mapped at ``[base, base + length)`` in the
    owner's address space; `fd` its exported descriptor in the process holding this record
    (-1 where it travels apart, as over the wire)."""

    device: int
    base: int
    length: int
    fd: int = -1

    def share(self) -> Share:
        """The chunk as `cuda_ipc.translate` reads an allocation."""
        return Share(self.device, self.base, self.length)


def chunks_to_wire(chunks: Sequence[Chunk]) -> list[list[int]]:
    """[device, base, length] each: the descriptors travel beside, in the same order."""
    return [[chunk.device, chunk.base, chunk.length] for chunk in chunks]


def chunks_from_wire(wire: Any, fds: Sequence[int]) -> list[Chunk]:
    """The chunks of `wire`, each with its descriptor from `fds` (in order).

    :raises ConfigError: `wire` is not a list of [device, base, length] with positive lengths,
        or its count differs from the descriptors'.
    """
    if not isinstance(wire, list):
        raise ConfigError(f"exported GPU chunks must be a list, not {wire!r:.80}")
    if len(wire) != len(fds):
        raise ConfigError(f"{len(wire)} exported GPU chunks came with {len(fds)} file descriptors")
    chunks = []
    for entry, fd in zip(wire, fds, strict=True):
        ok = isinstance(entry, list) and len(entry) == 3
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entry)
        if not ok or entry[2] == 0:
            raise ConfigError(f"an exported GPU chunk is [device, base, length > 0], not {entry!r:.80}")
        chunks.append(Chunk(entry[0], entry[1], entry[2], fd))
    return chunks


class ChunkDriver(Protocol):
    """The driver calls an importer makes (`VmmDriver`; a test's stand-in elsewhere)."""

    def bind(self, device: int) -> None: ...
    def reserve(self, length: int) -> int: ...
    def import_fd(self, fd: int) -> int: ...
    def map(self, device: int, address: int, length: int, handle: int) -> None: ...
    def release(self, handle: int) -> None: ...
    def unmap(self, address: int, length: int) -> None: ...
    def free(self, address: int, length: int) -> None: ...


class _Location(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _AccessDesc(ctypes.Structure):
    _fields_ = (("location", _Location), ("flags", ctypes.c_int))


class VmmDriver(CudaDriver):
    """`CudaDriver` and the virtual-memory calls exporting and importing a chunk need."""

    def export_fd(self, chunk: Chunk) -> Chunk:
        """`chunk` with a new file descriptor for its physical memory (the caller closes it).
        :raises TransportError: CUDA refused (the memory is not driver-mapped, say, or was not
        created exportable as a descriptor: vLLM then did not allocate for ``EXPORTS_FD``)."""
        self.bind(chunk.device)
        handle, fd = ctypes.c_uint64(), ctypes.c_int(-1)
        address = ctypes.c_void_p(chunk.base)
        self._check(self._lib.cuMemRetainAllocationHandle(ctypes.byref(handle), address), "cuMemRetainAllocationHandle")
        try:
            status = self._lib.cuMemExportToShareableHandle(
                ctypes.byref(fd), handle, ctypes.c_int(POSIX_FD), ctypes.c_ulonglong(0)
            )
            self._check(status, "cuMemExportToShareableHandle")
        finally:
            self._lib.cuMemRelease(handle)  # the retain's reference; the owner's mapping keeps the memory
        return Chunk(chunk.device, chunk.base, chunk.length, int(fd.value))

    def reserve(self, length: int) -> int:
        """:raises TransportError: CUDA's."""
        address = ctypes.c_uint64()
        status = self._lib.cuMemAddressReserve(
            ctypes.byref(address),
            ctypes.c_size_t(length),
            ctypes.c_size_t(0),
            ctypes.c_uint64(0),
            ctypes.c_ulonglong(0),
        )
        self._check(status, "cuMemAddressReserve")
        return int(address.value)

    def import_fd(self, fd: int) -> int:
        """The allocation handle for descriptor `fd` (the caller releases it).  :raises TransportError: CUDA's."""
        handle = ctypes.c_uint64()
        status = self._lib.cuMemImportFromShareableHandle(
            ctypes.byref(handle), ctypes.c_void_p(fd), ctypes.c_int(POSIX_FD)
        )
        self._check(status, "cuMemImportFromShareableHandle")
        return int(handle.value)

    def map(self, device: int, address: int, length: int, handle: int) -> None:
        """Map `handle` at `address` and let `device` read and write it.  :raises TransportError: CUDA's."""
        status = self._lib.cuMemMap(
            ctypes.c_uint64(address),
            ctypes.c_size_t(length),
            ctypes.c_size_t(0),
            ctypes.c_uint64(handle),
            ctypes.c_ulonglong(0),
        )
        self._check(status, "cuMemMap")
        access = _AccessDesc(_Location(_LOCATION_DEVICE, device), _READ_WRITE)
        status = self._lib.cuMemSetAccess(
            ctypes.c_uint64(address), ctypes.c_size_t(length), ctypes.byref(access), ctypes.c_size_t(1)
        )
        if status != 0:
            self._lib.cuMemUnmap(ctypes.c_uint64(address), ctypes.c_size_t(length))
            self._check(status, "cuMemSetAccess")

    def release(self, handle: int) -> None:
        """Never raises (a reference the mapping no longer needs)."""
        self._lib.cuMemRelease(ctypes.c_uint64(handle))

    def unmap(self, address: int, length: int) -> None:
        """Never raises."""
        self._lib.cuMemUnmap(ctypes.c_uint64(address), ctypes.c_size_t(length))

    def free(self, address: int, length: int) -> None:
        """Never raises."""
        self._lib.cuMemAddressFree(ctypes.c_uint64(address), ctypes.c_size_t(length))


class ImportedChunks:
    """The owner's chunks mapped into this process (an engine process's KV memory on one GPU).

    Each chunk gets a local range reserved once; `unmap` lets the physical memory go (the owner
    is about to release it) and `remap` maps the chunks the owner exports after, at the same
    local addresses.  Descriptors handed in are closed here, mapped or not.
    """

    def __init__(self, chunks: Sequence[Chunk], driver: ChunkDriver | None = None) -> None:
        """:raises ConfigError: the chunks are of more than one GPU, or none.
        :raises TransportError: the driver is missing (`TransportUnavailable`) or refused one;
            what was reserved or mapped before is let go again."""
        try:
            devices = {chunk.device for chunk in chunks}
            if len(devices) != 1:
                raise ConfigError(f"an engine's KV memory lies on one GPU, not on {sorted(devices)}")
            if driver is None:
                runtime = load_cuda_runtime() or "none found (UCX's CUDA modules may not load)"
                log.info("CUDA runtime for UCX: %s", runtime)
                driver = VmmDriver()
        except (ConfigError, TransportError):
            _close_fds(chunks)
            raise
        self.device = devices.pop()
        self.driver = driver
        self.chunks = [chunk.share() for chunk in chunks]
        self.local: list[int] = []
        self._mapped = False
        try:
            driver.bind(self.device)
            for chunk in chunks:
                self.local.append(driver.reserve(chunk.length))
            self.remap(chunks)
        except (ConfigError, TransportError):
            _close_fds(chunks)  # those `remap` did not reach
            self.close()
            raise

    def remap(self, chunks: Sequence[Chunk]) -> None:
        """Map `chunks` (the same ranges of the owner as at start) at their local addresses.

        :raises ConfigError: they are not the chunks this process reserved for.
        :raises TransportError: CUDA refused one; none is left mapped.
        """
        try:
            if self._mapped:
                raise ConfigError("the owner's GPU chunks are mapped already: unmap them first")
            if [chunk.share() for chunk in chunks] != self.chunks:
                raise ConfigError(f"{len(chunks)} GPU chunks do not match the {len(self.chunks)} reserved for at start")
            self.driver.bind(self.device)
            done: list[tuple[int, int]] = []
            try:
                for chunk, local in zip(chunks, self.local, strict=True):
                    handle = self.driver.import_fd(chunk.fd)
                    try:
                        self.driver.map(chunk.device, local, chunk.length, handle)
                    finally:
                        self.driver.release(handle)  # the mapping holds the memory now
                    done.append((local, chunk.length))
            except TransportError:
                for local, length in done:
                    self.driver.unmap(local, length)
                raise
        finally:
            _close_fds(chunks)
        self._mapped = True

    def unmap(self) -> None:
        """Let the owner's physical memory go; the local ranges stay reserved.  Never raises."""
        if self._mapped:
            for share, local in zip(self.chunks, self.local, strict=True):
                self.driver.unmap(local, share.length)
        self._mapped = False

    def translate(self, region: Region) -> Region:
        """:raises ConfigError: see `cuda_ipc.translate`."""
        return translate(region, self.chunks, self.local)

    def bind(self) -> None:
        """Bind the calling thread to the chunks' GPU.  :raises TransportError: CUDA's."""
        self.driver.bind(self.device)

    def close(self) -> None:
        """Unmap and give back the reserved ranges (once the engine no longer uses them).  Never raises."""
        self.unmap()
        for share, local in zip(self.chunks, self.local, strict=False):  # a failed start reserved a prefix
            self.driver.free(local, share.length)
        self.local = []


def open_gpu_memory(spec: dict[str, Any]) -> OpenedShares | ImportedChunks | None:
    """The host's GPU memory in this process, as the engine process's spec hands it over (legacy
    CUDA IPC shares, or exported chunks whose descriptors this process inherited); None: none.

    :raises ConfigError: a malformed spec, or both kinds at once.
    :raises TransportError: the driver is missing or refused (see `OpenedShares`, `ImportedChunks`).
    """
    fds = spec.get("cuda_chunk_fds", [])
    try:
        if not (isinstance(fds, list) and all(isinstance(fd, int) and not isinstance(fd, bool) for fd in fds)):
            raise ConfigError(f"exported GPU chunks' descriptors must be a list of integers, not {fds!r:.80}")
        chunks = chunks_from_wire(spec.get("cuda_chunks", []), fds)
        shares = shares_from_wire(spec.get("cuda_shares", []))
        if shares and chunks:
            raise ConfigError("an engine's GPU memory comes by legacy CUDA IPC or by exported chunks, not both")
    except ConfigError:
        _close_fds([Chunk(0, 0, 1, fd) for fd in fds if isinstance(fd, int)])
        raise
    if chunks:
        return ImportedChunks(chunks)
    return OpenedShares(shares) if shares else None


def _close_fds(chunks: Sequence[Chunk]) -> None:
    for chunk in chunks:
        if chunk.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(chunk.fd)
