"""The GPU check's phases, A B E C D F, and `run_phases`, which runs them under their time limits.

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
from kvflow_tools.gpu.plan import B_TRANSFERS, BLOCKS_B, PHASE_LIMITS, READY_S, SPEC_D, UCX_LINES, block_len
from kvflow_tools.gpu.run import Proc, Run, child_argv, child_env
from kvflow_tools.gpu.ucx import ucx_summary

__all__ = (
    "Phase",
    "phase_a",
    "phase_b",
    "phase_c",
    "phase_d",
    "phase_e",
    "phase_f",
    "phase_v",
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


# ---------------------------------------------------------------------- two engines


def start_pair(
    run: Run,
    tag: str,
    deadline: float,
    *,
    geometry: str = "b",
    blocks: int = BLOCKS_B,
    env_extra: dict[str, str] | None = None,
    unbound: bool = False,
    stderr: dict[str, Path] | None = None,
    engine_process: bool = False,
    exported: bool = False,
) -> tuple[Proc, Proc, dict[str, Any]]:
    """P (prefill-0) and D (decode-0), each ready, D connected to P; `stderr` (when given) gets
    their stderr files at once, for a caller that reads them whatever happens.

    :raises GpuChildFailed: a child failed to start or to connect.
    :raises GpuPhaseTimeout: not ready (or connected) by `deadline` or `READY_S`.
    :raises OSError: a child cannot be started.
    """
    env = child_env(env_extra)
    extra = ["--geometry", geometry, "--blocks", str(blocks)] + (["--unbound"] if unbound else [])
    p_extra = (["--engine-process"] if engine_process else []) + (["--exported"] if exported else [])
    p = Proc(run, "prefill-0", child_argv("p", run.device, "--name", "prefill-0", *extra, *p_extra), env, tag)
    d = Proc(run, "decode-0", child_argv("d", run.device, "--name", "decode-0", *extra), env, tag)
    if stderr is not None:
        stderr.update(p=p.err_path, d=d.err_path)
    try:
        t = time.monotonic()
        ready_by = min(deadline, t + READY_S)
        pr = p.wait("ready", None, ready_by)
        dr = d.wait("ready", None, ready_by)
        pair_info = {"start_s": round(time.monotonic() - t, 2), "p_ready": pr, "d_ready": dr}
        d.request("connect", "connected", deadline, peer="prefill-0", address=pr["address"])
    except BaseException:
        p.close()
        d.close()
        raise
    return p, d, pair_info


def one_transfer(
    p: Proc,
    d: Proc,
    deadline: float,
    tid: str,
    mode: str,
    pb: list[int],
    db: list[int],
    seed: int | None,
    digest: str | None = None,
) -> dict[str, Any]:
    """Fill P (unless `digest` is P's digest already), D expects, P sends; compare the bytes.

    :raises GpuChildFailed: a child answered with an error, or exited.
    :raises GpuPhaseTimeout: a reply did not come by `deadline`.
    """
    if seed is not None:
        digest = p.request("fill", "filled", deadline, seed=seed, blocks=pb)["digest"]
    ident = d.send("expect", tid=tid, peer="prefill-0", blocks=db, mode=mode, zero=True)
    d.wait("expecting", ident, deadline)
    time.sleep(0.05)  # D's registration reaches P before P's kv_ready (push)
    sent = p.request("send", "sent", deadline, tid=tid, blocks=pb, mode=mode, peer="decode-0")
    res = d.wait("result", ident, deadline)
    ok = (
        sent["outcome"] == "succeeded"
        and res["outcome"] == "succeeded"
        and res["digest"] == digest
        and res["outside_nonzero_bytes"] == 0
    )
    return {
        "tid": tid,
        "mode": mode,
        "ok": ok,
        "bytes": res["target_bytes"],
        "p_blocks": pb,
        "d_blocks": db,
        "p_outcome": sent["outcome"],
        "d_outcome": res["outcome"],
        "p_reason": sent["reason"],
        "d_reason": res["reason"],
        "digest_equal": res["digest"] == digest,
        "d_outside_nonzero_bytes": res["outside_nonzero_bytes"],
        "ms_kv_ready_to_d_result": round((res["t_done"] - sent["t0"]) * 1e3, 3),
        "ms_kv_ready_to_p_result": round((sent["t_p_done"] - sent["t0"]) * 1e3, 3),
    }


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


def phase_b(
    run: Run,
    deadline: float,
    tag: str = "B",
    env_extra: dict[str, str] | None = None,
    unbound: bool = False,
    stderr: dict[str, Path] | None = None,
    engine_process: bool = False,
) -> dict[str, Any]:
    """P→D pushes of scattered blocks and one pull, each byte-exact; the regions' memory kinds.
    `engine_process`: P's engine runs in an engine process over the memory P exports.

    :raises GpuChildFailed: a child failed.
    :raises GpuPhaseTimeout: a reply did not come by `deadline`.
    """
    p, d, info = start_pair(
        run, tag, deadline, env_extra=env_extra, unbound=unbound, stderr=stderr, engine_process=engine_process
    )
    transfers: list[dict[str, Any]] = []
    run.partial["transfers"] = transfers  # kept in results.json if the phase ends early
    try:
        for i, (mode, pb, db, seed) in enumerate(B_TRANSFERS):
            t = one_transfer(p, d, deadline, f"{tag}-{i}", mode, pb, db, seed)
            run.log(f"  {tag} transfer {i} {mode}: ok={t['ok']} {t['bytes']} B in {t['ms_kv_ready_to_d_result']} ms")
            transfers.append(t)
            if t["p_outcome"] != "succeeded" or t["d_outcome"] != "succeeded":
                run.log(f"  {tag}: transfer {i} did not succeed; the phase stops here")
                break
    finally:
        p.close()
        d.close()
    memory = {"p": info["p_ready"]["regions"], "d": info["d_ready"]["regions"]}
    want = "VRAM" if run.device == "cuda" else "DRAM"  # region_of: CUDA tensors are VRAM regions
    ok = len(transfers) == len(B_TRANSFERS) and all(t["ok"] for t in transfers)
    ok = ok and all(m == want for m in memory["p"] + memory["d"])
    return {
        "status": "ok" if ok else "fail",
        "memory": memory,
        "transfers_ok": f"{sum(t['ok'] for t in transfers)}/{len(transfers)}",
        "bytes": sum(t["bytes"] for t in transfers),
        "start_s": info["start_s"],
        "transfers": transfers,
        **({"p_shared": info["p_ready"].get("shared")} if engine_process else {}),
    }


def phase_g(run: Run, deadline: float) -> dict[str, Any]:
    """Phase B with P's engine in an engine process (`kvflow.runtime.process`) over the caches
    P's child owns and fills: on a GPU exported by legacy CUDA IPC (`kvflow.runtime.cuda_ipc`)
    and opened there, in the dry run host memory shared in place.  D's digest must equal the
    owner's: the engine process WRITEs the owner's bytes.

    :raises GpuChildFailed, GpuPhaseTimeout: see `phase_b`.
    """
    return phase_b(run, deadline, tag="G", engine_process=True)


def phase_v(run: Run, deadline: float) -> dict[str, Any]:
    """Phase G over memory as vLLM 0.34's extensible cache holds it (one driver-mapped chunk per
    layer, `kvflow_tools.gpu.vmm`), reaching the engine process as file descriptors
    (`kvflow.runtime.cuda_vmm`); then sleep mode's remap (the engine process lets go, the owner
    maps new chunks at the same addresses and hands them over again over the socket) and one
    more push, whose bytes must be the new chunks'.

    :raises GpuChildFailed, GpuPhaseTimeout: see `phase_b`.
    """
    if run.device != "cuda":
        return {"status": "skipped", "why": "needs CUDA (driver-mapped memory exported by descriptor)"}
    p, d, info = start_pair(run, "V", deadline, engine_process=True, exported=True)
    transfers: list[dict[str, Any]] = []
    run.partial["transfers"] = transfers
    remapped: dict[str, Any] = {}
    try:
        for i, (mode, pb, db, seed) in enumerate(B_TRANSFERS):
            transfers.append(one_transfer(p, d, deadline, f"V-{i}", mode, pb, db, seed))
        if all(t["ok"] for t in transfers):
            remapped = p.request("remap", "remapped", deadline)
            run.log(f"  V: remapped {remapped.get('chunks')} chunks in {remapped.get('ms')} ms")
            mode, pb, db, seed = B_TRANSFERS[0]
            transfers.append(one_transfer(p, d, deadline, "V-remapped", mode, pb, db, seed + 1000))
    finally:
        p.close()
        d.close()
    ok = len(transfers) == len(B_TRANSFERS) + 1 and all(t["ok"] for t in transfers)
    return {
        "status": "ok" if ok else "fail",
        "transfers_ok": f"{sum(t['ok'] for t in transfers)}/{len(transfers)}",
        "p_shared": info["p_ready"].get("shared"),
        "remap": remapped,
        "start_s": info["start_s"],
        "transfers": transfers,
    }


def phase_e(run: Run, deadline: float, tag: str = "E", unbound: bool = False) -> dict[str, Any]:
    """Phase B with ``UCX_PROTO_INFO=y``; the children's stderr and UCX's tables go to ucx.log
    even when the phase fails (then they matter most).

    :raises GpuChildFailed: a child failed.
    :raises GpuPhaseTimeout: a reply did not come by `deadline`.
    """
    stderr: dict[str, Path] = {}
    summaries: dict[str, Any] = {}
    run.partial["ucx"] = summaries
    try:
        res = phase_b(run, deadline, tag=tag, env_extra={"UCX_PROTO_INFO": "y"}, unbound=unbound, stderr=stderr)
    finally:
        for side, path in stderr.items():
            lines = path.read_text(errors="replace").splitlines() if path.exists() else []
            summary = ucx_summary(lines)
            note = "" if len(lines) <= UCX_LINES else f" (first {UCX_LINES} of {len(lines)} lines)"
            text = f"=== phase {tag}: {side} stderr with UCX_PROTO_INFO=y{note} ===\n" + "\n".join(lines[:UCX_LINES])
            text += f"\n--- phase {tag}: {side}: every 'remote memory' table in the whole log ---\n"
            run.append("ucx.log", text + "\n".join(summary["remote_memory"]) + "\n")
            summaries[side] = {**summary, "stderr_lines": len(lines)}
    res["ucx"] = summaries
    return res


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


def phase_f(run: Run, deadline: float) -> dict[str, Any]:
    """(cuda, extra) Phase E with no thread bound to the GPU; its status starts with ``info:``
    (it never fails the run).  Never raises but `KeyboardInterrupt`."""
    if run.device != "cuda":
        return {"status": "skipped", "why": "needs CUDA (threads without a CUDA device bound)"}
    try:
        res = phase_e(run, deadline, tag="F", unbound=True)
    except GpuPhaseTimeout as exc:
        res = {"status": "timeout", "error": str(exc), **run.partial}
    except Exception as exc:
        res = {"status": "error", "error": f"{type(exc).__name__}: {exc}", **run.partial}
    res["status"] = "info: " + res["status"]
    return res


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
