"""NIXL on hardware this CI machine does not have: GPUDirect (CUDA VRAM), AWS EFA, Trainium, and
kvflow's vLLM connector on GPU KV caches.

Each test runs where its hardware and what it needs (nixl, vLLM) are present and is skipped,
naming what is missing, elsewhere.  `kvflow doctor` reports what this machine offers.  The
GPUDirect test moves VRAM between two processes, as a P/D pair does: UCX does not carry peers in
one process over cuda_ipc, so a one-process test would not take the path a real pair takes.  On
a GPU machine without pytest-asyncio (the device image), run this file with ``pytest -c
/dev/null`` and PYTHONPATH naming the checkout and its tools/ (``scripts/gpu-check run`` does).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvflow.layout import KVLayout, KVSpec, MemoryType, plan_transfer
from kvflow.layout.buffers import region_of
from kvflow.protocol.actions import OpKind
from kvflow.transports.base import Completion, Notification
from kvflow.transports.nixl import NixlTransport

SPEC = KVSpec(num_layers=2, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def cuda_devices() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def need(what: str, *modules: str) -> None:
    """Skip, naming `what`, unless one of `modules` can be imported."""
    if not any(importlib.util.find_spec(name) for name in modules):
        pytest.skip(f"needs {what} ({' or '.join(modules)} is not installed)")


def need_cuda(what: str) -> None:
    if not cuda_devices():
        pytest.skip(f"needs a CUDA GPU ({what})")
    need("NIXL", "nixl", "nixl_cu13", "nixl_cu12")


def efa_devices() -> list[str]:
    root = Path("/sys/class/infiniband")
    return [p.name for p in root.iterdir() if "efa" in p.name] if root.is_dir() else []


def move_and_compare(backends: tuple[str, ...], device: str) -> None:
    import torch

    def cache() -> tuple[list[Any], KVLayout]:
        tensors = [torch.zeros((2, 32, 16, 8, 128), dtype=torch.bfloat16, device=device) for _ in range(2)]
        return tensors, KVLayout.per_layer_regions(SPEC, 32, [region_of(t) for t in tensors])

    a_kv, a_layout = cache()
    b_kv, b_layout = cache()
    for t in a_kv:
        t.copy_(torch.randn_like(t))
    a, b = NixlTransport("hw-a", backends=backends), NixlTransport("hw-b", backends=backends)
    try:
        a.register_regions(a_layout.regions)
        b.register_regions(b_layout.regions)
        a.add_peer("hw-b", b.local_metadata(), b_layout.regions)
        b.add_peer("hw-a", a.local_metadata(), a_layout.regions)
        a.submit(1, OpKind.WRITE, "hw-b", plan_transfer(a_layout, b_layout, [1, 2, 3], [4, 5, 6]), b"done")
        deadline = time.monotonic() + 10
        completions: list[Completion] = []
        notes: list[Notification] = []
        while time.monotonic() < deadline and not (completions and notes):
            c, _ = a.poll()
            _, n = b.poll()
            completions += c
            notes += n
        assert [c.error for c in completions] == [None] and [n.payload for n in notes] == [b"done"]
        for x, y in zip(a_kv, b_kv, strict=True):
            assert torch.equal(x[:, 1:4], y[:, 4:7])
    finally:
        a.close()
        b.close()


def test_gpudirect_vram_push_between_two_processes(tmp_path: Path) -> None:
    """P and D, each a kvflow engine in a process of its own with its KV caches in VRAM, push
    scattered blocks over NIXL (UCX); D's digest of what landed must equal P's and its other
    blocks stay zero (the GPU check's phase B, which also records UCX's lane)."""
    need_cuda("GPUDirect VRAM transfers")
    root = Path(__file__).resolve().parent.parent
    path = os.pathsep.join([str(root), str(root / "tools"), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-m", "kvflow_tools.gpu", "--device", "cuda", "--phases", "B", "--out", str(tmp_path)],
        env={**os.environ, "PYTHONPATH": path},
        timeout=240,
        check=False,
    )
    phase = next(p for p in json.loads((tmp_path / "results.json").read_text())["phases"] if p["phase"] == "B")
    assert done.returncode == 0 and phase["status"] == "ok", phase
    assert {kind for side in phase["memory"].values() for kind in side} == {"VRAM"}, phase["memory"]
    assert phase["transfers"] and all(t["digest_equal"] for t in phase["transfers"]), phase
    assert not any(t["d_outside_nonzero_bytes"] for t in phase["transfers"]), phase


@pytest.mark.parametrize("step", ["full CUDA graph", "speculative decoding"])
def test_two_gpu_ranks_push_byte_exact_kv_in_vram_from_vllms_hooks(step: str) -> None:
    """vLLM's KV caches allocated in VRAM on two tensor-parallel ranks, KV written by real CUDA
    kernels (the stand-in's writes run on the current stream, after the hooks return), pushed
    over NIXL (GPUDirect) once each layer group's CUDA event completes, every page checked on
    D: after a step replayed as a full CUDA graph (no save_kv_layer), and after a speculative
    step (results read before wait_for_save, the draft layer saved after them)."""
    need_cuda("two ranks' KV caches in VRAM, pushed over NIXL")
    need("vLLM", "vllm")
    from kvflow_tools.standin import ModelShape
    from tests.vllm_pairs import BLOCK_SIZE, make_pair, move_and_check

    options: dict[str, Any] = {"full_cudagraph": True} if step == "full CUDA graph" else {}
    if step == "speculative decoding":
        options["model"] = ModelShape(draft_layers=1)
    p, d = make_pair("nixl", tensor_parallel=2, kv_device="cuda", hook_order="v2", **options)
    try:
        started = time.perf_counter()
        move_and_check(p, d, "gpu", 64 * BLOCK_SIZE + 5, limit=60.0)
        print(f"{step}: 2 ranks x {64 * BLOCK_SIZE + 5} tokens in {time.perf_counter() - started:.3f}s")  # noqa: T201
    finally:
        d.close()
        p.close()


def test_efa_write_over_libfabric() -> None:
    if not efa_devices():
        pytest.skip("needs AWS EFA devices and libfabric >= 1.21 for the LIBFABRIC backend")
    need("NIXL", "nixl", "nixl_cu13", "nixl_cu12")
    move_and_compare(("LIBFABRIC",), "cuda" if cuda_devices() else "cpu")


def test_trainium_hosts_offer_device_memory_through_libfabric() -> None:
    if not list(Path("/dev").glob("neuron*")):
        pytest.skip("needs AWS Neuron (Trainium) devices; Neuron HBM registers as VRAM through LIBFABRIC")
    need("NIXL", "nixl", "nixl_cu13", "nixl_cu12")
    transport = NixlTransport("neuron-probe", backends=("LIBFABRIC",))
    try:
        # the LIBFABRIC plugin adds VRAM support when it detects the Neuron runtime
        assert MemoryType.VRAM in transport.capabilities.memory_types
    finally:
        transport.close()
