"""Winding an engine's transfers down, and letting go of its KV memory's registration and taking it up again.

Why: an RL post-training loop puts vLLM to sleep between rollouts, and vLLM's sleep mode frees
the KV cache's physical memory (keeping its virtual addresses).  A registration with the
transport, and the remote keys peers hold for it, must not outlive that memory: before the
sleep every transfer of the engine ends (failed, with the reason given: vLLM says they are
drained, which is not taken on trust), every peer is told Goodbye and removed from the
transport, and the memory is deregistered; while asleep, transfers and handshakes are refused
(`EngineAsleep`; a peer's Hello gets a Reject naming the reason).  On wake-up the same regions
are registered again, the transport's new metadata goes into every Hello from then on, and
peers associate again on their next transfer.

Closing winds transfers down the same way (`wind_down`), so the engine's `aclose` uses it too.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from kvflow.errors import EngineAsleep
from kvflow.layout import KVLayout
from kvflow.protocol.endpoint import Effect, Endpoint
from kvflow.runtime.peering import PeerExecutor
from kvflow.transports.base import Transport

__all__ = ("ASLEEP", "MemoryRegistration")

log = logging.getLogger(__name__)

ASLEEP = "engine asleep: its KV memory is unregistered (vLLM sleep mode)"


class MemoryRegistration:
    """One engine's KV memory registration with its transport, and its transfers' wind-down.
    `run`, `now`, `wait_idle`: the engine's (execute the endpoint's effects; its clock; wait,
    bounded, until no transfer is live)."""

    def __init__(
        self,
        layout: KVLayout,
        transport: Transport,
        endpoint: Endpoint,
        peers: PeerExecutor,
        run: Callable[[list[Effect]], None],
        now: Callable[[], float],
        wait_idle: Callable[[float], Awaitable[None]],
    ) -> None:
        self.layout = layout
        self.transport = transport
        self.endpoint = endpoint
        self.peers = peers
        self.run = run
        self.now = now
        self.wait_idle = wait_idle
        self.asleep = ""  # why the memory is unregistered; empty: it is registered

    def check_awake(self, engine_id: str) -> None:
        """:raises EngineAsleep: the memory is unregistered (the message gives the reason)."""
        if self.asleep:
            raise EngineAsleep(f"engine {engine_id!r} refuses new work: {self.asleep}")

    async def wind_down(self, reason: str, drain: float, fence_timeout: float) -> None:
        """Let transfers finish for `drain` seconds, abort the rest for `reason`, wait up to
        `fence_timeout` for their fences, tear down every peer if one never comes (none of
        them then gets a Goodbye), and wait for the peer removals under way.  Never raises."""
        await self.wait_idle(drain)
        if self.endpoint.live():
            self.run(self.endpoint.abort_all(self.now(), reason))
            await self.wait_idle(fence_timeout)
        if self.endpoint.live():
            self.run(self.endpoint.tear_down_unfenced(reason, self.now()))
        await self.peers.settled(max(drain, fence_timeout))

    async def unregister(self, reason: str, fence_timeout: float) -> None:
        """Fail every live transfer for `reason`, say Goodbye to every peer and remove it, then
        deregister the memory; from the start, handshakes are refused.  Idempotent.

        :raises TransportError: the transport could not deregister the memory (the engine
            stays asleep: a later call tries again).
        """
        if not self.asleep:
            log.info("%s: unregistering the KV memory: %s", self.peers.engine_id, reason)
            self.asleep = reason
            self.endpoint.refuse_handshakes(reason)
            await self.wind_down(reason, 0.0, fence_timeout)
            for peer in self.endpoint.peers():  # the peer's remote keys die with the registration
                self.run(self.endpoint.tear_down(peer, reason, self.now()))
            await self.peers.settled(fence_timeout)
        self.transport.deregister_regions()

    def restore(self) -> None:
        """Register the same regions again and accept handshakes; every Hello from now on
        carries the transport's new metadata.  Idempotent.

        :raises TransportError: the transport refused the regions or cannot describe itself
            (the engine stays asleep).
        """
        if not self.asleep:
            return
        self.transport.register_regions(self.layout.regions)
        try:
            self.peers.metadata = self.transport.local_metadata()
        except BaseException:
            self.transport.deregister_regions()
            raise
        self.asleep = ""
        self.endpoint.refuse_handshakes("")
        log.info("%s: KV memory registered again", self.peers.engine_id)
