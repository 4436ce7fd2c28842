"""Which engines an engine may associate with, and which control addresses it may dial.

Why: the peer an engine talks to is named from outside.  D learns P's engine id and control
address from a request's ``kv_transfer_params``, which any HTTP client of vLLM's server writes;
an engine answers a Hello at the control address the Hello names, which any holder of the
secret writes.  Without a list of what the deployment permits, one request makes D dial any
host and port it names (a port scan or a connection flood by proxy), and a Hello makes an
engine answer wherever its sender likes.  So both ends check the pair (engine id, address)
against an allow-list before anything is dialled or kept: engine ids by shell-style patterns,
addresses by networks.

The default permits every engine id and the networks no public route reaches: loopback,
link-local, private (RFC 1918, RFC 4193) and shared (RFC 6598) addresses.  A deployment lists
its own engines or networks to narrow it (``EngineConfig.allowed_peers``; the vLLM connector's
``allowed_peers`` and ``allowed_networks`` settings).  Pure: no lookup, no clock.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass
from fnmatch import fnmatchcase

from kvflow.errors import ConfigError

__all__ = ("DEFAULT_NETWORKS", "PeerAllowList")

DEFAULT_NETWORKS = (
    "127.0.0.0/8",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "169.254.0.0/16",
    "::1/128",
    "fc00::/7",
    "fe80::/10",
)
MAX_ENTRIES = 1024  # patterns or networks in one list: what a deployment could mean to write
MAX_PATTERN = 128  # an engine id is at most this long, so a longer pattern is a mistake

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@functools.lru_cache(maxsize=64)
def _networks(entries: tuple[str, ...]) -> tuple[Network, ...]:
    """:raises ConfigError: an entry that is not a network in CIDR notation (host bits unset)."""
    out = []
    for entry in entries:
        try:
            out.append(ipaddress.ip_network(entry, strict=True))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"allowed network {entry!r:.80} is not a network in CIDR notation: {exc}") from None
    return tuple(out)


@dataclass(frozen=True, slots=True)
class PeerAllowList:
    """The engines (shell-style patterns of engine ids, `fnmatch`) and the networks of control
    addresses an engine may associate with.  ``ipc://`` and ``inproc://`` addresses, and none
    at all (an in-process channel), are this host's own and always permitted."""

    engines: tuple[str, ...] = ("*",)
    networks: tuple[str, ...] = DEFAULT_NETWORKS

    def __post_init__(self) -> None:
        """:raises ConfigError: an empty list, too many entries, a pattern that is not a
        non-empty string of at most 128 characters, or a network that does not parse."""
        for name, entries in (("allowed_peers", self.engines), ("allowed_networks", self.networks)):
            if not isinstance(entries, tuple) or not 1 <= len(entries) <= MAX_ENTRIES:
                raise ConfigError(f"{name} must list 1 to {MAX_ENTRIES} entries")
        for pattern in self.engines:
            if not isinstance(pattern, str) or not 1 <= len(pattern) <= MAX_PATTERN:
                raise ConfigError(f"allowed peer {pattern!r:.80} must be a pattern of 1 to {MAX_PATTERN} characters")
        _networks(self.networks)

    def problem(self, engine_id: str, address: str = "") -> str | None:
        """Why `engine_id`, reached at control address `address`, is not a permitted peer, or
        None when it is.  `address` is ``tcp://IP:PORT`` as the control channel takes it (a
        ``tcp://`` address whose host is not a literal IP is refused).  Never raises."""
        if not any(fnmatchcase(engine_id, pattern) for pattern in self.engines):
            return f"engine {engine_id!r} is not among the allowed peers {list(self.engines)[:8]}"
        if not address.startswith("tcp://"):
            return None
        host = address.removeprefix("tcp://").rpartition(":")[0].removeprefix("[").removesuffix("]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return f"control address {address!r:.80} does not name a literal IP"
        if not any(ip.version == net.version and ip in net for net in _networks(self.networks)):
            return f"control address {address!r:.80} is outside the allowed networks {list(self.networks)[:8]}"
        return None
