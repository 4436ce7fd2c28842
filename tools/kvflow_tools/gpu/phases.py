"""The GPU check's phases A, I, C and D, and `run_phases`, which runs the phases `plan_phases` names.

Phase B, its variants E, F, G and V, and the pair of engines (P and D) that C and D drive too are
`kvflow_tools.gpu.transfer_phases`; A (the environment), I (the integrity check), C (gating on a
CUDA event) and D (bandwidth) stay here, beside the loop that runs them under their time limits.

Why each phase is a function of a deadline that returns its result (its ``status`` first):
`run_phases` alone decides what a phase's end means for the run.  A phase that raises is an
``error``, one that waited past its deadline a ``timeout``, one cut short by a signal
``interrupted`` (and the run stops, exit 2); what the phase had put in ``run.partial`` so far is
kept in each case.  Phases are passed in as `Phase` values, so the same loop runs fake phases
in the tests.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kvflow
from kvflow_tools.errors import GpuChildFailed, GpuPhaseTimeout
from kvflow_tools.gpu.plan import BLOCKS_B, PHASE_LIMITS, READY_S, SPEC_D, block_len
from kvflow_tools.gpu.run import Proc, Run, child_argv, child_env
from kvflow_tools.gpu.transfer_phases import (
    one_transfer,
    phase_b,
    phase_e,
    phase_f,
    phase_g,
    phase_v,
    start_pair,
)

__all__ = (
    "Phase",
    "phase_a",
    "phase_c",
    "phase_d",
    "plan_phases",
    "run_phases",
)


@dataclass(frozen=True, slots=True)
class Phase:
    """One phase: its letter, what it checks, its time limit (seconds, before the run's scale),
    and its body: given its deadline (on `time.monotonic`), it returns its result."""

    key: str
    title: str
    limit_s: float
    body: Callable[[float], dict[str, Any]]


def plan_phases(run: Run, keys: str, sizes_mib: Sequence[int]) -> list[Phase]:
    """The check's phases named by `keys` (letters of `PHASE_ORDER`), in that order.  Never raises."""
    table: dict[str, tuple[str, Callable[[float], dict[str, Any]]]] = {
        "A": ("environment", lambda dl: phase_a(run, dl)),
        "B": ("two processes, NIXL, scattered blocks", lambda dl: phase_b(run, dl)),
        "E": ("phase B with UCX_PROTO_INFO=y", lambda dl: phase_e(run, dl)),
        "G": ("phase B with P's engine in an engine process over memory its owner shares", lambda dl: phase_g(run, dl)),
        "V": ("phase G over driver-mapped memory exported by descriptor, remapped once", lambda dl: phase_v(run, dl)),
        "I": ("the integrity check on the cache's memory: a flipped byte caught", lambda dl: phase_i(run, dl)),
        "C": ("gating on a CUDA event; event-wait CPU cost", lambda dl: phase_c(run, dl)),
        "D": ("bandwidth", lambda dl: phase_d(run, dl, list(sizes_mib))),
        "F": ("phase B with no thread bound to the GPU (extra)", lambda dl: phase_f(run, dl)),
    }
    return [Phase(key, table[key][0], PHASE_LIMITS[key], table[key][1]) for key in keys]


def run_phases(run: Run, phases: Sequence[Phase], limit_scale: float = 1.0) -> int:
    """Each phase in turn, under ``min(its limit x limit_scale, what is left of the budget)``
    (skipped under 5 s); results.json says ``running`` while it runs and its status once it ends.
    Returns the exit status: 0 when no phase failed, errored or timed out, 1 otherwise, and 2 at
    once when a phase was interrupted (`KeyboardInterrupt`: a signal).

    :raises OSError: results.json or run.log cannot be written.
    """
    for phase in phases:
        key, title = phase.key, phase.title
        limit = min(phase.limit_s * limit_scale, run.deadline - time.monotonic())
        if limit < 5:
            run.record({"phase": key, "title": title, "status": "skipped", "why": "no time left in the budget"})
            continue
        run.log(f"== phase {key}: {title} (limit {limit:.0f}s)")
        run.record({"phase": key, "title": title, "status": "running"})
        t = time.monotonic()
        run.partial = {}
        try:
            res = phase.body(t + limit)
        except GpuPhaseTimeout as exc:
            res = {"status": "timeout", "error": str(exc), **run.partial}
        except KeyboardInterrupt as exc:
            run.record({"phase": key, "title": title, "status": "interrupted", "error": str(exc), **run.partial})
            run.log(f"interrupted ({exc}) during phase {key}")
            return 2
        except Exception as exc:
            res = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            res.update(run.partial)
        res = {"phase": key, "title": title, **res, "seconds": round(time.monotonic() - t, 2)}
        run.record(res)
        run.log(
            f"== phase {key}: {res['status']} in {res['seconds']}s" + (f" -- {res['error']}" if "error" in res else "")
        )
    run.log(f"summary: {json.dumps(run.doc['summary'])}")
    failed = [k for k, v in run.doc["summary"].items() if v in ("fail", "error", "timeout")]
    return 1 if failed else 0


# ---------------------------------------------------------------------- the phases


def phase_a(run: Run, deadline: float) -> dict[str, Any]:
    """Environment: nvidia-smi, the kvflow commit, and what phase A's child sees (`child.environment`).

    :raises GpuChildFailed: the environment child printed no JSON line.
    :raises subprocess.TimeoutExpired: it did not finish by `deadline`.
    """
    details: dict[str, Any] = {}
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, "--query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem", "--format=csv"]
        for key, argv in (("nvidia_smi_query", query), ("nvidia_smi", [smi])):
            try:
                r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
                details[key] = (r.stdout + r.stderr).strip()
                run.log(f"{key}:\n{details[key]}")
            except Exception as exc:
                details[key] = f"failed: {exc}"
    else:
        details["nvidia_smi"] = "not found"
    try:  # which kvflow commit the check runs against (the checkout's .git may not have travelled)
        checkout = Path(kvflow.__file__).resolve().parents[1]
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=checkout)
        details["git_head"] = r.stdout.strip() or r.stderr.strip()[:200]
    except Exception as exc:
        details["git_head"] = f"unknown ({type(exc).__name__})"
    left = max(deadline - time.monotonic(), 1)
    r = subprocess.run(child_argv("env", run.device), capture_output=True, text=True, timeout=left, env=child_env())
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise GpuChildFailed(f"env child printed nothing (rc {r.returncode}): {r.stderr[-2000:]}")
    info = json.loads(lines[-1])
    details.update(info)
    if r.stderr.strip():
        details["child_stderr_tail"] = r.stderr.strip().splitlines()[-20:]
    problems = []
    if "kvflow_nixl_error" in info:
        problems.append(info["kvflow_nixl_error"])
    if run.device == "cuda":
        if not info.get("cuda_available"):
            problems.append("torch sees no CUDA device")
        if "VRAM" not in info.get("nixl_memory_types", []):
            problems.append(f"the NIXL UCX backend offers {info.get('nixl_memory_types')}, no VRAM")
    return {"status": "fail" if problems else "ok", "problems": problems, "details": details}


