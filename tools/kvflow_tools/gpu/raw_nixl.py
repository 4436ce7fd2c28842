"""The GPU check's baseline: the same WRITE as kvflow's, made with a bare NIXL agent in each child.

Why: kvflow's bandwidth means something only beside what NIXL itself does on the same memory,
between the same two processes, with the same descriptors (one per layer's K and V run of
contiguous blocks) and a notification to D, as kvflow sends.  P posts the WRITE and polls its
state until done; D polls its notifications; both times are CLOCK_MONOTONIC, comparable on one
host.  Nothing of kvflow's engine, control plane or planning is on this path.
"""

from __future__ import annotations

import time
from typing import Any

from kvflow.transports.nixl import load_nixl
from kvflow_tools.errors import GpuChildFailed

__all__ = ("RawNixl",)


class RawNixl:
    """A bare NIXL agent (UCX) with a child's caches registered: `layers` are (address, bytes)
    of each layer's K-then-V array, `blocks` blocks of `block_bytes` in each half."""

    def __init__(self, name: str, layers: list[tuple[int, int]], blocks: int, block_bytes: int, cuda: bool) -> None:
        """:raises TransportUnavailable: no NIXL.  :raises Exception: NIXL's own, as it raises them."""
        self.api = load_nixl(cuda=cuda)
        self.memory = "VRAM" if cuda else "DRAM"
        self.agent = self.api.nixl_agent(name, self.api.nixl_agent_config(enable_prog_thread=False))
        self.layers, self.blocks, self.block_bytes = layers, blocks, block_bytes
        self.registered = self.agent.register_memory([(addr, size, 0, "") for addr, size in layers], self.memory)
        self.peer = ""
        self.peer_layers: list[tuple[int, int]] = []

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_peer(self, metadata: bytes, layers: list[tuple[int, int]]) -> None:
        name = self.agent.add_remote_agent(metadata)
        self.peer = name.decode() if isinstance(name, bytes) else str(name)
        self.peer_layers = layers

    def _runs(self, layers: list[tuple[int, int]], count: int) -> list[tuple[int, int, int]]:
        """Blocks [0, count) of every layer's K and of its V: one descriptor each."""
        half = self.blocks * self.block_bytes
        return [(addr + kv * half, count * self.block_bytes, 0) for addr, _ in layers for kv in (0, 1)]

    def write(self, count: int, tag: bytes, timeout: float) -> tuple[float, float]:
        """WRITE blocks [0, count) of every layer into the peer's, with notification `tag`; (posted,
        done) on P's clock.  :raises GpuChildFailed: it failed or did not finish within `timeout`."""
        local = self.agent.get_xfer_descs(self._runs(self.layers, count), self.memory)
        remote = self.agent.get_xfer_descs(self._runs(self.peer_layers, count), self.memory)
        handle = self.agent.initialize_xfer("WRITE", local, remote, self.peer, tag)
        try:
            t0 = time.monotonic()
            state = self.agent.transfer(handle)
            while state == "PROC" and time.monotonic() - t0 < timeout:
                state = self.agent.check_xfer_state(handle)
            t1 = time.monotonic()
        finally:
            self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise GpuChildFailed(f"raw NIXL WRITE ended in {state}")
        return t0, t1

    def notified(self, tag: bytes, timeout: float) -> float:
        """When notification `tag` arrived (polled).  :raises GpuChildFailed: not within `timeout`."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            notes: dict[str, Any] = self.agent.get_new_notifs()
            if any(tag == bytes(note) for batch in notes.values() for note in batch):
                return time.monotonic()
        raise GpuChildFailed(f"no raw NIXL notification {tag!r} within {timeout}s")

    def close(self) -> None:
        """Deregister and forget the peer (best effort).  Never raises but NIXL's own."""
        if self.peer:
            self.agent.remove_remote_agent(self.peer)
        self.agent.deregister_memory(self.registered)
