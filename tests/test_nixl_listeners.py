"""No socket of an engine whose control channel binds loopback listens anywhere else.

UCX's TCP transport listens on every network device it uses, so an engine process configured
on 127.0.0.1 had a listener on the host's external interface too (backlog 4096).  With
``loopback_only`` (what the vLLM connector sets from its bind address) UCX keeps to the
loopback device.  Read from the engine process's own /proc: its sockets' inodes, and the TCP
tables' listening entries that own them.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import kvflow
from kvflow.runtime.host_memory import share_in_place
from kvflow.runtime.process import EngineProcess, ProcessSpec
from kvflow.transports.nixl_setup import net_devices

SPEC = kvflow.KVSpec(num_layers=1, block_size=16, num_kv_heads=1, head_dim=64)
LISTEN = "0A"  # the TCP state in /proc/net/tcp
Start = Callable[[bool], EngineProcess]  # an engine process, with or without `loopback_only`


def listening(pid: int) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket process `pid` has listening."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == LISTEN and inode in inodes:
                    found.append(_address(local, family))
    return found


def _address(local: str, family: int) -> tuple[str, int]:
    raw, port = local.split(":")
    packed = bytes.fromhex(raw)
    # the kernel prints each 32-bit word in host (little-endian) order
    words = b"".join(packed[i : i + 4][::-1] for i in range(0, len(packed), 4))
    return socket.inet_ntop(family, words), int(port, 16)


def external_address() -> bool:
    """Whether this host has a network interface beyond loopback with an address."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return False
    return any(name != "lo" for name in names) and bool(
        [a for a in _interface_addresses() if not ipaddress.ip_address(a).is_loopback]
    )


def _interface_addresses() -> list[str]:
    with open("/proc/net/fib_trie") as trie:
        text = trie.read()
    return [line.split()[1] for line in text.splitlines() if line.strip().startswith("|--")]


@pytest.fixture
def engine_of() -> Iterator[Start]:
    started: list[EngineProcess] = []

    def start(loopback_only: bool) -> EngineProcess:
        cache = np.zeros((2, 4, SPEC.block_len), np.uint8)
        regions = [kvflow.region_of(cache)]
        spans = share_in_place(regions)
        try:
            layout = kvflow.KVLayout.per_layer_regions(SPEC, 4, regions)
            options = {"cuda": False, "loopback_only": loopback_only}
            process = EngineProcess(ProcessSpec(f"listens-{len(started)}", layout, transport_options=options), spans)
        finally:
            for span in spans:
                os.close(span.fd)
        started.append(process)
        return process

    yield start
    for process in started:
        process.close()


def test_an_engine_on_loopback_listens_on_loopback_only(engine_of: Start, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    process = engine_of(True)
    found = listening(process.pid)
    assert found, "the engine process listens on nothing (its control channel at least)"
    assert all(ipaddress.ip_address(address).is_loopback for address, _ in found), found
    if external_address():  # the check can fail here: without the option UCX listens beyond loopback
        wide = listening(engine_of(False).pid)
        assert not all(ipaddress.ip_address(address).is_loopback for address, _ in wide), wide


def test_a_deployments_own_device_choice_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    with net_devices(True):
        assert os.environ["UCX_NET_DEVICES"] == "lo"
    assert "UCX_NET_DEVICES" not in os.environ  # put back once the backend is made
    with net_devices(False):
        assert "UCX_NET_DEVICES" not in os.environ
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")
    with net_devices(True):
        assert os.environ["UCX_NET_DEVICES"] == "mlx5_0:1"
