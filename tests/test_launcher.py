"""The launcher's commands for servers on other hosts, built without starting anything.

A server placed on a `Host` runs under that host's command prefix, listens (HTTP and kvflow) on
the host's address, gets the host's environment, and every server of a deployment with one off
loopback shares one control-plane secret in a file only this user reads.
"""

from __future__ import annotations

import dataclasses
import json
import stat
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from kvflow.errors import ConfigError
from kvflow_tools.serve.launcher import Deployment, Host, ServeOptions

NETNS = ("ip", "netns", "exec", "ns-p")


def options(tmp_path: Path, hosts: Mapping[str, Host] | None = None) -> ServeOptions:
    base = ServeOptions(python=Path(sys.executable), model=tmp_path / "model", run_dir=tmp_path / "run", port=0)
    return dataclasses.replace(base, hosts=dict(hosts or {}))


def test_a_server_on_another_host_runs_there_listens_on_its_address_and_gets_its_environment(tmp_path: Path) -> None:
    host = Host("10.232.0.1", NETNS, {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "kv0"})
    pd = Deployment(options(tmp_path, hosts={"prefill-0": host}))
    p, d = pd.server("prefill-0"), pd.server("decode-0")
    assert p.url.startswith("http://10.232.0.1:") and p.kvflow.startswith("tcp://10.232.0.1:")
    assert d.url.startswith("http://127.0.0.1:") and d.kvflow.startswith("tcp://127.0.0.1:")
    argv = pd.argv(p)
    assert tuple(argv[: len(NETNS)]) == NETNS and argv[len(NETNS)] == sys.executable
    assert argv[argv.index("--host") + 1] == "10.232.0.1" and p.url.endswith(":" + argv[argv.index("--port") + 1])
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert f"tcp://{extra['host']}:{extra['port']}" == p.kvflow
    assert pd.argv(d)[0] == sys.executable  # D stays here
    env = pd.env(p)
    assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == "kv0" and pd.env(d).get("UCX_NET_DEVICES") != "kv0"
    router = pd.router_argv(8000, "push")
    assert router[router.index("--prefill") + 1] == p.url and router[router.index("--prefill-kvflow") + 1] == p.kvflow


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
