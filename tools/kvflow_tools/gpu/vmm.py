"""GPU memory as vLLM 0.34's extensible KV cache holds it, for the GPU check's phase V.

Why the check allocates it itself: the GPU machine has no vLLM.  vLLM 0.34, for a connector that
declares ``EXPORTS_FD``, reserves a virtual range and maps one physical chunk per segment into it
(``cuMemCreate`` with a POSIX file descriptor handle type), and after sleep mode or a weight
update maps a new chunk at the same addresses.  `ExportableMemory` does the same for one
segment (a layer's cache) through the CUDA driver, and `as_tensor` gives torch a view of it, so
the owner child fills and hashes it as it does torch's own memory.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__all__ = ("ExportableMemory",)

_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE


class _Location(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _Flags(ctypes.Structure):
    _fields_ = (
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    )


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = (
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _Flags),
    )


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = (("location", _Location), ("flags", ctypes.c_int))


class _CudaArray:
    """What torch reads a device pointer through (``__cuda_array_interface__``, version 3)."""

    def __init__(self, address: int, length: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


class ExportableMemory:
    """`length` bytes (rounded up to the driver's granularity) of device `device` in one physical
    chunk exportable as a file descriptor, mapped at an address reserved for it."""

    def __init__(self, length: int, device: int = 0) -> None:
        """:raises RuntimeError: the driver refused (its error named); the current thread must
        have the device's primary context current (torch's, after a first CUDA op)."""
        self._lib = ctypes.CDLL("libcuda.so.1")
        self.device = device
        self._prop = _Prop(_PINNED, _POSIX_FD, _Location(_DEVICE, device))
        granularity = ctypes.c_size_t()
        self._call(
            "cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self._prop), ctypes.c_int(0)
        )
        step = granularity.value
        self.length = -(-length // step) * step
        address = ctypes.c_uint64()
        zero = ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_ulonglong(0)  # alignment, where, flags
        self._call("cuMemAddressReserve", ctypes.byref(address), ctypes.c_size_t(self.length), *zero)
        self.address = int(address.value)
        self._handle: int | None = None
        self.commit()

    def _call(self, name: str, *args: Any) -> None:
        status = getattr(self._lib, name)(*args)
        if status != 0:
            text = ctypes.c_char_p()
            self._lib.cuGetErrorName(ctypes.c_int(status), ctypes.byref(text))
            raise RuntimeError(f"{name} failed: {text.value.decode() if text.value else status}")

    def commit(self) -> None:
        """Map a new physical chunk at the reserved address (what vLLM does on wake-up)."""
        handle = ctypes.c_uint64()
        length = ctypes.c_size_t(self.length)
        self._call("cuMemCreate", ctypes.byref(handle), length, ctypes.byref(self._prop), ctypes.c_ulonglong(0))
        address = ctypes.c_uint64(self.address)
        self._call("cuMemMap", address, length, ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
        access = _Access(_Location(_DEVICE, self.device), _READ_WRITE)
        self._call("cuMemSetAccess", address, length, ctypes.byref(access), ctypes.c_size_t(1))
        self._handle = int(handle.value)

    def release(self) -> None:
        """Unmap and free the physical chunk, keeping the addresses (what vLLM does for sleep)."""
        if self._handle is not None:
            torch.cuda.synchronize()
            self._call("cuMemUnmap", ctypes.c_uint64(self.address), ctypes.c_size_t(self.length))
            self._call("cuMemRelease", ctypes.c_uint64(self._handle))
            self._handle = None

    def as_tensor(self, nbytes: int) -> torch.Tensor:
        """A uint8 torch view of the first `nbytes` (which must fit)."""
        assert nbytes <= self.length
        return torch.as_tensor(_CudaArray(self.address, nbytes), device=f"cuda:{self.device}")
