"""`kvflow bench nixl`: bandwidth and latency of NIXL WRITEs: raw agent, kvflow, memcpy.

Why a benchmark and not a test: timings depend on the machine; they are measured and printed
(a table, and JSON with every sample's statistics), never asserted.  All three columns run in
the same process, on the same pre-faulted buffers, in the same run:

* single WRITEs of 4 KiB .. 256 MiB: numpy memcpy, a raw `nixl_agent` pair (a new handle per op,
  and the same handle re-posted), and kvflow's `NixlTransport` (submit, then poll);
* 1024 blocks of 16 KiB, contiguous, mostly contiguous (runs of 32) and scattered: kvflow with
  its coalesced plan, kvflow with one descriptor per block, kvflow with prepared lists, raw NIXL
  with prepared per-block lists (vLLM's pattern), and numpy block copies.

Both sides live in this process (UCX then moves bytes with CMA, as across processes of one host).
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.layout import DescriptorPlan, KVLayout, KVSpec, plan_transfer
from kvflow.layout.buffers import region_of
from kvflow.protocol.actions import OpKind
from kvflow.runtime.meter import quantile
from kvflow.transports.nixl import NixlTransport, load_nixl
from kvflow_tools.errors import BenchError

__all__ = ("Row", "main", "run")

KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 64 * KIB, MIB, 16 * MIB, 256 * MIB]
BLOCK = 16 * KIB
NBLOCKS = 1024


@dataclass
class Row:
    case: str
    variant: str
    bytes: int
    median_us: float
    p90_us: float
    gbps: float
    descriptors: int = 1


def _time_all(ops: dict[str, Callable[[], Any]], repeats: int) -> dict[str, tuple[float, float]]:
    """(median, p90) microseconds per variant; variants take turns sample by sample, so that
    drift on a shared machine (other processes, frequency changes) falls on all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in ops}
    for op in ops.values():
        op()  # warm up (UCX wireup, first page touches)
    for _ in range(repeats):
        for name, op in ops.items():
            started = time.perf_counter()
            op()
            samples[name].append((time.perf_counter() - started) * 1e6)
    out = {}
    for name, values in samples.items():
        out[name] = (quantile(values, 0.5), quantile(values, 0.9))
    return out


def _row(case: str, variant: str, nbytes: int, timing: tuple[float, float], descriptors: int = 1) -> Row:
    median, p90 = timing
    return Row(case, variant, nbytes, round(median, 2), round(p90, 2), round(nbytes / median / 1e3, 3), descriptors)


class _Raw:
    """A pair of bare NIXL agents, polled the way kvflow's agent thread polls."""

    def __init__(self, api: Any, src: np.ndarray, dst: np.ndarray) -> None:
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        tag = f"{os.getpid()}-{time.monotonic_ns()}"
        self.a, self.b = api.nixl_agent(f"raw-a-{tag}", config), api.nixl_agent(f"raw-b-{tag}", config)
        self.src, self.dst = src, dst
        self.regs = [
            self.a.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM"),
            self.b.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM"),
        ]
        self.a.add_remote_agent(self.b.get_agent_metadata())
        self.b.add_remote_agent(self.a.get_agent_metadata())

    def wait(self, handle: Any) -> None:
        state = self.a.transfer(handle)
        while state == "PROC":
            state = self.a.check_xfer_state(handle)
            self.b.get_new_notifs()  # the passive side must make progress too (UCX wireup)
        if state != "DONE":
            raise BenchError(f"raw NIXL transfer ended in {state}")

    def write_new_handle(self, nbytes: int) -> None:
        local = self.a.get_xfer_descs([(self.src.ctypes.data, nbytes, 0)], "DRAM")
        remote = self.a.get_xfer_descs([(self.dst.ctypes.data, nbytes, 0)], "DRAM")
        handle = self.a.initialize_xfer("WRITE", local, remote, self.b.name)
        self.wait(handle)
        handle.release()

    def prepared(self, nblocks: int) -> tuple[Any, Any]:
        rows_a = np.array([[self.src.ctypes.data + i * BLOCK, BLOCK, 0] for i in range(nblocks)], dtype=np.uint64)
        rows_b = np.array([[self.dst.ctypes.data + i * BLOCK, BLOCK, 0] for i in range(nblocks)], dtype=np.uint64)
        return self.a.prep_xfer_dlist("NIXL_INIT_AGENT", rows_a, "DRAM"), self.a.prep_xfer_dlist(
            self.b.name, rows_b, "DRAM"
        )

    def close(self) -> None:
        self.a.remove_remote_agent(self.b.name)
        self.b.remove_remote_agent(self.a.name)
        self.a.deregister_memory(self.regs[0])
        self.b.deregister_memory(self.regs[1])