def phase_c(run: Run, deadline: float) -> dict[str, Any]:
    """(cuda) Gating with kvflow's own gate (`CudaDevice.record`, `GateWaiter`): kv_ready once it
    opened must carry the fresh bytes; a negative control that does not wait; the CPU cost of
    waiting on an event, kvflow's included, which must sleep (under `SLEEPING_CPU_PER_WALL`).

    :raises GpuChildFailed: a child failed.
    :raises GpuPhaseTimeout: a reply did not come by `deadline`.
    """
    if run.device != "cuda":
        return {"status": "skipped", "why": "needs CUDA (kernels, streams, events)"}
    p, d, info = start_pair(run, "C", deadline)
    trials: list[dict[str, Any]] = []
    run.partial["trials"] = trials
    try:
        rate = p.request("calibrate", "calibrated", deadline)["cycles_per_s"]
        run.partial["sleep_cycles_per_s"] = rate
        # first the CPU cost of waiting for a ~1 s kernel (no transfer involved)
        waits = p.request("cpu_wait", "cpu_waited", deadline, cycles=int(rate * 1.0))["rows"]
        run.partial["cpu_wait"] = waits
        for w in waits:
            run.log(
                f"  C cpu wait {w['kind']}: cpu {w['cpu_s']:.3f}s over {w['wall_s']:.3f}s wall "
                f"(kernel {w['kernel_s']:.3f}s)"
            )
        gate_cycles = int(rate * 0.3)  # a ~0.3 s kernel ahead of the copy
        run.log(f"  C: {rate / 1e9:.3f} G sleep-cycles/s; gate kernel {gate_cycles} cycles")
        plan = [("gated", True, 21), ("gated", True, 22), ("ungated", False, 23), ("ungated", False, 24)]
        pb, db = [2, 5, 6, 7, 30], [9, 10, 33, 50, 51]
        for i, (kind, wait, seed) in enumerate(plan):
            tid = f"C-{i}"
            ident = d.send("expect", tid=tid, peer="prefill-0", blocks=db, mode="push", zero=True)
            d.wait("expecting", ident, deadline)
            time.sleep(0.05)
            g = p.request(
                "gate", "gated", deadline, tid=tid, blocks=pb, seed=seed, cycles=gate_cycles, wait=wait, peer="decode-0"
            )
            r = d.wait("result", ident, deadline)
            fresh = r["digest"] == g["expected"]
            landed = "pattern" if fresh else "stale" if r["target_stale_fraction"] == 1.0 else "mixed"
            succeeded = g["outcome"] == "succeeded" and r["outcome"] == "succeeded"
            trial = {
                "tid": tid,
                "kind": kind,
                "ok": (fresh and succeeded and r["outside_nonzero_bytes"] == 0) if wait else None,
                "landed": landed,
                "d_stale_fraction": r["target_stale_fraction"],
                "copy_pending_at_kv_ready": g["pending_at_kv_ready"],
                "p_blocks_final_equal_pattern": g["p_digest_after"] == g["expected"],
                "waited_for_event_s": round(g["waited_s"], 4),
                "p_outcome": g["outcome"],
                "d_outcome": r["outcome"],
                "ms_kv_ready_to_d_result": round((r["t_done"] - g["t0"]) * 1e3, 3),
            }
            run.log(f"  C {kind}: landed={landed} pending_at_kv_ready={g['pending_at_kv_ready']}")
            trials.append(trial)
            if not succeeded:
                run.log(f"  C: transfer {tid} did not succeed ({g['reason']!r}, {r['reason']!r}); the phase stops here")
                break
    finally:
        p.close()
        d.close()
    gated = [t for t in trials if t["kind"] == "gated"]
    ok = len(gated) == 2 and all(t["ok"] for t in gated) and all(t["p_blocks_final_equal_pattern"] for t in trials)
    # kvflow's own gate must let its waiter sleep: a spinning wait costs a core per rank
    mine = [w["cpu_per_wall"] for w in waits if w["kind"] == "kvflow_gate_wait"]
    waiter_sleeps = bool(mine) and mine[0] is not None and mine[0] < SLEEPING_CPU_PER_WALL
    return {
        "status": "ok" if ok and waiter_sleeps else "fail",
        "kvflow_waiter_sleeps": waiter_sleeps,
        "gated_ok": f"{sum(bool(t['ok']) for t in gated)}/{len(gated)}",
        "negative_control": [t["landed"] for t in trials if t["kind"] == "ungated"],
        "sleep_cycles_per_s": rate,
        "trials": trials,
        "cpu_wait": waits,
    }


