"""P and D on two hosts (network namespaces joined by a veth pair) over TCP, and a link that is cut.

Real processes, the control plane (ZeroMQ with a secret) bound to the veth addresses, NIXL-UCX over
TCP on the veth (UCX_TLS=tcp, UCX_NET_DEVICES).  Cutting the link leaves every socket open and
silent, the failure a single host never shows.  Needs root; skips, saying why, where network
namespaces cannot be created.
"""

from __future__ import annotations

import time

import pytest

from kvflow.tools.netns import TwoHosts, unavailable
from tests.test_cross_process import TRANSPORTS, Event, PeerProcess, prefix

__all__ = ("prefix",)  # the fixture, shared with the single-host cross-process tests

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"two hosts need network namespaces: {REASON}")

LEASE = 2.0


def start(hosts: TwoHosts, side: str, name: str, prefix: str) -> PeerProcess:
    env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": hosts.device(side), "NIXL_LOG_LEVEL": "ERROR"}
    options = ["--lease", str(LEASE), "--ttl", "30", "--bind", f"tcp://{hosts.address(side)}:0"]
    return PeerProcess(
        name, f"{prefix}-{side}", *options, *TRANSPORTS["nixl-direct"], launcher=hosts.command(side), env=env
    )


def connect(d: PeerProcess, p: PeerProcess) -> None:
    connected: Event = {"event": "error"}
    for _ in range(40):  # after a teardown D refuses P's new association until its grace is over
        connected = d.ask("connected", cmd="connect", peer="P", address=p.address, timeout=2.0)
        if connected["event"] == "connected":
            return
        time.sleep(0.25)
    raise AssertionError(f"D could not connect to P: {connected}")


def move(p: PeerProcess, d: PeerProcess, tid: str, seed: int) -> None:
    d.ask("started", cmd="expect", tid=tid, epoch=1, peer="P", blocks=[1, 2, 3], mode="push", verify=seed)
    p.ask("started", cmd="kv_ready", tid=tid, epoch=1, blocks=[7, 8, 9], mode="push", peer="D", seed=seed)
    assert d.result(tid, timeout=20)["verified"] is True  # D holds the bytes P wrote for this transfer
    assert p.result(tid, timeout=20)["outcome"] == "succeeded"


def no_blocks_held(side: PeerProcess) -> None:
    side.stats_when(lambda s: s["held_blocks"] == 0 and s["quarantined_blocks"] == 0, "every block back", 30)


def test_a_cut_link_fails_open_transfers_within_the_lease_leaks_nothing_and_heals(prefix: str) -> None:
    with TwoHosts() as hosts:
        p = start(hosts, "p", "P", prefix)
        d = start(hosts, "d", "D", prefix)
        try:
            assert p.address.startswith(f"tcp://{hosts.address('p')}:")
            connect(d, p)
            move(p, d, "before", seed=1)
            open_ids = [f"cut{i}" for i in range(3)]
            for n, tid in enumerate(open_ids):
                d.ask("started", cmd="expect", tid=tid, epoch=1, peer="P", blocks=[4 + n], mode="push")
            p.stats_when(lambda s: s["live_transfers"] == len(open_ids), "P has D's registrations")
            hosts.cut()
            for n, tid in enumerate(open_ids):  # P's KV is ready now: its writes meet a dead link
                p.ask("started", cmd="kv_ready", tid=tid, epoch=1, blocks=[10 + n], mode="push", peer="D", seed=n)
            for side in (p, d):
                for tid in open_ids:
                    result = side.result(tid, timeout=LEASE * 4 + 10)
                    # the lease ran out: the peer is lost and torn down ("peer 'D' lost" or, for a
                    # write cancelled by the teardown, "peer 'D' removed"); the 30 s deadline would
                    # make the outcome "expired"
                    assert result["outcome"] == "failed" and "peer" in result["reason"], result
                no_blocks_held(side)
            hosts.restore()
            connect(d, p)
            move(p, d, "after", seed=2)
            for side in (p, d):
                no_blocks_held(side)
                assert side.ask("stats", cmd="stats")["crashed"] == 0
        finally:
            d.close()
            p.close()
