"""Hosts on one machine: network namespaces joined by veth links that can be cut.

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

`BridgedHosts` puts any number of namespaces on one bridge in this namespace, so that a program
here (a router, a test) reaches each of them too; the hosts reach each other across the bridge.
The bridge takes a /24 of 10.232.0.0/16 that no route here covers yet: a bridge left behind by a
killed run (its namespaces and routes outlive the process) would otherwise take the new hosts'
traffic, and nothing would answer.

    with BridgedHosts(["p", "d"]) as hosts:
        hosts.address("p")      # 10.232.N.1; this namespace is 10.232.N.254 on the bridge
"""

from __future__ import annotations

import ipaddress
import random
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Self

from kvflow.errors import ConfigError

__all__ = ("BridgedHosts", "TwoHosts", "free_subnet", "unavailable")

_ADDRESSES = {"p": "10.231.0.1", "d": "10.231.0.2"}
_BRIDGED_POOL = ipaddress.IPv4Network("10.232.0.0/16")


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


class _Namespaces:
    """What both kinds of hosts share: one namespace, interface and address per host name, and
    their removal on exit, also when the body raised."""

    def __init__(self, tag: str | None, names: list[str]) -> None:
        self.tag = tag or f"kv{uuid.uuid4().hex[:6]}"
        self.names = list(names)
        self.namespaces = {name: f"{self.tag}-{name}" for name in names}
        self.devices: dict[str, str] = {}
        self.addresses: dict[str, str] = {}

    def __enter__(self) -> Self:
        """:raises ConfigError: a namespace, a link or an address could not be set up."""
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _make(self) -> None:
        raise NotImplementedError

    def _bring_up(self, name: str) -> None:
        """Host `name`'s address on its interface, and the interface and loopback up, in its namespace."""
        ns, device = self.namespaces[name], self.devices[name]
        _run("-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", device)
        _run("-n", ns, "link", "set", device, "up")
        _run("-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Delete every namespace (the veth pairs go with them).  Never raises."""
        for ns in self.namespaces.values():
            _ip("netns", "delete", ns)

    def command(self, name: str) -> list[str]:
        """The argv prefix that runs a program inside host `name`."""
        return ["ip", "netns", "exec", self.namespaces[name]]

    def address(self, name: str) -> str:
        return self.addresses[name]

    def device(self, name: str) -> str:
        """Host `name`'s interface (inside its namespace), for UCX_NET_DEVICES."""
        return self.devices[name]


class TwoHosts(_Namespaces):
    """Namespaces ``<tag>-p`` and ``<tag>-d``, veth ends ``<tag>p``/``<tag>d`` with 10.231.0.1/2.

    Everything made is removed on exit, also when the body raised.
    """

    def __init__(self, tag: str | None = None) -> None:
        super().__init__(tag, ["p", "d"])
        self.devices = {side: f"{self.tag}{side}" for side in ("p", "d")}
        self.addresses = dict(_ADDRESSES)

    def _make(self) -> None:
        for ns in self.namespaces.values():
            _run("netns", "add", ns)
        p, d = self.devices["p"], self.devices["d"]
        _run("link", "add", p, "netns", self.namespaces["p"], "type", "veth", "peer", d)
        _run("link", "set", d, "netns", self.namespaces["d"])
        for side in self.namespaces:
            self._bring_up(side)

    def cut(self) -> None:
        """Take the link down (P's end): packets stop both ways, sockets stay open.

        :raises ConfigError: the link could not be changed.
        """
        _run("-n", self.namespaces["p"], "link", "set", self.devices["p"], "down")

    def restore(self) -> None:
        """Bring the link back up.

        :raises ConfigError: the link could not be changed.
        """
        _run("-n", self.namespaces["p"], "link", "set", self.devices["p"], "up")


class BridgedHosts(_Namespaces):
    """Namespaces ``<tag>-<name>``, each with a veth end ``<tag><i>`` (10.232.N.<i+1>/24) whose
    other end is on the bridge ``<tag>br`` (10.232.N.254) in this namespace, N picked at random
    among the /24s no route here covers (`free_subnet`).  Addresses are known once entered.

    Everything made is removed on exit, also when the body raised.
    """

    def __init__(self, names: list[str], tag: str | None = None) -> None:
        """:raises ConfigError: no names, a name twice, or more than a /24 holds."""
        if not names or len(set(names)) != len(names) or len(names) > 250:
            raise ConfigError(f"bridged hosts need 1..250 distinct names, not {names}")
        super().__init__(tag, names)
        self.bridge = f"{self.tag}br"
        self.devices = {name: f"{self.tag}{index}" for index, name in enumerate(names)}
        self.here = ""  # this namespace's address on the bridge, once made

    def _make(self) -> None:
        subnet = free_subnet(_networks_in_use())
        self.here = str(subnet.network_address + 254)
        self.addresses = {name: str(subnet.network_address + index + 1) for index, name in enumerate(self.names)}
        _run("link", "add", self.bridge, "type", "bridge")
        _run("addr", "add", f"{self.here}/24", "dev", self.bridge)
        _run("link", "set", self.bridge, "up")
        for name, ns in self.namespaces.items():
            device, outside = self.devices[name], f"{self.devices[name]}h"
            _run("netns", "add", ns)
            _run("link", "add", device, "netns", ns, "type", "veth", "peer", outside)
            _run("link", "set", outside, "master", self.bridge, "up")
            self._bring_up(name)
        # another run may have taken the same /24 between the look and the bridge: then the
        # kernel routes it to the bridge made first, and these hosts are out of reach
        route = _ip("route", "get", self.addresses[self.names[0]]).stdout
        if f" dev {self.bridge} " not in f" {route} ":
            raise ConfigError(f"{subnet} is routed past bridge {self.bridge}: {route.strip()}")

    def close(self) -> None:
        """Delete every namespace and the bridge.  Never raises."""
        super().close()
        _ip("link", "delete", self.bridge)

    def sent_bytes(self, name: str) -> int:
        """Bytes host `name` has sent on its interface so far.

        :raises ConfigError: the counter could not be read.
        """
        path = f"/sys/class/net/{self.devices[name]}/statistics/tx_bytes"
        done = subprocess.run(
            [*self.command(name), "cat", path], capture_output=True, text=True, timeout=30, check=False
        )
        if done.returncode != 0 or not done.stdout.strip().isdigit():
            raise ConfigError(f"cannot read {path} in {self.namespaces[name]}: {done.stderr.strip()}")
        return int(done.stdout)


def _run(*args: str) -> None:
    done = _ip(*args)
    if done.returncode != 0:
        raise ConfigError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def free_subnet(
    in_use: Iterable[ipaddress.IPv4Network],
    choose: Callable[[Sequence[ipaddress.IPv4Network]], ipaddress.IPv4Network] = random.choice,
) -> ipaddress.IPv4Network:
    """A /24 of 10.232.0.0/16 that overlaps none of the networks `in_use`, picked by `choose`
    (at random by default, so that runs starting together seldom pick the same one).

    :raises ConfigError: every /24 of the pool overlaps one in use.
    """
    taken = [network for network in in_use if network.overlaps(_BRIDGED_POOL)]
    free = [subnet for subnet in _BRIDGED_POOL.subnets(new_prefix=24) if not any(subnet.overlaps(n) for n in taken)]
    if not free:
        raise ConfigError(f"every /24 of {_BRIDGED_POOL} is routed already: {sorted(map(str, taken))}")
    return choose(free)


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """The destinations of this namespace's IPv4 routes (every table) and its interfaces' networks.

    :raises ConfigError: `ip` could not list them.
    """
    found: list[ipaddress.IPv4Network] = []
    for args in (("-4", "route", "show", "table", "all"), ("-4", "-o", "addr", "show")):
        done = _ip(*args)
        if done.returncode != 0:
            raise ConfigError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
        for word in done.stdout.split():
            if word[:1].isdigit() and "." in word:
                try:
                    found.append(ipaddress.IPv4Network(word, strict=False))
                except ValueError:
                    continue  # a number that is not an address (a metric, a lifetime)
    return found
