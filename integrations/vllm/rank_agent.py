"""The engine side of a vLLM worker rank: what the worker's hooks order, run where its engine runs.

Why apart from the worker: the worker's hooks run on the model runner's thread and only hand
out orders; each order here is a short sequence of engine calls that may wait (for a
handshake with the peer's rank, for the device to have written the KV, for the layer group
before it), so it runs with the engine, on its loop: on the rank's engine thread, or in the
rank's engine process (`kvflow.runtime.engine_process`), where the host's interpreter is not
shared.  Every command takes and returns plain data, so the same agent serves both; the engine's
requests (`kvflow.protocol.requests`) come through one of them, `submit`, in their wire form,
with the `Reach` of the other side's rank each names as its peer.

No vLLM import: an engine process never loads vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kvflow.errors import (
    BlockSizeMismatch,
    ConfigError,
    KVFlowError,
    MalformedRequest,
    PeerUnknown,
    UnknownTransfer,
    UsageError,
)
from kvflow.integrations.vllm.device import Device, Gate, GateWaiter, HostDevice
from kvflow.integrations.vllm.params import PeerRef
from kvflow.integrations.vllm.ranks import rank_name, reach_rank
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.requests import Abort, Expect, KvReady, Request, request_from_wire
from kvflow.protocol.state import Mode, Role
from kvflow.runtime.engine import Engine
from kvflow.runtime.engine_agent import EngineAgent
from kvflow.runtime.frames import error_record

__all__ = ("ENGINE_REJECTIONS", "RankAgent", "Reach")

log = logging.getLogger("kvflow.vllm")

# seconds between looks at whether a D rank associated, while P holds a first token for it (rare:
# D associates when its request is queued, which is before P's prefill ends unless D lags)
ASSOCIATION_POLL = 0.02

# the engine's and its core's counters of refused peer messages -> the reason reported
ENGINE_REJECTIONS = {
    "messages_from_unknown_peers": "unknown_peer",
    "notifications_from_unknown": "notification_from_unknown_peer",
    "stale_epoch": "stale_epoch",
    "unknown_transfer": "unknown_transfer",
    "foreign_peer": "foreign_peer",
    "malformed_notifications": "malformed_notification",
    "protocol_violations": "protocol_violation",
    "rejected_registrations": "rejected_registration",
    "over_quota": "over_quota",
    "integrity_mismatches": "integrity_mismatch",  # a WRITE D's integrity check failed
}

PeerWire = Sequence[Any]  # [engine, address, tp_size]: a `PeerRef` as plain data


def peer_wire(peer: PeerRef) -> list[Any]:
    return [peer.engine, peer.address, peer.tp_size]


def _peer(wire: PeerWire) -> PeerRef:
    return PeerRef(str(wire[0]), str(wire[1]), int(wire[2]))


@dataclass(frozen=True, slots=True)
class Reach:
    """The other side's rank a request names as its peer: rank `rank` of `peer`'s `tp_size`
    ranks, found through `peer`'s rank 0 (`ranks.reach_rank`)."""

    peer: PeerRef
    tp_size: int
    rank: int

    @property
    def name(self) -> str:
        """The rank's engine id: the peer a request to it names."""
        return rank_name(self.peer.engine, self.rank)

    def to_wire(self) -> list[Any]:
        """Plain data msgpack carries; `from_wire` makes it this `Reach` again."""
        return [peer_wire(self.peer), self.tp_size, self.rank]

    @classmethod
    def from_wire(cls, wire: object) -> Reach:
        """:raises MalformedRequest: not a `Reach`'s wire form."""
        match wire:
            case [[str(engine), str(address), int(peer_tp)], int(tp_size), int(rank)]:
                if not any(isinstance(number, bool) for number in (peer_tp, tp_size, rank)):
                    return cls(PeerRef(engine, address, peer_tp), tp_size, rank)
        raise MalformedRequest(f"a rank to reach is [[engine, address, tp_size], tp_size, rank], not {wire!r:.80}")


