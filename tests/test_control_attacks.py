"""Attacks by a stranger (no secret) on a live engine in its own process, while a real transfer runs.

Each test runs one attack of `kvflow_tools.testing.fuzz` at small scale against P of a real P/D pair of
processes (ZeroMQ control plane with a secret, shared-memory data plane), then checks that a real
transfer completes with the right bytes, that P's memory and descriptors stayed bounded (read
from /proc), and that what was dropped is counted.  The figures each test prints (`-s`) are the
attack's rate, the transfer's latency and P's memory and descriptors at the end.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest

from kvflow_tools.testing import fuzz
from tests.peer_processes import ROOT, SECRET, PeerProcess, start_pair

MiB = 1 << 20


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Peak:
    """The highest RSS and descriptor count of a process, sampled on a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.rss = self.fds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            try:
                self.rss, self.fds = max(self.rss, rss(self.pid)), max(self.fds, fds(self.pid))
            except (OSError, AssertionError):  # the process is gone, or a zombie
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def attack(run: Callable[[], fuzz.AttackStats]) -> Iterator[Future[fuzz.AttackStats]]:
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(run)


def transfer(p: PeerProcess, d: PeerProcess, tid: str, seed: int) -> float:
    """A push of two blocks from P to D with the bytes checked; its latency in seconds."""
    d.ask("started", cmd="expect", tid=tid, epoch=1, peer="P", blocks=[1, 2], mode="push")
    start = time.monotonic()
    p.ask("started", cmd="kv_ready", tid=tid, epoch=1, blocks=[5, 6], mode="push", peer="D", seed=seed)
    decided = d.result(tid, timeout=20)
    assert decided["outcome"] == "succeeded", decided  # (the reason, when it failed)
    latency = time.monotonic() - start
    sent = p.result(tid, timeout=20)
    assert sent["outcome"] == "succeeded", sent
    assert (
        p.ask("digest", cmd="digest", blocks=[5, 6])["sha256"] == d.ask("digest", cmd="digest", blocks=[1, 2])["sha256"]
    )
    return latency


def handshakes_refused(stats: dict[str, Any]) -> int:
    return sum(v for k, v in stats["control"].items() if k.startswith("rejected_handshake"))


def report(name: str, stats: fuzz.AttackStats, latency: float, p: PeerProcess, control: dict[str, Any]) -> None:
    pid = p.proc.pid
    drops = {k: v for k, v in control.items() if k.startswith(("rejected", "accept_failed")) and v}
    sys.stdout.write(
        f"\n{name}: sent {stats.sent} in {stats.duration:.2f}s ({stats.rate:.0f}/s), refused {stats.refused};"
        f" transfer {latency * 1000:.0f} ms; P rss {rss(pid) / MiB:.0f} MiB, fds {fds(pid)}; drops {drops}\n"
    )


def test_an_unfinished_multipart_message_is_not_kept(prefix: str) -> None:
    p, d = start_pair(prefix)
    try:
        base = rss(p.proc.pid)
        peak = Peak(p.proc.pid)
        d.ask("started", cmd="expect", tid="r", epoch=1, peer="P", blocks=[1, 2], mode="push")
        with attack(lambda: fuzz.unfinished_multipart(p.address, parts=2048, part_bytes=64 * 1024)) as running:
            stats = running.result(timeout=60)  # 128 MiB in one message that never ends
        start = time.monotonic()
        p.ask("started", cmd="kv_ready", tid="r", epoch=1, blocks=[5, 6], mode="push", peer="D", seed=1)
        assert d.result("r", timeout=20)["outcome"] == "succeeded"
        latency = time.monotonic() - start
        peak.stop()
        assert peak.rss - base < 32 * MiB, f"P grew by {(peak.rss - base) / MiB:.0f} MiB"
        control = p.stats_when(lambda s: handshakes_refused(s) >= 1, "the attack is counted")["control"]
        assert control["frames_received"] == control["messages_delivered"]  # nothing of the stranger was read
        assert transfer(p, d, "s", seed=2) > 0
        report("unfinished multipart", stats, latency, p, control)
    finally:
        d.close()
        p.close()


