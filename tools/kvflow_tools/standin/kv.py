"""The stand-in's KV bytes and device: a pattern written through vLLM's views, and a GPU that lags.

Why: a connector test must fail when a page is stale, torn, misplaced, or read before the device
wrote it.  `PagedKV` writes and checks a pattern unique to (transfer, token, layer, model
KV head) token by token through vLLM's own per-layer views, whatever their layout.
`LaggingDevice` runs the kernels a forward enqueues later, on its own thread, and is what
kvflow's device seam sees in place of CUDA: a WRITE that does not wait for its gate moves bytes
the device has not written yet, and a model-runner hook that waits for the device raises.
"""

from __future__ import annotations

import functools
import hashlib
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvflow_tools.standin.build import MambaShape

__all__ = ("LaggingDevice", "PagedKV", "StatePages")


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


GRANULE = 16  # tokens per pattern key: every block size the stand-in runs is a multiple (vLLM's are)


@functools.lru_cache(maxsize=64)
def _keys(tag: str, chunks: tuple[int, ...], heads: tuple[int, ...], salt: int) -> list[list[int]]:
    """A 64-bit key per (token chunk, KV head) of a transfer's pages."""
    keys = []
    for chunk in chunks:
        digests = [hashlib.blake2b(f"{tag}/{chunk}/{head}/{salt}".encode(), digest_size=8).digest() for head in heads]
        keys.append([int.from_bytes(d, "little", signed=True) for d in digests])
    return keys


