"""Frame authentication for the control plane: a shared secret, an HMAC per frame, replay guard.

Why: no peer system we know authenticates its KV side channel, yet whoever can send frames to it
can make an engine write KV into chosen blocks or release them.  Every frame carries
HMAC-SHA256(secret, envelope bytes); the envelope names sender, receiver, the sender's
incarnation and a sequence number, so a captured frame cannot be replayed, redirected to another
engine, or passed off as another sender's.

The secret comes from `KVFLOW_SECRET` or from the file named by `KVFLOW_SECRET_FILE`.  It is never
logged or shown in a repr.  Without one, frames are not authenticated; the control channel allows
that only on loopback and says so in a warning.  A secret file another user owns, or that others
may read or change (any group or other bit in its mode), is refused: whoever can read it can
forge every frame, and whoever can write it chooses the key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from kvflow.errors import ConfigError

__all__ = ("MAC_BYTES", "ReplayGuard", "Secret", "secret_from_env")

MAC_BYTES = 32
MIN_SECRET_BYTES = 16


class Secret:
    """A shared key for HMAC-SHA256.  Its repr hides the key."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_SECRET_BYTES:
            raise ConfigError(f"control-plane secret must be at least {MIN_SECRET_BYTES} bytes")
        self._key = bytes(key)

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    def sign(self, frame: bytes) -> bytes:
        return hmac.new(self._key, frame, hashlib.sha256).digest()

    def verify(self, frame: bytes, mac: bytes) -> bool:
        return len(mac) == MAC_BYTES and hmac.compare_digest(self.sign(frame), mac)

    def derive(self, label: bytes) -> bytes:
        """32 bytes for `label`, derived from the key by HKDF-SHA256 (RFC 5869, one block): the
        same on every engine holding the secret, and telling nothing about the key itself."""
        prk = hmac.new(b"kvflow control plane", self._key, hashlib.sha256).digest()
        return hmac.new(prk, label + b"\x01", hashlib.sha256).digest()


def secret_from_env(environ: Mapping[str, str] | None = None) -> Secret | None:
    """`KVFLOW_SECRET` (the key itself) or `KVFLOW_SECRET_FILE` (a file holding it), else None.

    :raises ConfigError: both are set, the file cannot be read, is not this user's own or is
        open to others (see the module's header), or the key is too short.
    """
    env = os.environ if environ is None else environ
    value, path = env.get("KVFLOW_SECRET"), env.get("KVFLOW_SECRET_FILE")
    if value and path:
        raise ConfigError("set KVFLOW_SECRET or KVFLOW_SECRET_FILE, not both")
    if value:
        return Secret(value.encode())
    if path:
        try:
            with Path(path).open("rb") as file:
                problem = _exposed(os.fstat(file.fileno()))  # the file read, not what the name meant before
                key = file.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read KVFLOW_SECRET_FILE: {exc.strerror}") from None
        if problem is not None:
            raise ConfigError(f"KVFLOW_SECRET_FILE {path}: {problem}")
        return Secret(key)
    return None


def _exposed(info: os.stat_result) -> str | None:
    """Why a secret file with these attributes is not a secret (None: it is)."""
    if info.st_uid != os.geteuid():
        return f"owned by uid {info.st_uid}, not by this user (uid {os.geteuid()}): use a file of your own"
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        return f"mode {mode:04o} lets other users read or change it: chmod 600"
    return None


class ReplayGuard:
    """Per sender: the newest incarnation seen and the last sequence number accepted in it.

    At most `capacity` senders are remembered (the least recently heard is forgotten first), so
    that a flood of made-up sender names cannot grow it without bound.
    """

    def __init__(self, capacity: int = 65_536) -> None:
        self._seen: dict[str, tuple[int, int]] = {}
        self._capacity = capacity

    def accept(self, sender: str, incarnation: int, seq: int) -> bool:
        """True (and remembered) for a frame newer than anything seen from `sender`."""
        current = self._seen.pop(sender, None)
        if current is not None:
            known, last = current
            if incarnation < known or (incarnation == known and seq <= last):
                self._seen[sender] = current
                return False
        elif len(self._seen) >= self._capacity:
            del self._seen[next(iter(self._seen))]
        self._seen[sender] = (incarnation, seq)  # re-inserted: most recently heard last
        return True

    def incarnation(self, sender: str) -> int | None:
        current = self._seen.get(sender)
        return current[0] if current else None