def test_a_flood_of_badly_signed_frames_does_not_starve_heartbeats(prefix: str) -> None:
    p, d = start_pair(prefix, "--lease", "1.0", "--ttl", "30")
    try:
        peak = Peak(p.proc.pid)
        base = rss(p.proc.pid)
        d.ask("started", cmd="expect", tid="r", epoch=1, peer="P", blocks=[1, 2], mode="push")
        # above what HMAC-SHA256 checks in a second: 1,200 frames of 1 MiB in well under a second
        with attack(lambda: fuzz.bad_mac_flood(p.address, frames=1200, seconds=30.0)) as running:
            stats = running.result(timeout=60)
        start = time.monotonic()
        p.ask("started", cmd="kv_ready", tid="r", epoch=1, blocks=[5, 6], mode="push", peer="D", seed=1)
        result = d.result("r", timeout=20)
        assert result["outcome"] == "succeeded", result  # no heartbeat was missed: P and D stay associated
        latency = time.monotonic() - start
        peak.stop()
        control = p.stats_when(lambda s: handshakes_refused(s) >= stats.refused >= 1, "counted")["control"]
        assert control.get("rejected_bad_mac", 0) == 0  # not one was read, let alone checked
        assert peak.rss - base < 64 * MiB, f"P grew by {(peak.rss - base) / MiB:.0f} MiB"
        assert p.ask("stats", cmd="stats")["peers"] == ["D"]
        report("bad-MAC flood", stats, latency, p, control)
    finally:
        d.close()
        p.close()