class PagedKV:
    """One rank's KV pages, seen through vLLM's per-layer views, by token and KV head.

    A value's expected content is a fixed random vector per (layer, model KV head, token modulo
    `GRANULE`) XORed with a 64-bit key of (transfer tag, token // `GRANULE`, model KV head): a
    zeroed, stale, misplaced, torn or head-swapped page cannot match.  The pattern is defined
    per model head and token, not per page, so ranks that hold other heads (tensor parallelism
    of another size) or use another block size (a multiple of `GRANULE`) agree on every head's
    KV.  Pages move as 64-bit words, vectorised over blocks, through torch's strided views (on
    the views' device)."""

    def __init__(
        self,
        views: list[torch.Tensor],
        num_blocks: int,
        block_size: int,
        heads: range | None = None,
        *,
        total_heads: int = 0,
        shard: int = 0,
    ) -> None:
        """`heads`: the model's KV heads this rank holds (default: as many as the views have,
        from 0), of `total_heads` (default: the end of `heads`); `shard` salts the keys (two
        shards' pages never match)."""
        if block_size % GRANULE:
            raise ValueError(f"the stand-in's pattern needs block sizes that are multiples of {GRANULE}")
        self.block_size = block_size
        self.device = views[0].device
        self.views: list[Any] = []  # [block, kernel block, H, n, words]
        self.base: list[Any] = []  # [kernel block, H, n, words]
        for layer, view in enumerate(views):
            as_bytes = view.view(torch.uint8)  # [kernel block, H, n, bytes]
            if as_bytes.shape[-1] % 8:
                raise ValueError("the stand-in's pattern needs page rows of whole 64-bit words")
            words = as_bytes.view(torch.int64)
            pages = words.view(num_blocks, -1, *words.shape[1:])
            kernel_blocks, n_heads, rows, width = (int(n) for n in pages.shape[1:])
            if heads is None:
                heads = range(n_heads)
            if len(heads) != n_heads:
                raise ValueError(f"the views hold {n_heads} KV heads, not the {len(heads)} of {heads}")
            total = max(total_heads, heads.stop)
            generator = torch.Generator().manual_seed(1234 + layer)
            every = torch.randint(-(2**62), 2**62, (total, GRANULE, width), generator=generator, dtype=torch.int64)
            token = torch.arange(kernel_blocks * rows) % GRANULE
            base = every[heads.start : heads.stop][:, token, :].reshape(n_heads, kernel_blocks, rows, width)
            self.views.append(pages)
            self.base.append(base.permute(1, 0, 2, 3).contiguous().to(self.device))
        assert heads is not None
        self.heads, self.shard = heads, shard
        self.kernel_blocks, self.kernel_rows = int(self.views[0].shape[1]), int(self.views[0].shape[3])
        # each token's chunk within its block: [kernel block, n]
        self._chunk = (torch.arange(self.kernel_blocks * self.kernel_rows) // GRANULE).reshape(
            self.kernel_blocks, self.kernel_rows
        )

    @property
    def page_bytes(self) -> int:
        return int(self.views[0][0].numel()) * 8

    def _expected(self, layer: int, tag: str, positions: list[int]) -> Any:
        """Pages in logical order: [position, kernel block, H, n, words]."""
        per_block = self.block_size // GRANULE
        chunks = tuple(p * per_block + j for p in positions for j in range(per_block))
        keys = torch.tensor(_keys(tag, chunks, tuple(self.heads), self.shard), dtype=torch.int64)
        keys = keys.reshape(len(positions), per_block, len(self.heads))[:, self._chunk, :]  # [P, kb, n, H]
        keys = keys.permute(0, 1, 3, 2)[..., None].to(self.device)
        return self.base[layer][None] ^ keys

    def write(self, layer: int, tag: str, position: int, block: int, first: int, stop: int) -> None:
        """Write tokens ``[first, stop)`` of block position `position` into block `block`."""
        page = self._expected(layer, tag, [position])[0]
        view, rows = self.views[layer][block], self.kernel_rows
        for kernel in range(first // rows, (stop - 1) // rows + 1):
            low, high = max(first - kernel * rows, 0), min(stop - kernel * rows, rows)
            view[kernel, :, low:high, :] = page[kernel, :, low:high, :]

    def kernel(self, layer: int, writes: list[tuple[str, int, int, int, int]]) -> Callable[[], None]:
        """What a forward's attention layer writes: each (tag, position, block, first token,
        stop token), whole pages of one tag together."""
        size = self.block_size

        def run() -> None:
            whole: dict[str, tuple[list[int], list[int]]] = {}
            for tag, position, block, first, stop in writes:
                if first == 0 and stop == size:
                    positions, blocks = whole.setdefault(tag, ([], []))
                    positions.append(position)
                    blocks.append(block)
                else:
                    self.write(layer, tag, position, block, first, stop)
            for tag, (positions, blocks) in whole.items():
                self.write_blocks(layer, tag, positions, blocks)

        return run

    def write_blocks(self, layer: int, tag: str, positions: list[int], blocks: list[int]) -> None:
        """Whole pages, many at once."""
        index = torch.tensor(blocks, device=self.device)
        self.views[layer][index] = self._expected(layer, tag, positions)

    def count_bad(
        self, tag: str, positions: list[int], blocks: list[int], tokens: int, layers: list[int] | None = None
    ) -> int:
        """Pages (block x layer, of `layers`: default every layer) that differ from the pattern
        in any of the first `tokens`."""
        size = self.block_size
        whole = [i for i, p in enumerate(positions) if (p + 1) * size <= tokens]
        part = [i for i, p in enumerate(positions) if p * size < tokens < (p + 1) * size]
        bad = 0
        for layer in range(len(self.views)) if layers is None else layers:
            if whole:
                bad += self._bad_pages(layer, tag, [positions[i] for i in whole], [blocks[i] for i in whole], None)
            if part:
                bad += self._bad_pages(layer, tag, [positions[i] for i in part], [blocks[i] for i in part], tokens)
        return bad

    def _bad_pages(self, layer: int, tag: str, positions: list[int], blocks: list[int], tokens: int | None) -> int:
        index = torch.tensor(blocks, device=self.device)
        differs = self.views[layer][index] != self._expected(layer, tag, positions)
        if tokens is not None:
            token = torch.arange(self.kernel_blocks * self.kernel_rows).reshape(
                self.kernel_blocks, 1, self.kernel_rows, 1
            )
            first = torch.tensor(positions).reshape(-1, 1, 1, 1, 1) * self.block_size
            differs &= (first + token[None] < tokens).to(self.device)
        return int(differs.reshape(len(blocks), -1).any(1).sum())


class StatePages:
    """One rank's Mamba state pages, seen through vLLM's per-layer views (``[blocks, 1, 1,
    state bytes]`` int8): P writes a pattern of (transfer tag, tokens computed, layer) into a
    request's running-state block after each step, D checks its own before its first step.  The
    pattern is drawn for the whole state (all ranks' together: each conv sub-projection's
    columns, then the temporal state) and each rank holds its shard of it, laid out as its conv
    state is, so a D rank of another tensor parallelism than P's finds exactly its shard.  A
    state from another request, from an earlier chunk (a stale state), from the prompt's last
    token (which D must compute itself), or another rank's shard cannot match."""

    def __init__(
        self, views: list[torch.Tensor], num_blocks: int, shape: MambaShape, *, shard: int, ranks: int
    ) -> None:
        """`shape`: the mixer's state on one rank (`build.mamba_shape`); `shard`: this rank, of `ranks`."""
        self.pages = [view.view(torch.uint8).reshape(num_blocks, -1) for view in views]
        element = shape.element_size
        self.part_bytes = tuple(columns * element for columns in shape.columns)  # one conv row of each
        self.rows, self.temporal_bytes = shape.rows, element * math.prod(shape.temporal)
        self.dim_first, self.shard, self.ranks = shape.dim_first, shard, ranks
        self.size = self.rows * sum(self.part_bytes) + self.temporal_bytes  # the state; padding after it

    def _expected(self, layer: int, tag: str, tokens: int) -> torch.Tensor:
        seed = int.from_bytes(hashlib.blake2b(f"{tag}/{tokens}/{layer}".encode(), digest_size=8).digest())
        generator = torch.Generator().manual_seed(seed & ((1 << 63) - 1))

        def drawn(*shape: int) -> torch.Tensor:
            return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)

        whole = [drawn(part * self.ranks, self.rows) for part in self.part_bytes]  # (columns, rows) each
        temporal = drawn(self.temporal_bytes * self.ranks)
        mine = torch.cat(
            [p[self.shard * n : (self.shard + 1) * n] for p, n in zip(whole, self.part_bytes, strict=True)]
        )
        conv = mine if self.dim_first else mine.T.contiguous()
        own = temporal[self.shard * self.temporal_bytes : (self.shard + 1) * self.temporal_bytes]
        return torch.cat([conv.reshape(-1), own]).to(self.pages[layer].device)

    def write(self, layer: int, tag: str, tokens: int, block: int) -> None:
        """The state of layer `layer` after `tokens` tokens of the request `tag`, into `block`."""
        self.pages[layer][block, : self.size] = self._expected(layer, tag, tokens)

    def kernel(self, layer: int, writes: list[tuple[str, int, int, int, int]]) -> Callable[[], None]:
        """What a forward's Mamba layer writes: each (tag, -, state block, -, tokens computed)."""

        def run() -> None:
            for tag, _, block, _, tokens in writes:
                self.write(layer, tag, tokens, block)

        return run

    def count_bad(self, tag: str, tokens: int, block: int, layers: list[int]) -> int:
        """Layers of `layers` whose state in `block` is not the one after `tokens` tokens."""
        return sum(
            int(not torch.equal(self.pages[layer][block, : self.size], self._expected(layer, tag, tokens)))
            for layer in layers
        )
