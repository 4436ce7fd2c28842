"""Phase B of the GPU check and its variants E, F, G and V, over the pair of engines they drive.

`start_pair` starts P (prefill-0) and D (decode-0) and connects D to P; `one_transfer` moves
blocks from one to the other and checks them byte for byte.

Why a module of its own: these phases differ only in how the pair is started (UCX's protocol log,
no thread bound to the GPU, P's engine in an engine process over memory its owner shares or
exports by descriptor) and all end in the same byte-exact transfers; the pair is what phases C
and D build on too, and they reach it through `start_pair` and `one_transfer` alone.  What runs
the phases and decides what a phase's end means stays in `kvflow_tools.gpu.phases`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvflow_tools.errors import GpuPhaseTimeout
from kvflow_tools.gpu.plan import B_TRANSFERS, BLOCKS_B, READY_S, UCX_LINES
from kvflow_tools.gpu.run import Proc, Run, child_argv, child_env
from kvflow_tools.gpu.ucx import ucx_summary

__all__ = (
    "one_transfer",
    "phase_b",
    "phase_e",
    "phase_f",
    "phase_g",
    "phase_v",
    "start_pair",
)


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


# ---------------------------------------------------------------------- phase B and its variants


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
