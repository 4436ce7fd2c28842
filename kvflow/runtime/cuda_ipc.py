"""GPU memory another process can reach: legacy CUDA IPC handles, exported by the owner, opened by an engine process.

Why: an engine in a process of its own must write from the KV caches the model runner allocated
on the GPU, and cannot be handed the tensors.  Legacy CUDA IPC shares a whole allocation
(``cuIpcGetMemHandle`` on its base): what vLLM 0.32/0.33's caching allocator hands out, and what
0.34 allocates for a connector that declares ``LEGACY_IPC``.  Several KV tensors may lie in one
allocation, and an allocation may be opened only once per process, so the owner finds each
region's allocation (``cuMemGetAddressRange``) and shares each allocation once (`plan_shares`,
pure); the engine process opens each once and moves every region by its offset in it
(`translate`, pure).  The driver API is reached through ctypes (``libcuda.so.1``, `CudaDriver`):
the engine process needs no torch to open the memory.

Not yet run on a GPU: the GPU check's phase G (`scripts/gpu-check`) is its test there.  The
0.34 extensible cache's chunks travel as file descriptors instead (`cuda_vmm`, ``EXPORTS_FD``).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.errors import ConfigError, TransportError, TransportUnavailable
from kvflow.layout import MemoryType, Region

__all__ = (
    "HANDLE_BYTES",
    "CudaDriver",
    "OpenedShares",
    "Share",
    "plan_shares",
    "shares_from_wire",
    "load_cuda_runtime",
    "shares_to_wire",
    "translate",
)

log = logging.getLogger(__name__)

HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
_RUNTIMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


@dataclass(frozen=True, slots=True)
class Share:
    """One allocation of device `device`: ``[base, base + length)`` in the owner's address space,
    opened elsewhere with `handle` (empty until exported)."""

    device: int
    base: int
    length: int
    handle: bytes = b""


def plan_shares(regions: Sequence[Region], allocation_of: Callable[[int], tuple[int, int]]) -> list[Share]:
    """The allocations holding `regions` (device memory only), each once, in address order;
    `allocation_of(address)` is the (base, length) of the allocation holding an address.

    :raises ConfigError: a region is not device memory, or spills out of its allocation.
    """
    found: dict[tuple[int, int], Share] = {}
    for region in regions:
        if region.memory is not MemoryType.VRAM:
            raise ConfigError(f"region at {region.base:#x} is {region.memory.value}, not GPU memory: no CUDA IPC")
        base, length = allocation_of(region.base)
        if not (base <= region.base and region.base + region.length <= base + length):
            raise ConfigError(
                f"region at {region.base:#x} ({region.length} bytes) spills out of its allocation "
                f"at {base:#x} ({length} bytes): one CUDA IPC handle cannot carry it"
            )
        found.setdefault((region.device_id, base), Share(region.device_id, base, length))
    return sorted(found.values(), key=lambda share: (share.device, share.base))


def translate(region: Region, shares: Sequence[Share], opened: Sequence[int]) -> Region:
    """`region` at its address in the process that opened `shares` at addresses `opened`.

    :raises ConfigError: no share holds the whole region on its device.
    """
    for share, local in zip(shares, opened, strict=True):
        if share.device == region.device_id and share.base <= region.base <= share.base + share.length - region.length:
            return Region(local + region.base - share.base, region.length, region.memory, region.device_id)
    raise ConfigError(
        f"region at {region.base:#x} ({region.length} bytes) on GPU {region.device_id} lies outside what was shared"
    )


def shares_to_wire(shares: Sequence[Share]) -> list[list[Any]]:
    return [[share.device, share.base, share.length, share.handle] for share in shares]


def shares_from_wire(wire: Any) -> list[Share]:
    """:raises ConfigError: `wire` is not a list of [device, base, length, 64-byte handle]."""
    if not isinstance(wire, list):
        raise ConfigError(f"CUDA IPC shares must be a list, not {wire!r:.80}")
    shares = []
    for entry in wire:
        ok = isinstance(entry, list) and len(entry) == 4
        if ok:
            device, base, length, handle = entry
            ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (device, base, length))
            ok = ok and length > 0 and isinstance(handle, bytes) and len(handle) == HANDLE_BYTES
        if not ok:
            raise ConfigError(
                f"a CUDA IPC share is [device, base, length, {HANDLE_BYTES}-byte handle], not {entry!r:.80}"
            )
        shares.append(Share(device, base, length, handle))
    return shares


class _Handle(ctypes.Structure):
    """CUipcMemHandle: 64 opaque bytes, passed by value (bytes, not chars: it holds zeros)."""

    _fields_ = (("reserved", ctypes.c_ubyte * HANDLE_BYTES),)


class CudaDriver:
    """The few CUDA driver calls sharing needs, on ``libcuda.so.1`` (every CUDA host has it)."""

    def __init__(self) -> None:
        """:raises TransportUnavailable: no CUDA driver here, or it does not start."""
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise TransportUnavailable(f"no CUDA driver (libcuda.so.1): {exc}") from exc
        self._lib.cuIpcOpenMemHandle_v2.argtypes = (ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint)
        self._check(self._lib.cuInit(ctypes.c_uint(0)), "cuInit")
        self._contexts: dict[int, ctypes.c_void_p] = {}

    def _check(self, status: int, call: str) -> None:
        """:raises TransportError: `status` is not CUDA_SUCCESS; the message names `call` and the error."""
        if status == 0:
            return
        name = ctypes.c_char_p()
        self._lib.cuGetErrorName(ctypes.c_int(status), ctypes.byref(name))
        what = name.value.decode() if name.value else f"CUresult {status}"
        error = TransportUnavailable if call == "cuInit" else TransportError
        raise error(f"{call} failed: {what}")

    def allocation_of(self, address: int) -> tuple[int, int]:
        """(base, length) of the allocation holding device `address`.  :raises TransportError: CUDA's."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.bind(self._device_of(address))
        self._check(
            self._lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address)),
            "cuMemGetAddressRange",
        )
        return int(base.value), int(size.value)

    def _device_of(self, address: int) -> int:
        """The ordinal of the device holding `address` (CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL).
        :raises TransportError: CUDA's (not device memory, say)."""
        ordinal = ctypes.c_int()
        status = self._lib.cuPointerGetAttribute(ctypes.byref(ordinal), ctypes.c_int(9), ctypes.c_uint64(address))
        self._check(status, "cuPointerGetAttribute")
        return int(ordinal.value)

    def export(self, shares: Sequence[Share]) -> list[Share]:
        """`shares` with their handles.  :raises TransportError: CUDA refused one."""
        exported = []
        for share in shares:
            self.bind(share.device)
            handle = _Handle()
            self._check(
                self._lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(share.base)), "cuIpcGetMemHandle"
            )
            exported.append(Share(share.device, share.base, share.length, bytes(handle.reserved)))
        return exported

    def bind(self, device: int) -> None:
        """Make `device`'s primary context current on the calling thread (each thread that
        touches the opened memory, NIXL's included).  :raises TransportError: CUDA's."""
        context = self._contexts.get(device)
        if context is None:
            handle, context = ctypes.c_int(), ctypes.c_void_p()
            self._check(self._lib.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(device)), "cuDeviceGet")
            self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle), "cuDevicePrimaryCtxRetain")
            self._contexts[device] = context
        self._check(self._lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")

    def open(self, shares: Sequence[Share]) -> list[int]:
        """Each share opened in this process (its device's context made current first); their
        local addresses.  What was opened before a failure is closed again.

        :raises TransportError: CUDA refused one.
        """
        opened: list[int] = []
        try:
            for share in shares:
                self.bind(share.device)
                handle = _Handle.from_buffer_copy(share.handle)
                local = ctypes.c_uint64()
                status = self._lib.cuIpcOpenMemHandle_v2(
                    ctypes.byref(local), handle, ctypes.c_uint(_LAZY_ENABLE_PEER_ACCESS)
                )
                self._check(status, "cuIpcOpenMemHandle")
                opened.append(int(local.value))
        except TransportError:
            self.close(opened)
            raise
        return opened

    def close(self, opened: Sequence[int]) -> None:
        """Close what `open` returned (best effort: a failure here changes nothing).  Never raises."""
        for local in opened:
            self._lib.cuIpcCloseMemHandle(ctypes.c_uint64(local))

    def copy_to_host(self, device: int, address: int, length: int) -> bytes:
        """`length` bytes of GPU `device`'s memory at `address` (for a check, never a transfer),
        on the calling thread (bound to the device first).  :raises TransportError: CUDA's."""
        self.bind(device)
        buffer = ctypes.create_string_buffer(length)
        self._check(
            self._lib.cuMemcpyDtoH_v2(buffer, ctypes.c_uint64(address), ctypes.c_size_t(length)), "cuMemcpyDtoH"
        )
        return buffer.raw


def load_cuda_runtime() -> str | None:
    """Load CUDA's runtime library process-wide, as torch does in a model runner: UCX's CUDA
    modules (inside NIXL) need it to register and move device memory, and an engine process
    imports no torch.  Tried by name, then in the ``nvidia`` wheels on the path, then by
    importing torch; the path loaded (None: none was found, UCX will then refuse VRAM).
    Never raises."""
    candidates = list(_RUNTIMES)
    for entry in sys.path:
        candidates += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", "libcudart.so*")))
        candidates += sorted(glob.glob(os.path.join(entry, "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
    for name in candidates:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return name
    try:
        import torch  # noqa: F401  # loads its own CUDA runtime
    except ImportError:
        return None
    return "torch"


class OpenedShares:
    """The owner's shares opened in this process (an engine process's KV memory on one GPU)."""

    def __init__(self, shares: Sequence[Share]) -> None:
        """:raises ConfigError: the shares are of more than one GPU, or none.
        :raises TransportError: the driver is missing (`TransportUnavailable`) or refused one."""
        devices = {share.device for share in shares}
        if len(devices) != 1:
            raise ConfigError(f"an engine's KV memory lies on one GPU, not on {sorted(devices)}")
        runtime = load_cuda_runtime()
        log.info("CUDA runtime for UCX: %s", runtime or "none found (UCX's CUDA modules may not load)")
        self.device = devices.pop()
        self.shares = list(shares)
        self.driver = CudaDriver()
        self.opened = self.driver.open(self.shares)

    def translate(self, region: Region) -> Region:
        """:raises ConfigError: see `translate`."""
        return translate(region, self.shares, self.opened)

    def bind(self) -> None:
        """Bind the calling thread to the shares' GPU.  :raises TransportError: CUDA's."""
        self.driver.bind(self.device)

    def close(self) -> None:
        """Close the opened allocations (once the engine no longer uses them).  Never raises."""
        self.driver.close(self.opened)
        self.opened = []