class RankAgent(EngineAgent):
    """One rank's engine-side state: each push transfer's posting chain, and D's registrations
    still under way (an abort waits for them).  `device` and `transfer_timeout`: what a WRITE
    waits for before it is posted, and for how long."""

    COMMANDS: ClassVar[frozenset[str]] = EngineAgent.COMMANDS | {
        "promise_pair",
        "promise_prefill",
        "post_group",
        "post_groups",
        "snapshot",
        "describe",
        "tell_first_token",
        "first_token",
    }
    # commands whose answer is news for vLLM's engine core, asleep while its requests wait (`Bell`)
    NEWS: ClassVar[frozenset[str]] = frozenset({"first_token"})

    def __init__(self, engine: Engine, transfer_timeout: float = 60.0, device: Device | None = None) -> None:
        super().__init__(engine)
        self.transfer_timeout = transfer_timeout
        self.device: Device = device or HostDevice()
        self._waiter: GateWaiter | None = None
        # each push transfer's last posted group, and the transfers whose posting failed
        # part-way (their later groups are skipped)
        self._chains: dict[TransferKey, asyncio.Future[None]] = {}
        self._broken: set[TransferKey] = set()
        self._registrations: dict[TransferKey, asyncio.Future[Any]] = {}  # D: expects not returned yet
        self._chunk_blocks: dict[TransferKey, list[int]] = {}  # P: each push transfer's blocks of its chunk
        self._handlers: dict[type[Request], Callable[[Any, Reach | None], Awaitable[None]]] = {
            Expect: self._expect,
            KvReady: self._ready,
            Abort: self._abort,
        }

    # ---------------------------------------------------------------- the engine's requests

    async def submit(self, wire: Any, reach: Any = None, gate: Gate | None = None) -> None:
        """The engine's requests' one door (`EngineAgent.submit`), each run by its type's
        handler once the device has run the work before `gate`: D's `Expect` registers its
        blocks, P's `KvReady` makes its KV ready, and an `Abort` gives up on a transfer (D's
        registration still under way waited for first; nothing to abort is no error).  `reach`:
        a `Reach`'s wire form, the other side's rank the request names as its peer, associated
        with first (None: the request's peer, if any, needs no handshake from here).

        :raises MalformedRequest: `wire` or `reach` is not one (nothing is done).
        :raises ConfigError: the rank `reach` names is not the request's peer.
        :raises KVFlowError: the device, the handshake or the engine failed (see `Engine.submit`).
        """
        request = request_from_wire(wire)
        rank = None if reach is None else Reach.from_wire(reach)
        await self._wait_for_device(gate)
        await self._handlers[type(request)](request, rank)

    async def _expect(self, request: Expect, reach: Reach | None) -> None:
        """D: register the blocks (several P ranks may write their own heads into the same
        blocks: `share`); an abort of the transfer meanwhile waits for this to end."""
        key = request.key
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._registrations[key] = done
        try:
            await self._associate(request, reach, Role.DECODE)
            await self.engine.submit(request)
        finally:
            done.set_result(None)
            if self._registrations.get(key) is done:
                del self._registrations[key]

    async def _ready(self, request: KvReady, reach: Reach | None) -> None:
        """P: the KV is ready (pull: the D rank `reach` names is told; no `reach` and no peer: a
        sequential router's transfer, for whichever D claims it)."""
        await self._associate(request, reach, Role.PREFILL)
        await self.engine.submit(request)

    async def _abort(self, request: Abort, reach: Reach | None) -> None:
        """Give up on a pair transfer; D's registration still under way is waited for first
        (bounded: its handshake has a deadline).  With `reach`, D's request ended before it had
        blocks: P is told, so that it frees its KV at once."""
        self._chunk_blocks.pop(request.key, None)
        registration = self._registrations.get(request.key) if request.role is Role.DECODE else None
        if registration is not None:
            await asyncio.wait([registration])
        await self._associate(request, reach, request.role)
        with contextlib.suppress(UnknownTransfer):  # never started here: nothing to abort
            await self.engine.submit(request)

    async def _associate(self, request: Request, reach: Reach | None, role: Role) -> None:
        """Associated with the rank `reach` names, the request's peer (None: nothing to reach).
        :raises ConfigError: that rank is not the request's peer.
        :raises KVFlowError: see `_reach`."""
        if reach is None:
            return
        name = await self._reach(reach, role, request.key, request.mode)
        if name != request.peer:
            raise ConfigError(f"{request.TAG} {request.key}: rank {reach.rank} is {name!r}, not {request.peer!r}")

    async def _reach(self, reach: Reach, role: Role, key: TransferKey, mode: Mode) -> str:
        """The engine id of the rank `reach` names, associated.  As D, a P rank this transfer
        cannot use (block sizes that do not tile) is told at once, so that P frees the request's
        blocks now instead of at its deadline.  :raises KVFlowError: see `reach_rank`."""
        try:
            return await reach_rank(self.engine, reach.peer, reach.tp_size, reach.rank, role)
        except BlockSizeMismatch as exc:
            if role is Role.DECODE:
                with contextlib.suppress(KVFlowError):  # best effort: P's deadline ends it otherwise
                    await self.engine.submit(Abort(key, Role.DECODE, str(exc), exc.peer, mode))
            raise

    async def promise_prefill(
        self, prefill: PeerWire, p_tp: int, source: int, transfer_id: str, epoch: int, mode: str
    ) -> None:
        """D holds the request queued, before its blocks are allocated: associated with P rank
        `source`, its heartbeats say so, which keeps P holding KV it made ready meanwhile.
        :raises KVFlowError: the handshake failed."""
        reach = Reach(_peer(prefill), p_tp, source)
        peer = await self._reach(reach, Role.DECODE, TransferKey(transfer_id, epoch), Mode(mode))
        await self.engine.promise(transfer_id, epoch, peer=peer)

    async def first_token(self, peer: str, transfer_id: str, epoch: int, timeout: float) -> int | None:
        """D: the first token P rank `peer` sent for the pair transfer, waited for at most
        `timeout` seconds (None: none came).  :raises EngineClosed: the engine closed meanwhile."""
        return await self.engine.outcomes.tokens.take(peer, TransferKey(transfer_id, epoch), timeout)

    # ---------------------------------------------------------------- P

    async def tell_first_token(self, reach: Any, transfer_id: str, epoch: int, token: int, wait: float) -> None:
        """P: tell the D rank `reach` names the first token it sampled for the pair transfer
        (best effort: a send that fails is counted and logged by the engine).  P never opens
        that association itself (D does, to register: two handshakes crossing could drop a
        registration), so a D rank not associated yet is waited for, at most `wait` seconds.
        :raises MalformedRequest: `reach` is not a `Reach`'s wire form.
        :raises PeerUnknown: the D rank did not associate within `wait`."""
        rank, key = Reach.from_wire(reach), TransferKey(transfer_id, epoch)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while rank.name not in self.engine.peers():
            if loop.time() >= deadline:
                raise PeerUnknown(f"D rank {rank.name!r} did not associate within {wait:g} s for {key}'s first token")
            await asyncio.sleep(ASSOCIATION_POLL)
        self.engine.send_first_token(rank.name, key, token)

    async def promise_pair(self, transfer_id: str, epoch: int, peer: str) -> None:
        """P holds the request for D rank `peer`: heartbeats say so."""
        await self.engine.promise(transfer_id, epoch, peer=peer)

    async def post_group(
        self,
        transfer_id: str,
        epoch: int,
        block_ids: list[int] | None,
        group: int,
        layers: Sequence[int],
        final: bool,
        first_position: int,
        first_of_transfer: bool,
        gate: Gate | None = None,
        peer: str | None = None,
    ) -> None:
        """Push: layer group `group` (`layers`) of one chunk's blocks, posted after the ones before it once the
        device has written it, for D rank `peer` only (a registration from any other engine is
        refused).  `block_ids` None: the blocks the transfer's previous group named (the host
        sends a chunk's blocks with its first group only).  A failure of the transfer's first
        group leaves kvflow holding nothing (vLLM frees the blocks): it is raised; a later
        failure aborts the transfer, whose blocks then come back through the engine's release.

        :raises UsageError: `block_ids` None for a transfer with no group before.
        :raises KVFlowError: the transfer's first group was refused."""
        part = [transfer_id, epoch, block_ids, group, layers, final, first_position, first_of_transfer, peer]
        posting = self._admit(part, gate)
        if posting is not None:
            await posting

    async def post_groups(self, gate: Gate | None, parts: list[list[Any]]) -> list[list[Any]]:
        """Several `post_group` orders given together (each part its arguments but `gate`),
        each taking its place in its transfer's chain in their order; returns ``[index,
        error]`` for each part that raised.

        :raises UsageError: `parts` is not a list.
        """
        if not isinstance(parts, list):
            raise UsageError(f"post_groups takes a list of parts, not {parts!r:.80}")
        failures: list[list[Any]] = []
        postings: list[tuple[int, Coroutine[Any, Any, None]]] = []
        for index, part in enumerate(parts):
            try:
                posting = self._admit(part, gate)
            except KVFlowError as exc:
                failures.append([index, error_record(exc)])
                continue
            if posting is not None:
                postings.append((index, posting))
        results = await asyncio.gather(*(posting for _, posting in postings), return_exceptions=True)
        for (index, _), result in zip(postings, results, strict=True):
            if isinstance(result, KVFlowError):
                failures.append([index, error_record(result)])
            elif isinstance(result, BaseException):
                raise result
        return failures

    def _admit(self, part: Any, gate: Gate | None) -> Coroutine[Any, Any, None] | None:
        """A push part (`post_group`'s arguments but the gate, in its order) takes its place
        in its transfer's chain now (in the order the host gave the parts); its posting, to
        be awaited (None: skipped, an earlier group failed).

        :raises UsageError: not 9 arguments, or `block_ids` None for a transfer with no group before."""
        if not isinstance(part, list) or len(part) != 9:
            raise UsageError(f"a push part is a list of 9 arguments, not {part!r:.80}")
        transfer_id, epoch, block_ids, group, layers, final, first_position, first_of_transfer, peer = part
        key = TransferKey(transfer_id, epoch)
        if block_ids is None:
            block_ids = self._chunk_blocks.get(key)
            if block_ids is None and key in self._broken:
                if final:
                    self._broken.discard(key)
                return None
            if block_ids is None:
                raise UsageError(f"layer group {group} of {key} names no blocks, and no group before it did")
        if final:
            self._chunk_blocks.pop(key, None)
        else:
            self._chunk_blocks[key] = block_ids
        previous = self._chains.get(key)
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._chains[key] = mine
        return self._post_in_turn(
            key, previous, mine, block_ids, group, layers, final, first_position, first_of_transfer, gate, peer
        )

    async def _post_in_turn(
        self,
        key: TransferKey,
        previous: asyncio.Future[None] | None,
        mine: asyncio.Future[None],
        block_ids: list[int],
        group: int,
        layers: Sequence[int],
        final: bool,
        first_position: int,
        first_of_transfer: bool,
        gate: Gate | None,
        peer: str | None,
    ) -> None:
        """:raises KVFlowError: see `post_group`."""
        try:
            if previous is not None:
                await previous
            if key in self._broken:
                return
            try:
                await self._wait_for_device(gate)
                await self.engine.kv_ready(
                    key.transfer_id,
                    key.epoch,
                    block_ids=block_ids,
                    layers=(int(layers[0]), int(layers[1])),
                    final=final,
                    first_position=first_position,
                    peer=peer,
                )
            except KVFlowError as exc:
                self._broken.add(key)
                self._chunk_blocks.pop(key, None)
                if first_of_transfer:
                    raise
                log.error("%s: layer group %d of %s refused: %s", self.engine.engine_id, group, key, exc)
                with contextlib.suppress(KVFlowError):
                    await self.engine.abort(key.transfer_id, key.epoch, Role.PREFILL, f"layer group {group}: {exc}")
        finally:
            mine.set_result(None)
            if self._chains.get(key) is mine:
                del self._chains[key]
            if final:
                self._broken.discard(key)

    async def _wait_for_device(self, gate: Gate | None) -> None:
        """Until the device has run the work before `gate`.

        :raises TransferTimeout: not within the transfer timeout.
        :raises TransportError: the device reported an error.
        """
        if gate is None:
            return
        if self._waiter is None:
            self._waiter = GateWaiter(self.device, f"kvflow-gates-{self.engine.engine_id}")
        await self._waiter.wait(gate, self.transfer_timeout)

    # ---------------------------------------------------------------- metrics

    async def snapshot(self) -> dict[str, Any]:
        """This rank's gauges and refusal counters, for vLLM's metrics (plain data)."""
        engine = self.engine
        stats = engine.stats()
        rejected = {reason: int(stats.get(name, 0)) for name, reason in ENGINE_REJECTIONS.items()}
        for name, value in dict(getattr(engine.control, "counters", {})).items():
            if name.startswith("rejected_"):
                rejected[name.removeprefix("rejected_")] = int(value)
        in_flight = Counter(machine.state.value for machine in engine.endpoint.live())
        hold = engine.hold_report()
        gauges = {
            "quarantined_blocks": int(stats["quarantined_blocks"]),
            "in_flight": dict(in_flight),
            "teardowns": dict(hold.by_phase),
            "hold_release_in_s": round(hold.release_in, 3),
        }
        return {"rejected": rejected, "gauges": gauges}

    async def describe(self) -> str:
        """What the rank's engine still waits on, in words (for a run that stalled)."""
        engine = self.engine
        live = [(m.key.transfer_id, m.role.value, m.state.name) for m in engine.endpoint.live()]
        stats = {k: v for k, v in engine.stats().items() if v}
        chains = sorted(str(key) for key in self._chains)
        return f"live {live}, stats {stats}, crashed {engine.crashed}, chains {chains}, peers {engine.peers()}"

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.close()
            self._waiter = None
