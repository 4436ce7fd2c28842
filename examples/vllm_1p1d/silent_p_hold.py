"""How long D keeps the blocks of requests whose P fell silent, and what its metrics say meanwhile.

Why: a P that stops answering (frozen, cut off) may still have a WRITE towards D in a TCP
connection the teardown cannot close, which lands when the link is back; so D quarantines the
blocks P may write until kvflow's fencing rule lets them go (docs/design.md, the teardown's
HOLDING phase), and the requests wait meanwhile.  This starts a real 1P1D (kvflow's launcher,
the CPU build, the tiny local model), sends one request so that P and D are associated, freezes
P (SIGSTOP) while `--requests` requests reach D, keeps it frozen `--frozen` seconds, thaws it,
and prints D's metrics each time they change: requests waiting, KV cache in use, kvflow's
quarantined blocks, its teardowns by phase, the seconds until the hold ends, and the engine
core's sleeps; then each request's answer and when it came.

    .venv/bin/python -m examples.vllm_1p1d.silent_p_hold --requests 4 --frozen 75 [--lease 30]
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import threading
import time
from pathlib import Path

from examples.vllm_1p1d.d_waiting_cpu import ask as waiting_ask
from kvflow_tools.serve.client import metric_sum
from kvflow_tools.serve.launcher import Deployment, ServeOptions, Server

PHASES = ("removing", "backing-off", "grace", "holding")  # kvflow's teardown phases
SLEEPS = ("kvflow", "request", "limit", "follow_up")  # how the engine core's sleeps ended
WATCHED = [
    ("vllm:num_requests_waiting", {}),
    ("vllm:kv_cache_usage_perc", {}),
    ("vllm:kvflow_quarantined_blocks", {}),
    ("vllm:kvflow_hold_release_seconds", {}),
    *[("vllm:kvflow_peer_teardowns", {"phase": phase}) for phase in PHASES],
    *[("vllm:kvflow_scheduler_events_total", {"event": f"idle_sleeps_ended_by_{end}"}) for end in SLEEPS],
    ("vllm:kvflow_scheduler_events_total", {"event": "idle_sleep_ms"}),
]


def watched(server: Server) -> dict[str, float]:
    """The `WATCHED` series of `server`'s metrics that are not 0, by name and phase or event."""
    text = server.metrics()
    found = {}
    for name, labels in WATCHED:
        value = metric_sum(text, name, labels)
        if value:
            found[".".join([name.removeprefix("vllm:"), *labels.values()])] = round(value, 3)
    return found


def ask(router: str, index: int, answers: list[str], start: float) -> None:
    errors: list[str] = []
    waiting_ask(router, index, errors)
    outcome = errors[0].split(": ", 1)[1] if errors else "HTTP 200"
    answers.append(f"request {index}: {outcome} after {time.monotonic() - start:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--frozen", type=float, default=75.0, help="seconds P stays frozen")
    parser.add_argument("--lease", type=float, default=30.0, help="kvflow's lease (a silent peer is lost after it)")
    parser.add_argument("--watch", type=float, default=180.0, help="seconds D's metrics are watched after the thaw")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="kvflow-silent-p-"))
    with Deployment(ServeOptions(port=0, run_dir=run_dir, kvflow_settings={"lease": args.lease})) as pd:
        p, d = pd.server("prefill-0"), pd.server("decode-0")
        warm: list[str] = []
        ask(pd.router_url, 99, warm, time.monotonic())  # P and D associated, as in service
        print("warm-up:", *warm)
        answers: list[str] = []
        start = time.monotonic()
        p.group.signal(signal.SIGSTOP)
        threads = [threading.Thread(target=ask, args=(pd.router_url, i, answers, start)) for i in range(args.requests)]
        for thread in threads:
            thread.start()
        last: dict[str, float] = {}
        thawed = False
        while time.monotonic() - start < args.frozen + args.watch and (
            not thawed or any(t.is_alive() for t in threads)
        ):
            if not thawed and time.monotonic() - start >= args.frozen:
                p.group.signal(signal.SIGCONT)
                thawed = True
                print(f"{time.monotonic() - start:6.1f} s  P thawed")
            now = watched(d)
            if now != last:
                print(f"{time.monotonic() - start:6.1f} s  D: {now}")
                last = now
            time.sleep(1.0)
        if not thawed:
            p.group.signal(signal.SIGCONT)
        for thread in threads:
            thread.join()
        for answer in sorted(answers):
            print(answer)


if __name__ == "__main__":
    main()
