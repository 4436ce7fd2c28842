"""Turn numpy arrays and torch tensors into registered-memory `Region`s.

Why: callers hold KV caches as arrays or tensors; transports need (address, length, memory
type, device).  torch is imported only if the caller passes a tensor, so numpy-only users never
pay for it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from kvflow.errors import ConfigError
from kvflow.layout.spec import MemoryType, Region

__all__ = ("region_of",)


def region_of(buffer: Any) -> Region:
    """The `Region` a contiguous numpy array or torch tensor occupies.

    CPU memory is DRAM; CUDA tensors are VRAM on their device index.

    :raises ConfigError: the object is not a contiguous array or tensor.
    """
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ConfigError("numpy buffer must be C-contiguous")
        return Region(int(buffer.ctypes.data), int(buffer.nbytes), MemoryType.DRAM, 0)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buffer, torch.Tensor):
        if not buffer.is_contiguous():
            raise ConfigError("torch tensor must be contiguous")
        length = int(buffer.numel() * buffer.element_size())
        if buffer.device.type == "cpu":
            return Region(int(buffer.data_ptr()), length, MemoryType.DRAM, 0)
        if buffer.device.type == "cuda":
            return Region(int(buffer.data_ptr()), length, MemoryType.VRAM, int(buffer.device.index or 0))
        raise ConfigError(f"torch device {buffer.device.type!r} is not supported")
    raise ConfigError(f"cannot register a {type(buffer).__name__}: pass a numpy array or a torch tensor")
