"""P and D in separate processes: ZeroMQ control plane with a secret, shared-memory data plane.

Real processes, real sockets on 127.0.0.1, real SIGKILL.  Bytes are compared by digest.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from kvflow.control import wire
from kvflow.protocol.messages import Seal, TransferKey, encode_notification
from tests.peer_processes import (
    TRANSPORTS,
    Event,
    PeerProcess,
    kill_prefill_after_registration,
    start_pair,
)


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_two_processes_move_kv_bytes(prefix: str, mode: str, transport: str) -> None:
    p, d = start_pair(prefix, *TRANSPORTS[transport])
    try:
        d.ask("started", cmd="expect", tid="r", epoch=1, peer="P", blocks=[1, 2, 3], mode=mode)
        p.ask("started", cmd="kv_ready", tid="r", epoch=1, blocks=[7, 8, 9], mode=mode, peer="D", seed=11)
        assert d.result("r")["outcome"] == "succeeded"
        assert p.result("r")["outcome"] == "succeeded"
        src = p.ask("digest", cmd="digest", blocks=[7, 8, 9])["sha256"]
        dst = d.ask("digest", cmd="digest", blocks=[1, 2, 3])["sha256"]
        assert src == dst
        for side in (p, d):
            stats = side.ask("stats", cmd="stats")
            assert stats["held_blocks"] == 0 and stats["crashed"] == 0 and stats["control"].get("rejected", 0) == 0
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_sealed_writes_cross_each_transport_and_are_checked(prefix: str, transport: str) -> None:
    """With the integrity check on, each WRITE's notification carries its digests (over 900 bytes
    here, past the 512 a notification held before) through shared memory and NIXL-UCX."""
    blocks, sources = list(range(100)), list(range(100, 200))
    seal = Seal(
        tuple(blocks), None, 0, len(blocks), ((0, 2**64 - 1), (1, 2**64 - 1)), tuple((b, 2**64 - 1) for b in blocks)
    )
    assert len(encode_notification(TransferKey("r", 1), 0, True, seal)) > 900
    p, d = start_pair(prefix, "--integrity", "--blocks", "200", *TRANSPORTS[transport])
    try:
        d.ask("started", cmd="expect", tid="r", epoch=1, peer="P", blocks=blocks, mode="push")
        p.ask("started", cmd="kv_ready", tid="r", epoch=1, blocks=sources, mode="push", peer="D", seed=5)
        decided, sent = d.result("r"), p.result("r")
        assert decided["outcome"] == "succeeded" and sent["outcome"] == "succeeded", (decided, sent)
        stats = d.ask("stats", cmd="stats")
        assert stats["integrity_mismatches"] == 0 and stats["malformed_notifications"] == 0
        assert p.ask("digest", cmd="digest", blocks=sources) == d.ask("digest", cmd="digest", blocks=blocks)
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("transport", ["shm", "nixl-direct"])
def test_killed_prefill_fails_decode_transfers_and_a_restarted_prefill_serves(prefix: str, transport: str) -> None:
    p, d = start_pair(prefix, "--lease", "1.0", "--ttl", "30", *TRANSPORTS[transport])
    try:
        result = kill_prefill_after_registration(p, d, timeout=10)
        # the lease ran out (the 30 s deadline would make it "expired")
        assert result["outcome"] == "failed" and "lost" in result["reason"]
        stats = d.ask("stats", cmd="stats")
        assert stats["held_blocks"] == 0 and stats["quarantined_blocks"] == 0 and stats["peers"] == []
        # a new P process under the same name: a new incarnation, a new association
        p = PeerProcess("P", f"{prefix}-p2", "--lease", "1.0", *TRANSPORTS[transport])
        connected: Event = {"event": "error"}
        give_up = time.monotonic() + 120.0  # a hang guard: a loaded machine may take long
        while time.monotonic() < give_up:  # over NIXL, D refuses P's new association until its grace is over
            connected = d.ask("connected", cmd="connect", peer="P", address=p.address)
            if connected["event"] == "connected":
                break
            time.sleep(0.25)
        assert connected["event"] == "connected", connected
        d.ask("started", cmd="expect", tid="s", epoch=1, peer="P", blocks=[1, 2], mode="push")
        p.ask("started", cmd="kv_ready", tid="s", epoch=1, blocks=[5, 6], mode="push", peer="D", seed=3)
        assert d.result("s")["outcome"] == "succeeded"
        assert p.ask("digest", cmd="digest", blocks=[5, 6]) == d.ask("digest", cmd="digest", blocks=[1, 2])
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("transport", ["shm", "nixl-direct"])
def test_killed_decode_lets_prefill_release_when_the_lease_runs_out(prefix: str, transport: str) -> None:
    p, d = start_pair(prefix, "--lease", "1.0", "--ttl", "30", *TRANSPORTS[transport])
    try:
        d.ask("started", cmd="expect", tid="r", epoch=1, peer="P", blocks=[1], mode="pull")
        d.kill()
        # P becomes ready after D died: it holds its blocks for D, which never reads or renews
        p.ask("started", cmd="kv_ready", tid="r", epoch=1, blocks=[4, 5], mode="pull", peer="D", seed=1)
        assert p.ask("stats", cmd="stats")["held_blocks"] == 2
        released = p.wait(lambda e: e["event"] == "released" and e["tid"] == "r", timeout=10)
        assert sorted(released["blocks"]) == [4, 5]
        # the lease ran out (the 30 s deadline would make it "expired")
        result = p.result("r", timeout=10)
        assert result["outcome"] == "failed" and "lost" in result["reason"]
        stats = p.ask("stats", cmd="stats")
        assert stats["held_blocks"] == 0 and stats["quarantined_blocks"] == 0
    finally:
        p.close()


def test_layout_and_version_mismatch_are_refused_with_the_reason(prefix: str) -> None:
    p = PeerProcess("P", f"{prefix}-p")
    newer = PeerProcess("D", f"{prefix}-d", "--wire-version", str(wire.VERSION + 1))
    try:
        refused = newer.ask("connected", cmd="connect", peer="P", address=p.address, timeout=3)
        assert refused["event"] == "error"
        assert (
            f"speaks control protocol version {wire.VERSION + 1}; this engine speaks {wire.VERSION}" in refused["error"]
        )
    finally:
        newer.close()
    other = PeerProcess("E", f"{prefix}-e", "--dtype", "bfloat16")
    try:
        refused = other.ask("connected", cmd="connect", peer="P", address=p.address, timeout=3)
        assert refused["event"] == "error"
        assert "LayoutMismatch: kv layout mismatch on dtype: local='bfloat16' remote='float16'" in refused["error"]
        assert p.ask("stats", cmd="stats")["peers"] == []
    finally:
        other.close()
        p.close()


def test_a_peer_without_the_secret_gets_nothing_in(prefix: str) -> None:
    p = PeerProcess("P", f"{prefix}-p")
    intruder = PeerProcess("D", f"{prefix}-d", secret="not the secret, but long enough")
    try:
        refused = intruder.ask("connected", cmd="connect", peer="P", address=p.address, timeout=1)
        assert refused["event"] == "error" and "no answer" in refused["error"]
        stats = p.ask("stats", cmd="stats")
        assert stats["peers"] == [] and stats["control"]["rejected_handshake_protocol"] >= 1
    finally:
        intruder.close()
        p.close()


def test_writing_to_a_killed_decode_process_fails_at_once_over_nixl(prefix: str) -> None:
    p, d = start_pair(prefix, "--lease", "30", "--ttl", "30", *TRANSPORTS["nixl-direct"])
    try:
        d.ask("started", cmd="expect", tid="r", epoch=1, peer="P", blocks=[1, 2], mode="push")
        p.stats_when(lambda s: s["live_transfers"] == 1, "P has D's registration")
        d.kill()
        p.ask("started", cmd="kv_ready", tid="r", epoch=1, blocks=[3, 4], mode="push", peer="D", seed=2)
        result = p.result("r", timeout=10)
        # the WRITE itself fails: no wait for the 30 s lease ("lost") or deadline ("expired")
        assert result["outcome"] == "failed" and "TransportError" in result["reason"]
        released = p.wait(lambda e: e["event"] == "released" and e["tid"] == "r", timeout=10)
        assert sorted(released["blocks"]) == [3, 4]
    finally:
        p.close()


def test_a_stopped_decode_and_its_prefill_end_a_written_transfer_with_one_verdict(prefix: str) -> None:
    p, d = start_pair(prefix, "--lease", "1.0", "--fence", "5.0")
    try:
        d.ask("started", cmd="expect", tid="r", epoch=1, peer="P", blocks=[1, 2], mode="push", ttl=1.0)
        p.stats_when(lambda s: s["live_transfers"] == 1, "P has D's registration")
        d.proc.send_signal(signal.SIGSTOP)  # D's deadline passes while it is stopped
        try:
            # P's WRITE lands in D's memory and completes, but D never said it had the KV: when
            # P's lease on D runs out it tears D down and cannot report a success.
            p.ask("started", cmd="kv_ready", tid="r", epoch=1, blocks=[7, 8], mode="push", peer="D", seed=5)
            p_verdict = p.result("r", timeout=15)
        finally:
            d.proc.send_signal(signal.SIGCONT)
        d_verdict = d.result("r", timeout=15)
        assert p_verdict["outcome"] != "succeeded", p_verdict
        assert d_verdict["outcome"] != "succeeded", d_verdict
        # P told D why it tore it down, so D settled with P instead of waiting for its own lease
        stats = d.stats_when(lambda s: s["held_blocks"] == 0 and s["peers"] == [], "D settled with P")
        assert stats["crashed"] == 0
        assert p.ask("stats", cmd="stats")["peers"] == []
    finally:
        d.close()
        p.close()


def test_heartbeats_keep_a_transfer_open_past_its_lease_until_the_last_batch(prefix: str) -> None:
    lease = 1.0
    p, d = start_pair(prefix, "--lease", str(lease), "--ttl", "30")
    try:
        # P's first batch comes with a time-to-live of one lease; D waits for two batches
        first: dict[str, Any] = dict(
            cmd="kv_ready", tid="r", epoch=1, blocks=[5], mode="push", peer="D", seed=4, final=False
        )
        assert p.ask("started", **first, ttl=lease)["event"] == "started"
        d.ask("started", cmd="expect", tid="r", epoch=1, peer="P", blocks=[1, 2], mode="push", batches=2, verify=4)
        opened = time.monotonic()
        # the second batch is late: only D's heartbeats, renewing P's lease, keep P's side open
        p.stats_when(lambda s: time.monotonic() - opened > 2 * lease, "two leases passed", timeout=4 * lease + 10)
        assert p.ask("stats", cmd="stats")["live_transfers"] == 1, p.seen
        last = p.ask("started", cmd="kv_ready", tid="r", epoch=1, blocks=[6], mode="push", peer="D", seed=4, first=1)
        assert last["event"] == "started", last
        assert d.result("r")["verified"] is True
        assert p.result("r")["outcome"] == "succeeded"
        for side in (p, d):
            side.stats_when(lambda s: s["held_blocks"] == 0 and s["quarantined_blocks"] == 0, "blocks released")
    finally:
        d.close()
        p.close()