class _Kvflow:
    """Two kvflow NIXL transports; `write` submits one op and polls until it completes."""

    def __init__(self, mode: str, layout_a: KVLayout, layout_b: KVLayout) -> None:
        tag = f"{os.getpid()}-{time.monotonic_ns()}"
        self.a = NixlTransport(f"kv-a-{mode}-{tag}", mode=mode, granule=BLOCK)
        self.b = NixlTransport(f"kv-b-{mode}-{tag}", mode=mode, granule=BLOCK)
        self.a.register_regions(layout_a.regions)
        self.b.register_regions(layout_b.regions)
        self.a.add_peer(self.b.name, self.b.local_metadata(), layout_b.regions)
        self.b.add_peer(self.a.name, self.a.local_metadata(), layout_a.regions)
        self.ids = itertools.count(1)
        self.ready = threading.Event()
        self.a.set_listener(self.ready.set)  # woken like the engine is, not by spinning on poll()

    def write(self, plan: DescriptorPlan) -> None:
        op_id = next(self.ids)
        self.ready.clear()
        self.a.submit(op_id, OpKind.WRITE, self.b.name, plan, b"")
        while True:
            if not self.ready.wait(10):
                raise BenchError("kvflow op did not complete within 10 s")
            self.ready.clear()
            completions, _ = self.a.poll()
            if completions:
                if completions[0].error is not None or completions[0].op_id != op_id:
                    raise BenchError(f"kvflow op failed: {completions[0]}")
                return

    def close(self) -> None:
        self.a.close()
        self.b.close()


def _single(nbytes: int) -> DescriptorPlan:
    zero, size = np.zeros(1, dtype=np.int64), np.array([nbytes], dtype=np.int64)
    return DescriptorPlan(zero, zero, zero, zero, size, 1)


