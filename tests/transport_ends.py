"""Two endpoints of one transport kind, connected both ways over registered host memory, for the
transport tests.

Helpers, no tests: `make_ends` builds them (loopback, shared memory, NIXL direct or prepped),
`wait` polls an endpoint for completions and notifications within a deadline, `whole` is a plan
that moves one region's first `size` bytes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow.layout import DescriptorPlan, KVLayout, KVSpec
from kvflow.layout.buffers import region_of
from kvflow.transports.base import Completion
from kvflow.transports.loopback import LoopbackFabric
from kvflow.transports.nixl import NixlTransport
from kvflow.transports.shm import ShmTransport

SPEC = KVSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")  # 128-byte blocks
BLOCKS = 64


@dataclass
class Ends:
    a: Any
    b: Any
    a_mem: list[np.ndarray]
    b_mem: list[np.ndarray]
    a_layout: KVLayout
    b_layout: KVLayout
    closers: list[Callable[[], None]]


def _buffers(alloc: Callable[[int], np.ndarray]) -> tuple[list[np.ndarray], KVLayout]:
    mem = [alloc(2 * BLOCKS * SPEC.block_len) for _ in range(SPEC.num_layers)]
    return mem, KVLayout.per_layer_regions(SPEC, BLOCKS, [region_of(m) for m in mem])


def make_ends(kind: str) -> Ends:
    tag = f"{kind}{time.monotonic_ns()}"
    a: Any
    b: Any
    closers: list[Callable[[], None]] = []
    alloc_a: Callable[[int], np.ndarray] = lambda n: np.zeros(n, np.uint8)  # noqa: E731
    alloc_b = alloc_a
    if kind == "loopback":
        fabric = LoopbackFabric()
        a, b = fabric.endpoint(f"a{tag}"), fabric.endpoint(f"b{tag}")
        closers.append(fabric.close)
    elif kind == "shm":
        a, b = ShmTransport(f"a{tag}"), ShmTransport(f"b{tag}")
        alloc_a, alloc_b = a.allocate, b.allocate
    else:
        mode = kind.split("-")[1]
        a = NixlTransport(f"a{tag}", mode=mode, granule=SPEC.block_len)
        b = NixlTransport(f"b{tag}", mode=mode, granule=SPEC.block_len)
    a_mem, a_layout = _buffers(alloc_a)
    b_mem, b_layout = _buffers(alloc_b)
    a.register_regions(a_layout.regions)
    b.register_regions(b_layout.regions)
    a.add_peer(b.name, b.local_metadata(), b_layout.regions)
    b.add_peer(a.name, a.local_metadata(), a_layout.regions)
    return Ends(a, b, a_mem, b_mem, a_layout, b_layout, [a.close, b.close, *closers])


def wait(
    endpoint: Any, completions: int = 1, notes: int = 0, timeout: float = 10.0
) -> tuple[list[Completion], list[bytes]]:
    got_c: list[Completion] = []
    got_n: list[bytes] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end and (len(got_c) < completions or len(got_n) < notes):
        c, n = endpoint.poll()
        got_c += c
        got_n += [x.payload for x in n]
        time.sleep(0.0002)
    return got_c, got_n


def whole(size: int) -> DescriptorPlan:
    def col(v: int) -> np.ndarray:
        return np.array([v], dtype=np.int64)

    return DescriptorPlan(col(0), col(0), col(0), col(0), col(size), 1)
