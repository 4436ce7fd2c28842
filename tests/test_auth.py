"""Secrets never show, MACs bind the whole envelope, old frames cannot be replayed; CURVE keys
come from the secret, the ZAP handler admits only the derived client key, drops are logged sparsely."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import zmq
from zmq.utils import z85

from kvflow.control.auth import ReplayGuard, Secret, secret_from_env
from kvflow.control.hardening import DropLog, curve_keys, zap_reply
from kvflow.errors import ConfigError


def test_secret_from_env_or_file_and_never_shown(tmp_path: Path) -> None:
    key = "correct horse battery staple"
    assert secret_from_env({}) is None
    secret = secret_from_env({"KVFLOW_SECRET": key})
    assert secret is not None and key not in repr(secret) and key not in str(secret)
    (tmp_path / "s").write_text(key + "\n")
    (tmp_path / "s").chmod(0o600)
    from_file = secret_from_env({"KVFLOW_SECRET_FILE": str(tmp_path / "s")})
    assert from_file is not None and from_file.sign(b"x") == secret.sign(b"x")
    with pytest.raises(ConfigError, match="not both"):
        secret_from_env({"KVFLOW_SECRET": key, "KVFLOW_SECRET_FILE": "x"})
    with pytest.raises(ConfigError, match="cannot read") as caught:
        secret_from_env({"KVFLOW_SECRET_FILE": str(tmp_path / "missing")})
    assert key not in str(caught.value)
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        Secret(b"short")


def test_a_secret_file_others_may_read_or_that_is_not_ours_is_refused_naming_why(tmp_path: Path) -> None:
    path = tmp_path / "s"
    path.write_text("correct horse battery staple\n")
    for mode in (0o644, 0o640, 0o604, 0o620, 0o660):
        path.chmod(mode)
        with pytest.raises(ConfigError, match=f"mode {mode:04o} lets other users read or change it: chmod 600"):
            secret_from_env({"KVFLOW_SECRET_FILE": str(path)})
    path.chmod(0o400)
    assert secret_from_env({"KVFLOW_SECRET_FILE": str(path)}) is not None
    link = tmp_path / "link"
    link.symlink_to(path)  # a mounted secret is often a link: what counts is the file it names
    assert secret_from_env({"KVFLOW_SECRET_FILE": str(link)}) is not None
    if os.geteuid() == 0:  # only root can hand a file to another user here
        os.chown(path, 1, 1)
        with pytest.raises(ConfigError, match="owned by uid 1, not by this user"):
            secret_from_env({"KVFLOW_SECRET_FILE": str(link)})


def test_mac_covers_every_byte() -> None:
    secret = Secret(b"0123456789abcdef")
    frame = b"an envelope naming sender, receiver, incarnation and sequence"
    mac = secret.sign(frame)
    assert secret.verify(frame, mac)
    assert not Secret(b"0123456789abcdeX").verify(frame, mac)
    for i in range(len(frame)):
        tampered = bytearray(frame)
        tampered[i] ^= 1
        assert not secret.verify(bytes(tampered), mac)
    assert not secret.verify(frame, mac[:-1])


def test_replay_guard_accepts_only_newer_frames_per_sender() -> None:
    guard = ReplayGuard()
    assert guard.accept("p", 100, 1) and guard.accept("p", 100, 2)
    assert not guard.accept("p", 100, 2) and not guard.accept("p", 100, 1)
    assert guard.accept("d", 5, 1)  # senders are independent
    assert guard.accept("p", 200, 1)  # a restarted peer starts over
    assert not guard.accept("p", 100, 99)  # frames of its old run are replays now
    assert guard.incarnation("p") == 200


def test_replay_guard_is_bounded() -> None:
    guard = ReplayGuard(capacity=3)
    for name in "abcd":
        assert guard.accept(name, 1, 1)
    assert guard.incarnation("a") is None and guard.incarnation("d") == 1


def test_curve_keys_come_from_the_secret_and_zap_admits_only_the_client_key() -> None:
    keys = curve_keys(Secret(b"a shared secret of some length"))
    assert keys == curve_keys(Secret(b"a shared secret of some length"))  # every engine derives the same
    assert keys != curve_keys(Secret(b"another secret of some length!"))
    assert zmq.curve_public(keys.server_secret) == keys.server_public
    assert keys.server_secret.decode() not in repr(keys) and keys.client_secret.decode() not in repr(keys)
    client = z85.decode(keys.client_public)
    request = [b"1.0", b"7", b"kvflow", b"127.0.0.1", b"", b"CURVE", client]
    assert zap_reply(request, frozenset([client])) == ([b"1.0", b"7", b"200", b"OK", b"kvflow", b""], True)
    refused = [
        request[:6] + [z85.decode(keys.server_public)],  # another key
        request[:5] + [b"NULL"],  # another mechanism
        request[:2] + [b"other"] + request[3:],  # another domain
        [b"2.0", *request[1:]],  # another ZAP version
        request[:3],  # too short
        [],
    ]
    for bad in refused:
        reply, admitted = zap_reply(bad, frozenset([client]))
        assert not admitted and reply[2] in (b"400", b"500") and len(reply) == 6


def test_without_a_secret_zap_admits_null_in_kvflows_domain_only() -> None:
    # no secret: ZAP runs only so that a process short of descriptors can refuse handshakes
    request = [b"1.0", b"7", b"kvflow", b"127.0.0.1", b"", b"NULL"]
    assert zap_reply(request, None) == ([b"1.0", b"7", b"200", b"OK", b"kvflow", b""], True)
    for bad in (request[:5] + [b"CURVE", b"k" * 32], request[:2] + [b"other"] + request[3:], request + [b"x"]):
        reply, admitted = zap_reply(bad, None)
        assert not admitted and reply[2] == b"400"


def test_drops_are_logged_once_then_at_most_once_an_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    drops = DropLog("P", interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvflow.control.zeromq"):
        for at in (0.0, 1.0, 2.0, 9.9, 10.5, 11.0):
            now[0] = at
            drops.note("rejected_handshake", "an idle connection")
    assert caplog.text.count("dropped rejected_handshake") == 2
    assert "(3 more since the last report)" in caplog.text
