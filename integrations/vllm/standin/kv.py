"""The stand-in's KV bytes and device: a pattern written through vLLM's views, and a GPU that lags.

Why: a connector test must fail when a page is stale, torn, misplaced, or read before the device
wrote it.  `PagedKV` writes and checks a pattern unique to (transfer, block position, layer, KV
shard) token by token through vLLM's own per-layer views, whatever their layout.
`LaggingDevice` runs the kernels a forward enqueues later, on its own thread, and is what
kvflow's device seam sees in place of CUDA: a WRITE that does not wait for its gate moves bytes
the device has not written yet, and a model-runner hook that waits for the device raises.
"""

from __future__ import annotations

import functools
import hashlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ("LaggingDevice", "PagedKV")


class LaggingDevice:
    """A device that runs the kernels the forward enqueues `lag` seconds after their launch,
    in launch order, on its own thread (kvflow's `Device` seam; gates open as kernels run)."""

    def __init__(self, lag: float) -> None:
        self.lag = lag
        self.bound: set[str] = set()  # names of the threads bound to this device
        self.host_threads: set[int] = set()  # threads that must never wait for the device
        self._queue: queue.SimpleQueue[tuple[float, int, Callable[[], None]] | None] = queue.SimpleQueue()
        self._launched = 0
        self._done = 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="standin-device", daemon=True)
        self._thread.start()

    def launch(self, kernel: Callable[[], None]) -> None:
        with self._cond:
            self._launched += 1
            self._queue.put((time.monotonic() + self.lag, self._launched, kernel))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            due, seq, kernel = item
            time.sleep(max(0.0, due - time.monotonic()))
            kernel()
            with self._cond:
                self._done = seq
                self._cond.notify_all()

    def bind_thread(self) -> None:
        self.bound.add(threading.current_thread().name)

    def record(self) -> _LaggingGate:
        with self._cond:
            return _LaggingGate(self, self._launched)

    @property
    def launched(self) -> int:
        """Kernels launched so far."""
        with self._cond:
            return self._launched

    def pending(self) -> int:
        with self._cond:
            return self._launched - self._done

    def wait_for(self, seq: int) -> None:
        if threading.get_ident() in self.host_threads:
            raise AssertionError("a model-runner hook waited for the device")
        with self._cond:
            self._cond.wait_for(lambda: self._done >= seq)

    def is_done(self, seq: int) -> bool:
        with self._cond:
            return self._done >= seq

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)


@dataclass(frozen=True)
class _LaggingGate:
    device: LaggingDevice
    seq: int

    def done(self) -> bool:
        return self.device.is_done(self.seq)

    def wait(self) -> None:
        self.device.wait_for(self.seq)


@functools.lru_cache(maxsize=64)
def _keys(tag: str, positions: tuple[int, ...], shard: int) -> list[int]:
    """A 64-bit key per block position of a transfer's pages on one KV shard."""
    digests = [hashlib.blake2b(f"{tag}/{p}/{shard}".encode(), digest_size=8).digest() for p in positions]
    return [int.from_bytes(d, "little", signed=True) for d in digests]