SLEEPING_CPU_PER_WALL = 0.2  # CPU seconds per second of waiting under which a waiter sleeps

BANDWIDTH_HEADER = (
    "size_mib,bytes,blocks,verified,kvflow_median_ms,kvflow_min_ms,kvflow_median_gbps,kvflow_best_gbps,"
    "p_side_median_ms,copy_median_ms,copy_median_gbps,copy_equal,"
    "raw_verified,raw_median_ms,raw_median_gbps,kvflow_over_raw\n"
)


def phase_d(run: Run, deadline: float, sizes_mib: list[int], warmup: int = 2, iters: int = 5) -> dict[str, Any]:
    """Bandwidth: per size, `warmup` + `iters` contiguous pushes, each checked by digest, the
    same WRITEs made with bare NIXL agents (`raw_nixl`: kvflow's bandwidth over theirs is
    ``kvflow_over_raw``), and a torch copy of the same size; a row of bandwidth.csv per size as
    it ends.

    :raises GpuChildFailed: a child failed, or a transfer did not succeed.
    :raises GpuPhaseTimeout: a reply did not come by `deadline`.
    """
    per_block = SPEC_D["num_layers"] * 2 * block_len(SPEC_D)  # bytes one block carries (K and V, every layer)
    blocks = max(sizes_mib) * 2**20 // per_block
    p, d, info = start_pair(run, "D", deadline, geometry="bw", blocks=blocks)
    csv = run.out / "bandwidth.csv"
    csv.write_text(BANDWIDTH_HEADER)
    try:
        raw = {name: proc.request("raw_open", "raw_opened", deadline, name=name) for name, proc in (("p", p), ("d", d))}
        p.request("raw_peer", "raw_peered", deadline, metadata=raw["d"]["metadata"], layers=raw["d"]["layers"])
        d.request("raw_peer", "raw_peered", deadline, metadata=raw["p"]["metadata"], layers=raw["p"]["layers"])
    except BaseException:
        p.close()
        d.close()
        raise
    rows: list[dict[str, Any]] = []
    run.partial["rows"] = rows
    try:
        for k, mib in enumerate(sizes_mib):
            n = mib * 2**20 // per_block
            pb = db = list(range(n))  # contiguous on both sides
            digest = p.request("fill", "filled", deadline, seed=100 + k, blocks=pb)["digest"]
            timed, p_side, verified = [], [], 0
            for i in range(warmup + iters):
                t = one_transfer(p, d, deadline, f"D-{mib}-{i}", "push", pb, db, None, digest)
                if t["p_outcome"] != "succeeded" or t["d_outcome"] != "succeeded":
                    why = f"P {t['p_reason']!r}, D {t['d_reason']!r}"
                    raise GpuChildFailed(f"transfer {t['tid']} did not succeed: {why}")
                verified += t["ok"]
                if i >= warmup:
                    timed.append(t["ms_kv_ready_to_d_result"] / 1e3)
                    p_side.append(t["ms_kv_ready_to_p_result"] / 1e3)
            size = n * per_block
            raw_timed, raw_verified = [], 0
            for i in range(warmup + iters):
                tag = f"raw-{mib}-{i}"
                ident = d.send("raw_expect", tag=tag, count=n)
                d.wait("raw_expecting", ident, deadline)
                written = p.request("raw_write", "raw_written", deadline, tag=tag, count=n)
                landed = d.wait("raw_result", ident, deadline)
                raw_verified += landed["digest"] == digest
                if i >= warmup:
                    raw_timed.append(landed["t_done"] - written["t0"])
            cp = p.request("copy_bw", "copied", deadline, size=size, warmup=warmup, iters=iters)
            row = {
                "size_mib": mib,
                "bytes": size,
                "blocks": n,
                "verified": f"{verified}/{warmup + iters}",
                "kvflow_median_ms": statistics.median(timed) * 1e3,
                "kvflow_min_ms": min(timed) * 1e3,
                "kvflow_median_gbps": size / statistics.median(timed) / 1e9,
                "kvflow_best_gbps": size / min(timed) / 1e9,
                "p_side_median_ms": statistics.median(p_side) * 1e3,
                "copy_median_ms": statistics.median(cp["times"]) * 1e3,
                "copy_median_gbps": size / statistics.median(cp["times"]) / 1e9,
                "copy_equal": cp["equal"],
                "raw_verified": f"{raw_verified}/{warmup + iters}",
                "raw_median_ms": statistics.median(raw_timed) * 1e3,
                "raw_median_gbps": size / statistics.median(raw_timed) / 1e9,
                "kvflow_over_raw": statistics.median(raw_timed) / statistics.median(timed),
            }
            rows.append(row)
            with open(csv, "a") as f:
                f.write(",".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row.values()) + "\n")
            run.log(
                f"  D {mib:>4} MiB: kvflow {row['kvflow_median_gbps']:8.2f} GB/s "
                f"(median {row['kvflow_median_ms']:.3f} ms, verified {row['verified']}); "
                f"raw NIXL {row['raw_median_gbps']:8.2f} GB/s (kvflow/raw {row['kvflow_over_raw']:.2f}, "
                f"verified {row['raw_verified']}); torch copy {row['copy_median_gbps']:8.2f} GB/s"
            )
    finally:
        p.close()
        d.close()
    ok = (
        rows
        and len(rows) == len(sizes_mib)
        and all(r["verified"] == r["raw_verified"] == f"{warmup + iters}/{warmup + iters}" for r in rows)
        and all(r["copy_equal"] for r in rows)
    )
    return {"status": "ok" if ok else "fail", "block_bytes_all_layers": per_block, "rows": rows}


