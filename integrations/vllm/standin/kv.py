"""The stand-in's KV bytes and device: a pattern written through vLLM's views, and a GPU that lags.

Why: a connector test must fail when a page is stale, torn, misplaced, or read before the device
wrote it.  `PagedKV` writes and checks a pattern unique to (transfer, block position, layer, KV
shard) token by token through vLLM's own per-layer views, whatever their layout.
`LaggingDevice` runs the kernels a forward enqueues later, on its own thread, and is what
kvflow's device seam sees in place of CUDA: a WRITE that does not wait for its gate moves bytes
the device has not written yet, and a model-runner hook that waits for the device raises.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

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


def _key(tag: str, position: int, shard: int) -> int:
    digest = hashlib.blake2b(f"{tag}/{position}/{shard}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class PagedKV:
    """One rank's KV pages, seen through vLLM's per-layer views, by token.

    A page's expected content is a fixed random page per layer XORed with a 64-bit key of
    (transfer tag, block position, KV shard): a zeroed, stale, misplaced or torn page cannot
    match.  Writes and checks are vectorised over blocks."""

    def __init__(self, views: list[torch.Tensor], num_blocks: int, block_size: int, shard: int) -> None:
        self.shard = shard
        self.block_size = block_size
        self.device = views[0].device
        self.views = []
        self.base = []
        generator = torch.Generator().manual_seed(1234)
        for view in views:
            as_bytes = view.view(torch.uint8)  # [kernel block, H, n, bytes]
            pages = as_bytes.view(num_blocks, -1, *as_bytes.shape[1:])  # [block, kernel block, H, n, bytes]
            if pages.shape[-1] % 8:
                raise ValueError("the stand-in's pattern needs page rows of whole 64-bit words")
            self.views.append(pages)
            words = (*pages.shape[1:-1], pages.shape[-1] // 8)
            base = torch.randint(-(2**62), 2**62, words, generator=generator, dtype=torch.int64)
            self.base.append(base.to(view.device))
        kernel_blocks, rows = self.views[0].shape[1], self.views[0].shape[3]
        self.rows = rows  # tokens per kernel block
        self.kernel_blocks = kernel_blocks

    @property
    def page_bytes(self) -> int:
        return int(self.views[0][0].numel())

    def _expected(self, layer: int, tag: str, positions: list[int]) -> torch.Tensor:
        keys = torch.tensor([_key(tag, p, self.shard) for p in positions], dtype=torch.int64, device=self.device)
        return self.base[layer][None] ^ keys.view(-1, *([1] * self.base[layer].dim()))

    def write(self, layer: int, tag: str, position: int, block: int, first: int, stop: int) -> None:
        """Write tokens ``[first, stop)`` of block position `position` into block `block`."""
        page = self._expected(layer, tag, [position])[0].view(torch.uint8)
        view = self.views[layer][block]
        for kernel in range(first // self.rows, (stop - 1) // self.rows + 1):
            low = max(first - kernel * self.rows, 0)
            high = min(stop - kernel * self.rows, self.rows)
            view[kernel, :, low:high, :] = page[kernel, :, low:high, :]

    def write_blocks(self, layer: int, tag: str, positions: list[int], blocks: list[int]) -> None:
        """Whole pages, many at once."""
        self.views[layer][torch.tensor(blocks, device=self.device)] = self._expected(layer, tag, positions).view(
            torch.uint8
        )

    def count_bad(self, tag: str, positions: list[int], blocks: list[int], tokens: int) -> int:
        """Pages (block x layer) that differ from the pattern in any of the first `tokens`."""
        index = torch.tensor(blocks, device=self.device)
        token = torch.arange(self.kernel_blocks * self.rows, device=self.device).view(
            self.kernel_blocks, 1, self.rows, 1
        )
        first = torch.tensor(positions, device=self.device).view(-1, 1, 1, 1, 1) * self.block_size
        valid = first + token[None] < tokens
        bad = 0
        for layer, view in enumerate(self.views):
            got = view[index].contiguous().view(torch.int64)
            differs = (got != self._expected(layer, tag, positions)) & valid
            bad += int(differs.flatten(1).any(dim=1).sum())
        return bad