def _one_run(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether elements of this shape and these strides fill ``[0, numel)`` exactly."""
    extent = 1
    for stride, size in sorted(zip(strides, shape, strict=True)):
        if size > 1 and stride != extent:
            return False
        extent *= size
    return True


class PagedKV:
    """One rank's KV pages, seen through vLLM's per-layer views, by token.

    A page's expected content is a fixed random page per layer XORed with a 64-bit key of
    (transfer tag, block position, KV shard): a zeroed, stale, misplaced or torn page cannot
    match.  Pages move as 64-bit words, vectorised over blocks; where a layout keeps a page in
    one run of memory, whole pages move as rows of that run (the pattern is defined in memory
    order there).  Host memory is handled with numpy views of the same bytes (several times
    faster than torch's indexing on CPU), device memory with torch on the current stream, so
    the stand-in's own work stays a small part of a step."""

    def __init__(self, views: list[torch.Tensor], num_blocks: int, block_size: int, shard: int) -> None:
        self.shard = shard
        self.block_size = block_size
        self.device = views[0].device
        host = self.device.type == "cpu"
        self.views: list[Any] = []  # [block, kernel block, H, n, words]
        self.rows: list[Any] = []  # [block, words] where a page is one run, else None
        self.flat_base: list[Any] = []  # [words] in memory order where a page is one run, else None
        self.base: list[Any] = []  # [kernel block, H, n, words]
        generator = torch.Generator().manual_seed(1234)
        for view in views:
            as_bytes = view.view(torch.uint8)  # [kernel block, H, n, bytes]
            if as_bytes.shape[-1] % 8:
                raise ValueError("the stand-in's pattern needs page rows of whole 64-bit words")
            words = as_bytes.view(torch.int64)
            pages = words.view(num_blocks, -1, *words.shape[1:])
            inner_shape, inner_strides = tuple(pages.shape[1:]), tuple(pages.stride()[1:])
            numel = pages[0].numel()
            rows = flat = None
            if _one_run(inner_shape, inner_strides):
                flat = torch.randint(-(2**62), 2**62, (numel,), generator=generator, dtype=torch.int64).to(self.device)
                rows = pages.as_strided((num_blocks, numel), (pages.stride(0), 1))
                base = flat.as_strided(inner_shape, inner_strides)
            else:
                base = torch.randint(-(2**62), 2**62, inner_shape, generator=generator, dtype=torch.int64)
                base = base.to(self.device)
            convert: Callable[[Any], Any] = (lambda t: None if t is None else t.numpy()) if host else (lambda t: t)
            self.views.append(convert(pages))
            self.rows.append(convert(rows))
            self.flat_base.append(convert(flat))
            self.base.append(convert(base))
        self.kernel_blocks, self.kernel_rows = int(self.views[0].shape[1]), int(self.views[0].shape[3])
        self._scratches: dict[Any, Any] = {}

    def _scratch(self, dtype: Any, shape: tuple[int, int]) -> Any:
        """A host array reused across calls (one per dtype, grown as needed)."""
        size = shape[0] * shape[1]
        held = self._scratches.get(dtype)
        if held is None or held.size < size:
            held = self._scratches[dtype] = np.empty(size, dtype=dtype)
        return held[:size].reshape(shape)

    @property
    def page_bytes(self) -> int:
        return int(self.views[0][0].size if self.device.type == "cpu" else self.views[0][0].numel()) * 8

    def _keys(self, tag: str, positions: list[int], dims: int) -> Any:
        keys = _keys(tag, tuple(positions), self.shard)
        if self.device.type == "cpu":
            return np.array(keys, dtype=np.int64).reshape(-1, *([1] * dims))
        return torch.tensor(keys, dtype=torch.int64, device=self.device).reshape(-1, *([1] * dims))

    def _index(self, blocks: list[int]) -> Any:
        return np.array(blocks) if self.device.type == "cpu" else torch.tensor(blocks, device=self.device)

    def _expected(self, layer: int, tag: str, positions: list[int]) -> Any:
        """Pages in logical order: [position, kernel block, H, n, words]."""
        return self.base[layer][None] ^ self._keys(tag, positions, self.base[layer].ndim)

    def write(self, layer: int, tag: str, position: int, block: int, first: int, stop: int) -> None:
        """Write tokens ``[first, stop)`` of block position `position` into block `block`."""
        page = self._expected(layer, tag, [position])[0]
        view, rows = self.views[layer][block], self.kernel_rows
        for kernel in range(first // rows, (stop - 1) // rows + 1):
            low, high = max(first - kernel * rows, 0), min(stop - kernel * rows, rows)
            view[kernel, :, low:high, :] = page[kernel, :, low:high, :]

    def write_blocks(self, layer: int, tag: str, positions: list[int], blocks: list[int]) -> None:
        """Whole pages, many at once."""
        index = self._index(blocks)
        rows, flat = self.rows[layer], self.flat_base[layer]
        if rows is not None and self.device.type == "cpu":  # fresh 4 MiB arrays cost more in page faults
            pages = self._scratch(np.int64, (len(blocks), flat.shape[0]))
            np.bitwise_xor(flat[None], self._keys(tag, positions, 1), out=pages)
            rows[index] = pages
        elif rows is not None:
            rows[index] = flat[None] ^ self._keys(tag, positions, 1)
        else:
            self.views[layer][index] = self._expected(layer, tag, positions)

    def count_bad(self, tag: str, positions: list[int], blocks: list[int], tokens: int) -> int:
        """Pages (block x layer) that differ from the pattern in any of the first `tokens`."""
        size = self.block_size
        whole = [i for i, p in enumerate(positions) if (p + 1) * size <= tokens]
        part = [i for i, p in enumerate(positions) if p * size < tokens < (p + 1) * size]
        bad = 0
        for layer in range(len(self.views)):
            if whole:
                bad += self._bad_pages(layer, tag, [positions[i] for i in whole], [blocks[i] for i in whole], None)
            if part:
                bad += self._bad_pages(layer, tag, [positions[i] for i in part], [blocks[i] for i in part], tokens)
        return bad

    def _bad_pages(self, layer: int, tag: str, positions: list[int], blocks: list[int], tokens: int | None) -> int:
        index = self._index(blocks)
        rows, flat = self.rows[layer], self.flat_base[layer]
        if tokens is None and rows is not None and self.device.type == "cpu":
            got = self._scratch(np.int64, (len(blocks), flat.shape[0]))
            np.take(rows, index, axis=0, out=got)
            np.bitwise_xor(got, self._keys(tag, positions, 1), out=got)
            return int(np.not_equal(got, flat[None], out=self._scratch(np.bool_, got.shape)).any(1).sum())
        if tokens is None and rows is not None:
            return int((rows[index] != flat[None] ^ self._keys(tag, positions, 1)).any(1).sum())
        differs = self.views[layer][index] != self._expected(layer, tag, positions)
        if tokens is not None:
            token = np.arange(self.kernel_blocks * self.kernel_rows).reshape(self.kernel_blocks, 1, self.kernel_rows, 1)
            first = np.array(positions).reshape(-1, 1, 1, 1, 1) * self.block_size
            valid = first + token[None] < tokens
            differs &= valid if self.device.type == "cpu" else torch.from_numpy(valid).to(self.device)
        return int(differs.reshape(len(blocks), -1).any(1).sum())