def phase_i(run: Run, deadline: float) -> dict[str, Any]:
    """The integrity check (`kvflow.runtime.integrity`) on one child's caches, GPU memory read
    through the driver's copy: a seal of 64 filled blocks checks clean, and fails naming the
    block once one bit of it is flipped; the seal's and the check's rate (GiB/s).

    :raises GpuChildFailed: the child failed.
    :raises GpuPhaseTimeout: no reply by `deadline`.
    """
    env = child_env(None)
    child = Proc(run, "integrity-0", child_argv("d", run.device, "--name", "integrity-0"), env, "I")
    try:
        child.wait("ready", None, min(deadline, time.monotonic() + READY_S))
        res = child.request("integrity", "integrity", deadline, count=BLOCKS_B, seed=7)
    finally:
        child.close()
    last = BLOCKS_B - 1
    caught = isinstance(res["flipped"], str) and f"block {last}" in res["flipped"]
    ok = res["clean"] is None and caught
    run.log(f"  I: clean {res['clean']!r}; flipped: {res['flipped']!r}")
    run.log(
        f"  I: {res['bytes']} bytes, seal {res['seal_gib_per_s']:.2f} GiB/s, check {res['check_gib_per_s']:.2f} GiB/s"
    )
    return {"status": "ok" if ok else "fail", **{k: v for k, v in res.items() if k not in ("event", "id")}}
