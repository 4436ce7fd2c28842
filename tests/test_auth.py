"""Secrets never show, MACs bind the whole envelope, old frames cannot be replayed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.control.auth import ReplayGuard, Secret, secret_from_env
from kvflow.errors import ConfigError


def test_secret_from_env_or_file_and_never_shown(tmp_path: Path) -> None:
    key = "correct horse battery staple"
    assert secret_from_env({}) is None
    secret = secret_from_env({"KVFLOW_SECRET": key})
    assert secret is not None and key not in repr(secret) and key not in str(secret)
    (tmp_path / "s").write_text(key + "\n")
    from_file = secret_from_env({"KVFLOW_SECRET_FILE": str(tmp_path / "s")})
    assert from_file is not None and from_file.sign(b"x") == secret.sign(b"x")
    with pytest.raises(ConfigError, match="not both"):
        secret_from_env({"KVFLOW_SECRET": key, "KVFLOW_SECRET_FILE": "x"})
    with pytest.raises(ConfigError, match="cannot read") as caught:
        secret_from_env({"KVFLOW_SECRET_FILE": str(tmp_path / "missing")})
    assert key not in str(caught.value)
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        Secret(b"short")


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