def _patterns(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    src = np.arange(NBLOCKS)
    runs = np.arange(NBLOCKS) + np.arange(NBLOCKS) // 32  # a one-block gap after every 32 blocks
    return {
        "contiguous": (src, src + NBLOCKS),
        "mostly contiguous": (src, runs + NBLOCKS),
        "scattered": (rng.permutation(4 * NBLOCKS)[:NBLOCKS], rng.permutation(4 * NBLOCKS)[:NBLOCKS]),
    }


def run(quick: bool = False, repeats: int | None = None) -> list[Row]:
    """Measure everything; returns the rows (also what `main` prints).

    :raises TransportUnavailable: NIXL is not installed.
    :raises BenchError: a transfer failed or did not complete within 10 s.
    :raises TransportError: kvflow's NIXL transport refused to set up or to post an op.
        (The raw agent pair is the baseline measured, used as NIXL ships it: its own
        exceptions are not mapped.)
    """
    api = load_nixl()
    largest = SIZES[-2] if quick else SIZES[-1]
    span = max(largest, 4 * NBLOCKS * BLOCK)  # the block patterns pick among 4096 blocks
    src = np.random.default_rng(1).integers(0, 256, span, dtype=np.uint8)
    dst = np.zeros(span, dtype=np.uint8)
    dst.fill(1)  # fault every page in before timing
    spec = KVSpec(num_layers=1, block_size=8, num_kv_heads=8, head_dim=64, dtype="float16", arrays_per_layer=1)
    assert spec.block_len == BLOCK
    layout_a = KVLayout.single_region(spec, span // BLOCK, region_of(src))
    layout_b = KVLayout.single_region(spec, span // BLOCK, region_of(dst))
    raw = _Raw(api, src, dst)
    direct, prepped = _Kvflow("direct", layout_a, layout_b), _Kvflow("prepped", layout_a, layout_b)
    rows: list[Row] = []
    try:
        for nbytes in [s for s in SIZES if s <= largest]:
            n = repeats or max(20, min(300, (256 * MIB) // nbytes))
            case = f"single {nbytes // KIB} KiB" if nbytes < MIB else f"single {nbytes // MIB} MiB"
            local = raw.a.get_xfer_descs([(src.ctypes.data, nbytes, 0)], "DRAM")
            remote = raw.a.get_xfer_descs([(dst.ctypes.data, nbytes, 0)], "DRAM")
            handle = raw.a.initialize_xfer("WRITE", local, remote, raw.b.name)
            timings = _time_all(
                {
                    "numpy memcpy": partial(np.copyto, dst[:nbytes], src[:nbytes]),
                    "raw NIXL, new handle": partial(raw.write_new_handle, nbytes),
                    "raw NIXL, reposted handle": partial(raw.wait, handle),
                    "kvflow NIXL": partial(direct.write, _single(nbytes)),
                },
                n,
            )
            handle.release()
            rows += [_row(case, variant, nbytes, timing) for variant, timing in timings.items()]
        raw_a, raw_b = raw.prepared(4 * NBLOCKS)
        src_blocks = src[: NBLOCKS * BLOCK * 4].reshape(-1, BLOCK)
        dst_blocks = dst[: NBLOCKS * BLOCK * 4].reshape(-1, BLOCK)
        for name, (s_ids, d_ids) in _patterns(np.random.default_rng(7)).items():
            case, total = f"1024 x 16 KiB, {name}", NBLOCKS * BLOCK
            coalesced = plan_transfer(layout_a, layout_b, s_ids, d_ids)
            per_block = plan_transfer(layout_a, layout_b, s_ids, d_ids, coalesce=False)
            counts = {"numpy block copies": 1, "raw NIXL, prepped per block": NBLOCKS}
            counts.update({"kvflow, coalesced": len(coalesced), "kvflow, one per block": len(per_block)})
            counts["kvflow, prepped lists"] = len(coalesced)
            timings = _time_all(
                {
                    "numpy block copies": partial(_copy, src_blocks, dst_blocks, s_ids, d_ids),
                    "raw NIXL, prepped per block": partial(_raw_prepped, raw, raw_a, raw_b, s_ids, d_ids),
                    "kvflow, coalesced": partial(direct.write, coalesced),
                    "kvflow, one per block": partial(direct.write, per_block),
                    "kvflow, prepped lists": partial(prepped.write, coalesced),
                },
                repeats or 40,
            )
            rows += [_row(case, variant, total, timing, counts[variant]) for variant, timing in timings.items()]
        raw_a.release()
        raw_b.release()
    finally:
        direct.close()
        prepped.close()
        raw.close()
    return rows


def _copy(src: np.ndarray, dst: np.ndarray, s_ids: np.ndarray, d_ids: np.ndarray) -> None:
    for s, d in zip(s_ids.tolist(), d_ids.tolist(), strict=True):
        dst[d] = src[s]


def _raw_prepped(raw: _Raw, local: Any, remote: Any, s_ids: np.ndarray, d_ids: np.ndarray) -> None:
    handle = raw.a.make_prepped_xfer("WRITE", local, s_ids.astype(np.int32), remote, d_ids.astype(np.int32))
    raw.wait(handle)
    handle.release()


def render(rows: list[Row]) -> str:
    lines = [f"{'case':<34} {'variant':<28} {'descs':>6} {'p50 µs':>10} {'p90 µs':>10} {'GB/s':>8}"]
    for r in rows:
        lines.append(
            f"{r.case:<34} {r.variant:<28} {r.descriptors:>6} {r.median_us:>10.1f} {r.p90_us:>10.1f} {r.gbps:>8.2f}"
        )
    return "\n".join(lines)


def summary(rows: list[Row]) -> list[str]:
    """The two targets: kvflow vs raw NIXL at >= 1 MiB, and coalescing vs one descriptor per block."""
    by = {(r.case, r.variant): r for r in rows}
    out = []
    for r in rows:
        if r.variant == "kvflow NIXL" and r.bytes >= MIB:
            new = by[(r.case, "raw NIXL, new handle")]
            repost = by[(r.case, "raw NIXL, reposted handle")]
            out.append(
                f"{r.case}: kvflow {r.gbps:.2f} GB/s = {100 * r.gbps / new.gbps:.0f}% of raw (new handle), "
                f"{100 * r.gbps / repost.gbps:.0f}% of raw (reposted)"
            )
        if r.variant == "kvflow, coalesced":
            per = by[(r.case, "kvflow, one per block")]
            out.append(
                f"{r.case}: coalescing {r.descriptors} descriptors vs {per.descriptors}: {r.gbps / per.gbps:.2f}x"
            )
    return out


def main(quick: bool = False, json_path: str | None = None, repeats: int | None = None) -> None:
    rows = run(quick=quick, repeats=repeats)
    print(render(rows))  # noqa: T201
    print()  # noqa: T201
    for line in summary(rows):
        print(line)  # noqa: T201
    if json_path:
        Path(json_path).write_text(json.dumps([asdict(r) for r in rows], indent=1))
        print(f"\nwrote {json_path}")  # noqa: T201