@contextmanager
def fd_limit(limit: int) -> Iterator[None]:
    """Children started inside inherit a descriptor limit of `limit`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


FLOOD_DESCRIPTORS = 4096  # the flooding process's limit
FLOOD_CONNECTIONS = 3000  # what it opens, and holds until P closes them


@pytest.mark.system
def test_idle_connections_do_not_take_every_descriptor(prefix: str) -> None:
    limit = 400
    with fd_limit(limit):
        p = PeerProcess("P", f"{prefix}-p")
    d = PeerProcess("D", f"{prefix}-d")
    try:
        peak = Peak(p.proc.pid)
        halfway = threading.Event()
        # 100 idle connections a second for 8 s: twice the limit, were each kept until it ends
        flood = lambda: fuzz.connection_flood(p.address, connections=800, per_second=100, hold=10, halfway=halfway)  # noqa: E731
        with attack(flood) as running:
            assert halfway.wait(30)
            # a real peer connects in the middle of the flood, and moves KV
            assert d.ask("connected", cmd="connect", peer="P", address=p.address)["event"] == "connected"
            latency = transfer(p, d, "r", seed=1)
            stats = running.result(timeout=60)
        peak.stop()
        assert peak.fds < limit - 50, f"P held {peak.fds} descriptors of {limit}"
        control = p.ask("stats", cmd="stats")["control"]
        assert control["rejected_handshake"] >= stats.refused // 2  # closed by P, and counted
        assert control.get("accept_failed", 0) == 0
        report("connection flood", stats, latency, p, control)
    finally:
        d.close()
        p.close()


@pytest.mark.system
def test_a_genuine_peer_associates_during_a_flood_as_fast_as_a_process_can_open_connections(prefix: str) -> None:
    # P starts with the soft limit many hosts default to (1,024): the flood (its own process, raw
    # TCP connects as fast as it can) holds more at once than that.  P must not run out of
    # descriptors (its accepts would fail, it could not open a socket to D), and a real peer must
    # associate and move KV in the middle of the flood.  How many P holds at once must not hang
    # on how fast this machine opens connections (rate times the handshake timeout; CI once saw
    # a flood end before P held 900): each connection is held until P closes it, P gives a
    # stranger 60 s to authenticate, and the flood stops only when this test closes its stdin.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2 * FLOOD_DESCRIPTORS:
        pytest.skip(f"a hard descriptor limit of {hard} leaves P no room above the flood's {FLOOD_DESCRIPTORS}")
    with fd_limit(1024):
        p = PeerProcess("P", f"{prefix}-p", "--handshake-timeout", "60")
    d = PeerProcess("D", f"{prefix}-d")
    with fd_limit(FLOOD_DESCRIPTORS):  # the attacker's own: what it can hold open
        flood = subprocess.Popen(
            [sys.executable, "-m", "kvflow_tools.testing.fuzz_process", "--address", p.address]
            + ["--scale", str(FLOOD_CONNECTIONS), "--hold", "inf", "--until-stdin-closes"]
            + ["--attack", "connection_flood"],
            cwd=ROOT,
            env=dict(os.environ, KVFLOW_SECRET=SECRET),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    try:
        peak = Peak(p.proc.pid)
        assert flood.stdin is not None and flood.stdout is not None
        assert json.loads(flood.stdout.readline())["event"] == "begin"
        deadline = time.monotonic() + 120  # 2,000 connections: 17 a second would do
        while peak.fds < 2000 and flood.poll() is None:  # well past the 1,024 P started with
            assert time.monotonic() < deadline, f"P holds {peak.fds} descriptors"
            time.sleep(0.01)
        assert flood.poll() is None, f"the flood ended before P held 2,000 descriptors: {flood.stdout.read()}"
        connected = d.ask("connected", 40, cmd="connect", peer="P", address=p.address, timeout=30.0)
        assert connected["event"] == "connected", connected
        latency = transfer(p, d, "r", seed=1)
        during = peak.fds
        flood.stdin.close()  # the flood stops, and closes what it holds
        end = json.loads(flood.stdout.readline())
        assert flood.wait(timeout=60) == 0
        peak.stop()
        control = p.ask("stats", cmd="stats")["control"]
        assert control.get("accept_failed", 0) == 0, f"P ran out of descriptors ({peak.fds} at the peak)"
        stats = fuzz.AttackStats("connection_flood", end["sent"], end["refused"], end["duration"])
        report(f"connection flood (P at {during} fds meanwhile, {peak.fds} at the peak)", stats, latency, p, control)
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait(timeout=10)
        for pipe in (flood.stdin, flood.stdout):
            if pipe is not None:
                pipe.close()
        d.close()
        p.close()


def test_a_stranger_cannot_squat_a_peers_identity(prefix: str) -> None:
    p = PeerProcess("P", f"{prefix}-p")
    d = PeerProcess("D", f"{prefix}-d")
    try:
        holding = threading.Event()
        with attack(lambda: fuzz.squat_identity(p.address, b"D", hold=3.0, settle=1.0, holding=holding)) as running:
            assert holding.wait(30)  # a stranger took the name "D" first
            assert d.ask("connected", cmd="connect", peer="P", address=p.address)["event"] == "connected"
            latency = transfer(p, d, "r", seed=1)
            stats = running.result(timeout=60)
        assert transfer(p, d, "s", seed=2) > 0  # and after the stranger left
        stats_p = p.stats_when(lambda s: handshakes_refused(s) >= 1, "the squatter is counted")
        control = stats_p["control"]
        report("identity squatting", stats, latency, p, control)
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("curve", [True, False], ids=["curve", "hmac-only"])
def test_frames_recorded_earlier_are_refused_by_a_restarted_engine(prefix: str, curve: bool) -> None:
    # With CURVE, the attack fails at the handshake.  Without it ("hmac-only", also how every
    # engine ran before CURVE), the replayed opening Hello is read: that case pins down what it
    # can still do (no transfer kept, no crash, no association past the lease); it held before too.
    # A lease of 2 s (the ghost association below lasts that long): with 1 s the genuine transfer
    # at the end failed once beside other tests on 2 cores, its reason unrecorded (`transfer`
    # now says it); heartbeats a second late on a starved machine are the likeliest cause.
    extra = ("--lease", "2.0") if curve else ("--lease", "2.0", "--no-curve")
    p = PeerProcess("P", f"{prefix}-p", *extra)
    d = PeerProcess("D", f"{prefix}-d", *extra)
    # The attacker on the path records D's opening connection (D's Hello: P's answer names P's
    # own address, where D's later frames go; `test_control.py` replays those).
    proxy = fuzz.RecordingProxy(p.address)
    try:
        assert d.ask("connected", cmd="connect", peer="P", address=proxy.address)["event"] == "connected"
        transfer(p, d, "r", seed=1)
        p.kill()
        d.kill()
        p = PeerProcess("P", f"{prefix}-p2", *extra)
        stats = fuzz.replay(p.address, proxy.streams, hold=0.5)
        if curve:  # an old session's stream does not pass the handshake: not one frame is read
            first = p.stats_when(lambda s: s["control"].get("frames_received", 0) + handshakes_refused(s) > 0, "P acts")
            assert first["control"].get("frames_received", 0) == 0
            assert handshakes_refused(first) >= 1 and stats.refused >= 1
        else:  # the opening Hello is all an opening may carry; P answers it and keeps nothing else
            first = p.stats_when(lambda s: s["control"].get("messages_delivered", 0) >= 1, "the Hello is read")
            assert first["control"]["messages_delivered"] == 1
        assert first["live_transfers"] == 0 and first["crashed"] == 0
        # whatever association the replayed Hello opened ends with the lease: the recorded D is gone
        after = p.stats_when(lambda s: s["peers"] == [], "no association with the recorded D")
        assert after["crashed"] == 0 and after["held_blocks"] == 0
        d = PeerProcess("D", f"{prefix}-d2", *extra)
        assert d.ask("connected", cmd="connect", peer="P", address=p.address)["event"] == "connected"
        latency = transfer(p, d, "s", seed=2)
        report(f"replay ({'curve' if curve else 'hmac only'})", stats, latency, p, after["control"])
    finally:
        proxy.close()
        d.close()
        p.close()
