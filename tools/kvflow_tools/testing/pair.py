"""Helpers for tests and simulations: a P/D engine pair over loopback, with real KV buffers.

Why public: embedders testing their own integration need the same thing kvflow's tests use: two
engines joined by an in-process control hub and a loopback fabric, each owning a small paged KV
cache in numpy arrays, and a way to compare D's blocks with P's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvflow.control.channel import LocalControlHub
from kvflow.layout import KVLayout, KVSpec
from kvflow.layout.buffers import region_of
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.runtime.writer import Submitter
from kvflow.transports.loopback import LoopbackFabric

__all__ = ("SMALL_SPEC", "EnginePair", "KVBuffers", "ManualClock", "same_kv")

SMALL_SPEC = KVSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="float16")  # 64-byte blocks


@dataclass
class KVBuffers:
    """A paged cache: per layer one array of shape (2, num_blocks, block_len) bytes."""

    spec: KVSpec
    num_blocks: int
    layers: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.layers:
            self.layers = [
                np.zeros((2, self.num_blocks, self.spec.block_len), np.uint8) for _ in range(self.spec.num_layers)
            ]

    @property
    def layout(self) -> KVLayout:
        return KVLayout.per_layer_regions(self.spec, self.num_blocks, [region_of(a) for a in self.layers])

    def fill(self, blocks: Sequence[int], seed: int, layers: Sequence[int] | None = None) -> None:
        """Write recognisable random bytes into these blocks (as a prefill would)."""
        rng = np.random.default_rng(seed)
        for layer in layers if layers is not None else range(self.spec.num_layers):
            for block in blocks:
                self.layers[layer][:, block] = rng.integers(0, 256, (2, self.spec.block_len), dtype=np.uint8)

    def snapshot(self, blocks: Sequence[int]) -> list[bytes]:
        return [self.layers[layer][:, block].tobytes() for layer in range(self.spec.num_layers) for block in blocks]


def same_kv(src: KVBuffers, src_blocks: Sequence[int], dst: KVBuffers, dst_blocks: Sequence[int]) -> bool:
    return all(
        np.array_equal(src.layers[layer][:, s], dst.layers[layer][:, d])
        for layer in range(src.spec.num_layers)
        for s, d in zip(src_blocks, dst_blocks, strict=True)
    )


class ManualClock:
    """A clock that moves only when told to, for engines driven deterministically."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class EnginePair:
    """A prefill engine "P" and a decode engine "D" sharing a fabric and a control hub."""

    def __init__(
        self,
        fabric: LoopbackFabric,
        *,
        spec: KVSpec = SMALL_SPEC,
        num_blocks: int = 16,
        config: EngineConfig | None = None,
        submitter: Callable[[], Submitter] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.fabric = fabric
        self.hub = LocalControlHub()
        self.p_kv = KVBuffers(spec, num_blocks)
        self.d_kv = KVBuffers(spec, num_blocks)

        def engine(name: str, kv: KVBuffers) -> Engine:
            made, peers = (submitter(), submitter()) if submitter else (None, None)
            return Engine(
                name,
                kv.layout,
                fabric.endpoint(name),
                self.hub.channel(name),
                config=config,
                submitter=made,
                peer_worker=peers,
                clock=clock,
            )

        self.p = engine("P", self.p_kv)
        self.d = engine("D", self.d_kv)

    async def start(self, connect: bool = True) -> EnginePair:
        await self.p.start()
        await self.d.start()
        if connect:
            await self.d.connect("P")
        return self

    async def close(self) -> None:
        try:
            await self.p.aclose()
        finally:
            await self.d.aclose()
            self.fabric.close()
