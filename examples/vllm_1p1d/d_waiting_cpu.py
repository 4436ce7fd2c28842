"""What a decode server costs while its requests wait for P's KV, process by process.

Why: with push, D has each request from the moment P does, so a request waits on D for as long
as it queues and prefills on P.  This starts a real 1P1D (kvflow's launcher, the CPU build, the
tiny local model), freezes P (SIGSTOP) so that nothing P does races the reading, sends
`--requests` requests through the router, and prints the CPU (in cores) of every process of D's
group over `--seconds`: idle first, then with the requests waiting, then idle again after P is
thawed and they are done.

    .venv/bin/python -m examples.vllm_1p1d.d_waiting_cpu --requests 4 --seconds 5 [--idle-sleep 0] [--idle-wait 0]

``--idle-sleep 0`` is vLLM's own behaviour (the engine core steps without pause while requests
wait); by default the connector's engine core sleeps until kvflow or vLLM has news for it.  The
sleeps D counted, by how they ended, are printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from kvflow_tools.serve.launcher import Deployment, ServeOptions, Server


def cpu_seconds(pgid: int) -> dict[int, tuple[str, float]]:
    """Every process of group `pgid`: its name and the CPU seconds it has used."""
    found: dict[int, tuple[str, float]] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            stat = Path(f"/proc/{entry}/stat").read_text()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            command = Path(f"/proc/{entry}/cmdline").read_text().replace("\0", " ")
            module = command.split(" -m ", 1)[1].split()[0] if " -m " in command else name
            found[int(entry)] = (module, (int(fields[11]) + int(fields[12])) / ticks)
        except (OSError, ValueError, IndexError):
            continue
    return found


def cores(server: Server, seconds: float) -> dict[str, float]:
    """CPU in cores of each process of `server`'s group over `seconds`."""
    pgid = server.group.pid or 0
    before = cpu_seconds(pgid)
    time.sleep(seconds)
    after = cpu_seconds(pgid)
    used: dict[str, float] = {}
    for pid, (name, total) in after.items():
        used[name] = used.get(name, 0.0) + (total - before.get(pid, (name, 0.0))[1]) / seconds
    return {name: round(value, 3) for name, value in sorted(used.items())}


def ask(router: str, index: int, errors: list[str]) -> None:
    body = {"model": "tiny", "prompt": [1 + index] * 300, "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(
        f"{router}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            answer.read()
    except OSError as exc:
        errors.append(f"request {index}: {exc}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--idle-wait", type=float, default=None, help="the connector's idle_wait (default: its own; 0: no sleep)"
    )
    parser.add_argument(
        "--idle-sleep", type=float, default=None, help="the connector's idle_sleep (default: its own; 0: no sleep)"
    )
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="kvflow-d-waiting-"))
    settings: dict[str, object] = {"lease": 30.0, "transfer_timeout": 300.0}  # P stays frozen well within both
    if args.idle_wait is not None:
        settings["idle_wait"] = args.idle_wait
    if args.idle_sleep is not None:
        settings["idle_sleep"] = args.idle_sleep
    with Deployment(ServeOptions(port=0, run_dir=run_dir, kvflow_settings=settings)) as pd:
        p, d = pd.server("prefill-0"), pd.server("decode-0")
        print("D idle:", cores(d, args.seconds))
        errors: list[str] = []
        p.group.signal(signal.SIGSTOP)
        try:
            threads = [threading.Thread(target=ask, args=(pd.router_url, i, errors)) for i in range(args.requests)]
            for thread in threads:
                thread.start()
            time.sleep(3.0)  # every request is at D by now, waiting for P's KV
            print(f"D with {args.requests} requests waiting for P's KV:", cores(d, args.seconds))
        finally:
            p.group.signal(signal.SIGCONT)
        for thread in threads:
            thread.join()
        print("D idle again:", cores(d, args.seconds))
        for error in errors:  # a frozen P's server may close a kept-alive connection on waking
            print("failed:", error)
        for line in d.metrics().splitlines():
            if line.startswith("vllm:kvflow_scheduler_events_total") and "idle_sleep" in line:
                print("D:", line)


if __name__ == "__main__":
    main()
