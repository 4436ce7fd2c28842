"""Two hosts on one machine: two network namespaces joined by a veth pair whose link can be cut.

Why: a link that goes down between P and D (a switch port, a cable, a partition) is a failure a
single host never shows: sockets stay open, nothing is refused, packets just stop.  Network
namespaces give each engine its own interface and address, so the control plane (ZeroMQ over TCP)
and NIXL-UCX over TCP really cross a link that a test or the soak can take down and bring back.
Creating namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN); `unavailable()` says why not.

    with TwoHosts() as hosts:
        hosts.command("p")      # the argv prefix that runs a program on host p
        hosts.address("d")      # 10.231.0.2
        hosts.device("d")       # the veth end inside host d, for UCX_NET_DEVICES
        hosts.cut(); hosts.restore()
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from types import TracebackType

from kvflow.errors import ConfigError

__all__ = ("TwoHosts", "unavailable")

_ADDRESSES = {"p": "10.231.0.1", "d": "10.231.0.2"}


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


def unavailable() -> str | None:
    """Why two namespaces cannot be made here (no `ip` command, not permitted), or None."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"kvflow-probe-{uuid.uuid4().hex[:8]}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
    _ip("netns", "delete", probe)
    return None


class TwoHosts:
    """Namespaces ``<tag>-p`` and ``<tag>-d``, veth ends ``<tag>p``/``<tag>d`` with 10.231.0.1/2.

    Everything made is removed on exit, also when the body raised.
    """

    def __init__(self, tag: str | None = None) -> None:
        self.tag = tag or f"kv{uuid.uuid4().hex[:6]}"
        self.namespaces = {side: f"{self.tag}-{side}" for side in ("p", "d")}
        self.devices = {side: f"{self.tag}{side}" for side in ("p", "d")}

    def __enter__(self) -> TwoHosts:
        """:raises ConfigError: a namespace, the link or an address could not be set up."""
        try:
            for ns in self.namespaces.values():
                self._run("netns", "add", ns)
            p, d = self.devices["p"], self.devices["d"]
            self._run("link", "add", p, "netns", self.namespaces["p"], "type", "veth", "peer", d)
            self._run("link", "set", d, "netns", self.namespaces["d"])
            for side, ns in self.namespaces.items():
                self._run("-n", ns, "addr", "add", f"{_ADDRESSES[side]}/24", "dev", self.devices[side])
                self._run("-n", ns, "link", "set", self.devices[side], "up")
                self._run("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Delete both namespaces (the veth pair goes with them).  Never raises."""
        for ns in self.namespaces.values():
            _ip("netns", "delete", ns)

    def command(self, side: str) -> list[str]:
        """The argv prefix that runs a program inside host `side` ("p" or "d")."""
        return ["ip", "netns", "exec", self.namespaces[side]]

    def address(self, side: str) -> str:
        return _ADDRESSES[side]

    def device(self, side: str) -> str:
        return self.devices[side]

    def cut(self) -> None:
        """Take the link down (P's end): packets stop both ways, sockets stay open.

        :raises ConfigError: the link could not be changed.
        """
        self._run("-n", self.namespaces["p"], "link", "set", self.devices["p"], "down")

    def restore(self) -> None:
        """Bring the link back up.

        :raises ConfigError: the link could not be changed.
        """
        self._run("-n", self.namespaces["p"], "link", "set", self.devices["p"], "up")

    def _run(self, *args: str) -> None:
        done = _ip(*args)
        if done.returncode != 0:
            raise ConfigError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
