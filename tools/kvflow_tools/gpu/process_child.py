"""P of the GPU check's phase G: its engine in an engine process, over the KV memory this process owns.

Why: a vLLM worker keeps its KV caches and runs kvflow's engine in a process of its own
(`kvflow.runtime.process.EngineProcess`), which must reach those caches: on a GPU through legacy
CUDA IPC handles (`kvflow.runtime.cuda_ipc`, one per allocation, opened by the engine process),
in the CPU dry run through host memory shared in place.  This child owns the caches (and fills
them with the pattern, as a forward would), and the engine process WRITEs from them: D's digest
must equal the owner's.  It answers the parent as `EngineChild` does, the commands it needs.  With ``--exported``
(phase V) its caches are driver-mapped chunks that reach the engine process as file descriptors
(`kvflow.runtime.cuda_vmm`), remapped once as sleep mode does (``remap``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any, TextIO

import kvflow
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.requests import KvReady
from kvflow.runtime import host_memory
from kvflow.runtime.cuda_ipc import CudaDriver, plan_shares
from kvflow.runtime.cuda_vmm import Chunk, VmmDriver, chunks_to_wire
from kvflow.runtime.process import EngineProcess, ProcessSpec
from kvflow_tools.gpu.engine_child import EngineChild, answer
from kvflow_tools.gpu.plan import TRANSFER_S

__all__ = ("ProcessEngineChild", "serve_owner")


class ProcessEngineChild(EngineChild):
    """The owner of P's caches, its engine in an engine process."""

    def __init__(self, args: argparse.Namespace, events: TextIO) -> None:
        """:raises kvflow.KVFlowError: the memory cannot be shared or the engine process not started.
        :raises RuntimeError: CUDA cannot be used (torch's)."""
        super().__init__(args, events, engine=False)
        layout = kvflow.KVLayout.per_layer_regions(self.spec, self.nb, self.regions)
        shares, spans, chunks = [], [], []
        if self.chunks:  # driver-mapped: each chunk exported as a file descriptor
            chunks = self._export()
        elif self.cuda:
            driver = CudaDriver()
            shares = driver.export(plan_shares(self.regions, driver.allocation_of))
        else:
            spans = host_memory.share_in_place(self.regions)
        spec = ProcessSpec(
            args.name,
            layout,
            transport_options={"cuda": self.cuda},
            config=kvflow.EngineConfig(transfer_timeout=TRANSFER_S, drain_timeout=2.0),
        )
        try:
            self.process = EngineProcess(spec, spans, cuda_shares=shares, cuda_chunks=chunks)
        finally:
            for fd in [span.fd for span in spans] + [chunk.fd for chunk in chunks]:
                os.close(fd)
        self.shares = len(shares) or len(spans) or len(chunks)

    def _export(self) -> list[Chunk]:
        """Each physical chunk holding the caches, exported as a file descriptor (the caller closes them).
        :raises kvflow.KVFlowError: the driver refused."""
        driver = VmmDriver()
        return [
            driver.export_fd(Chunk(s.device, s.base, s.length)) for s in plan_shares(self.regions, driver.allocation_of)
        ]

    async def cmd_remap(self, cmd: dict[str, Any]) -> None:
        """Sleep mode, as vLLM 0.34 does it to an exportable cache: the engine process lets go of
        the memory, each chunk is freed and a new one mapped at the same addresses, exported
        again and handed over on the socket; the engine process maps them and registers again."""
        t0 = time.monotonic()
        await self._settled(self.process.call("unregister_memory"))
        for memory in self.chunks:
            memory.release()
        for memory in self.chunks:
            memory.commit()
        exported = self._export()
        try:
            self.process.send_fds([chunk.fd for chunk in exported])
        finally:
            for chunk in exported:
                os.close(chunk.fd)
        await self._settled(self.process.call("restore_memory", chunks_to_wire(exported)))
        self.emit("remapped", id=cmd["id"], chunks=len(exported), ms=round((time.monotonic() - t0) * 1e3, 2))

    async def cmd_connect(self, cmd: dict[str, Any]) -> None:
        await self._settled(self.process.call("connect", cmd["peer"], cmd["address"]))
        self.emit("connected", id=cmd["id"])

    async def cmd_send(self, cmd: dict[str, Any]) -> None:
        """kv_ready in the engine process; the outcome is the release of P's blocks."""
        t0 = time.monotonic()
        key, mode = TransferKey(cmd["tid"], 1), kvflow.Mode(cmd["mode"])
        await self._settled(self.process.submit(KvReady(key, cmd["blocks"], mode=mode, peer=cmd["peer"])))
        deadline = time.monotonic() + TRANSFER_S + 5
        while time.monotonic() < deadline:
            released = [r for r in self.process.poll_released() if r.key == key]
            if released:
                outcome = released[0].outcome.value
                break
            await asyncio.sleep(0.001)
        else:
            outcome = "no release"
        t1 = time.monotonic()
        self.emit("sent", id=cmd["id"], t0=t0, t_p_done=t1, outcome=outcome, reason=outcome)

    async def _settled(self, future: Any) -> Any:
        """The call's answer (the engine process answers through `pump`).
        :raises kvflow.KVFlowError: what the call raised."""
        deadline = time.monotonic() + TRANSFER_S
        while not future.done() and time.monotonic() < deadline:
            self.process.pump()
            await asyncio.sleep(0.001)
        return future.result(timeout=0)

    def close(self) -> None:
        self.process.close(timeout=10.0)


async def serve_owner(args: argparse.Namespace, events: TextIO) -> None:
    """`engine_child.serve` for P with its engine in an engine process: "ready" carries the
    engine process's address and pid, and how many shares carried its memory.

    :raises kvflow.KVFlowError: the memory cannot be shared or the engine process not started.
    :raises OSError: the parent is gone.
    """
    owner = ProcessEngineChild(args, events)
    try:
        owner.emit(
            "ready",
            address=owner.process.address,
            pid=owner.process.pid,
            memory_types=[],
            regions=[r.memory.value for r in owner.regions],
            shared=owner.shares,
        )
        await answer(owner)
    finally:
        owner.close()
    owner.emit("closed", stats={})
