"""vLLM scheduler events mapped to kvflow transfer orders: pure code, no vLLM import.

Why pure: vLLM's connector API is experimental and its call order subtle (hooks called twice,
side-effect-free lookups, delayed frees).  Keeping the decisions here, away from vLLM types,
lets them be tested exhaustively without vLLM and survive its API churn.

The router sets, in each request's ``kv_transfer_params``, a ``kvflow`` entry:

    {"transfer_id": str, "epoch": int, "mode": "push" | "pull",
     "prefill": {"engine": str, "address": "tcp://host:port"},
     "decode":  {"engine": str, "address": "tcp://host:port"}}

plus vLLM's own flags: ``do_remote_decode`` on the prefill request, ``do_remote_prefill`` on the
decode request.  Transfers are matched by ``transfer_id``, never by request ids.

`SchedulerBook` turns scheduler events into per-step `Orders` for the workers:

* decode (D): `update_state_after_alloc` -> an expect order (register these blocks);
  the request finished or aborted while its KV was still coming -> an abort order, and its
  blocks are freed late (vLLM's ``delay_free``) once the workers report them released;
* prefill (P): push: each step that completes blocks of a request's prompt -> a ready order for
  those blocks, carried out by the workers during that step's forward (one WRITE per layer
  group as its last layer is saved; the rest at ``wait_for_save``).  A prompt longer than P's
  token budget is prefilled in chunks over several steps: each chunk's *full* blocks (every
  token computed) go in that chunk's step, a partly filled last block waits for the next chunk,
  and the step that completes the prompt sends the rest, marked final.  So only the last
  chunk's blocks are on the critical path.  D cannot know how P chunks, so it registers an open
  batch count (`OPEN_BATCHES`); P's batches must still tile D's blocks x layers exactly.
  Pull: one ready order in the step that completes the prompt.
  ``request_finished`` -> ``delay_free`` until the workers report the blocks released
  (``finished_sending``).
* preemption (P): vLLM frees a preempted request's blocks without asking the connector and
  recomputes it from scratch, so blocks already handed to a push may be reused by another
  request while a WRITE of them is in flight.  A preempted request whose KV the workers already
  have is aborted (D's transfer fails and its blocks wait for P's fence, so whatever a late
  WRITE read never passes as KV); its recomputed prefill is not pushed again.  One preempted
  before any of its blocks were handed over simply starts over.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.errors import ConfigError
from kvflow.protocol.state import Mode

log = logging.getLogger("kvflow.vllm")

__all__ = ("Order", "Orders", "PeerRef", "SchedulerBook", "TransferParams", "rank_peer")

MODES = {mode.value: mode for mode in Mode}  # a mode travels as its value


@dataclass(frozen=True, slots=True)
class PeerRef:
    engine: str
    address: str


@dataclass(frozen=True, slots=True)
class TransferParams:
    transfer_id: str
    epoch: int
    mode: Mode
    prefill: PeerRef
    decode: PeerRef

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None) -> TransferParams | None:
        """The kvflow part of a request's ``kv_transfer_params``, or None when it has none.

        :raises ConfigError: the entry exists but is malformed (named field).
        """
        raw = (params or {}).get("kvflow")
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ConfigError("kv_transfer_params.kvflow must be a mapping")
        tid, epoch, mode = raw.get("transfer_id"), raw.get("epoch", 1), raw.get("mode", "push")
        if not isinstance(tid, str) or not tid:
            raise ConfigError("kv_transfer_params.kvflow.transfer_id must be a non-empty string")
        if type(epoch) is not int or epoch < 0:
            raise ConfigError("kv_transfer_params.kvflow.epoch must be a non-negative integer")
        if not isinstance(mode, str) or mode not in MODES:
            raise ConfigError(f"kv_transfer_params.kvflow.mode must be one of {tuple(MODES)}")
        return cls(tid, epoch, MODES[mode], _peer(raw, "prefill"), _peer(raw, "decode"))

    def to_params(self) -> dict[str, Any]:
        return {
            "transfer_id": self.transfer_id,
            "epoch": self.epoch,
            "mode": self.mode.value,
            "prefill": {"engine": self.prefill.engine, "address": self.prefill.address},
            "decode": {"engine": self.decode.engine, "address": self.decode.address},
        }


def _peer(raw: Mapping[str, Any], side: str) -> PeerRef:
    entry = raw.get(side)
    if not isinstance(entry, Mapping) or not isinstance(entry.get("engine"), str) or not entry["engine"]:
        raise ConfigError(f"kv_transfer_params.kvflow.{side}.engine must be a non-empty string")
    address = entry.get("address", "")
    if not isinstance(address, str) or (address and not _port_of(address)):
        raise ConfigError(
            f"kv_transfer_params.kvflow.{side}.address must be 'tcp://host:port' (port 1..65535), not {address!r:.80}"
        )
    return PeerRef(entry["engine"], address)


_TCP_ADDRESS = re.compile(r"tcp://[^\s/]+:([0-9]{1,5})", re.ASCII)


def _port_of(address: str) -> int:
    """The port of a ``tcp://host:port`` address; 0 for anything else or a port out of range."""
    match = _TCP_ADDRESS.fullmatch(address)
    port = int(match.group(1)) if match else 0
    return port if port <= 65535 else 0


def rank_peer(peer: PeerRef, rank: int) -> PeerRef:
    """The peer's engine for tensor-parallel rank `rank`: rank r of an engine is named
    ``<engine>-tp<r>`` and binds the rank-0 port + r.

    :raises ConfigError: that port would be past 65535.
    """
    address = peer.address
    port = _port_of(address)
    if port:
        if port + rank > 65535:
            raise ConfigError(f"peer {peer.engine!r} at {address}: rank {rank} would need port {port + rank}")
        address = f"{address.rsplit(':', 1)[0]}:{port + rank}"
    return PeerRef(f"{peer.engine}-tp{rank}", address)


@dataclass(frozen=True, slots=True)
class Order:
    """One thing the workers do for one request: expect, ready (produce) or abort."""

    request_id: str
    params: TransferParams
    block_ids: tuple[int, ...] = ()
    reason: str = ""
    producer: bool = False  # the order is for the side that produces the KV (P)
    first: int = 0  # ready: the block position of ``block_ids[0]`` in the prompt
    final: bool = True  # ready: the last of the request's ready orders


@dataclass(slots=True)
class Orders:
    """What one scheduler step asks the workers to do (vLLM carries it as connector metadata)."""

    expect: list[Order] = field(default_factory=list)
    ready: list[Order] = field(default_factory=list)
    abort: list[Order] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.expect or self.ready or self.abort)


@dataclass(slots=True)
class _Tracked:
    params: TransferParams
    prompt_len: int
    producer: bool  # this engine produces the KV (P) for the request
    ordered: bool = False  # the expect or (final) ready order went out
    landed: bool = False  # D: the KV arrived (finished_recving)
    delayed_free: bool = False  # vLLM holds the blocks until finished_sending
    sent: int = 0  # P: block positions handed to the workers by earlier chunks' ready orders
    preempted: bool = False  # P: preempted after its workers got KV: the transfer is aborted

    @property
    def handed_over(self) -> bool:
        """P: the workers got (some of) the request's KV."""
        return self.ordered or self.sent > 0


class SchedulerBook:
    """The scheduler side's state, one per vLLM engine (scheduler process)."""

    def __init__(self, block_size: int, prefix_caching: bool = False) -> None:
        """`prefix_caching`: this engine shares cached blocks between requests, so it must not
        receive KV (a WRITE into a shared block would change other requests' KV); requests
        asking for a remote prefill are then refused and computed locally.

        :raises ConfigError: a block size that is not positive.
        """
        if block_size <= 0:
            raise ConfigError("block_size must be positive")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._tracked: dict[str, _Tracked] = {}
        self._loaded: set[str] = set()  # D requests whose one remote load was ordered
        self._pending = Orders()
        self.refused: dict[str, str] = {}  # request id -> why its kvflow params were refused

    # ---------------------------------------------------------------- decode side

    def matched_tokens(
        self, request_id: str, params: Mapping[str, Any] | None, prompt_len: int, computed: int
    ) -> tuple[int, bool]:
        """`get_num_new_matched_tokens`: side-effect free.  A remote-prefill request loads every
        prompt token it has not computed, asynchronously."""
        if not (params or {}).get("do_remote_prefill") or self._parse(request_id, params, receiving=True) is None:
            return 0, False
        if request_id in self._loaded:
            return 0, False  # its remote load happened (and failed): vLLM recomputes it locally
        count = prompt_len - computed
        return (count, True) if count > 0 else (0, False)

    def allocated(
        self,
        request_id: str,
        params: Mapping[str, Any] | None,
        prompt_len: int,
        block_ids: Sequence[int],
        external: int,
    ) -> None:
        """`update_state_after_alloc`: the first call with external tokens registers the blocks."""
        if not (params or {}).get("do_remote_prefill") or external <= 0:
            return
        parsed = self._parse(request_id, params, receiving=True)
        if parsed is None:
            return
        if request_id in self._tracked:
            return  # called again after the load: nothing new to register
        needed = -(-prompt_len // self.block_size)
        blocks = tuple(block_ids)[:needed]
        self._loaded.add(request_id)
        self._tracked[request_id] = _Tracked(parsed, prompt_len, producer=False, ordered=True)
        self._pending.expect.append(Order(request_id, parsed, blocks))

    # ---------------------------------------------------------------- prefill side

    def new_request(self, request_id: str, params: Mapping[str, Any] | None, prompt_len: int) -> None:
        """`on_new_request`: remember prefill requests whose KV goes to a remote decoder."""
        if not (params or {}).get("do_remote_decode"):
            return
        parsed = self._parse(request_id, params)
        if parsed is not None:
            self._tracked[request_id] = _Tracked(parsed, prompt_len, producer=True)

    def scheduled(self, request_id: str, computed: int, scheduled: int, block_ids: Sequence[int]) -> None:
        """A step schedules `scheduled` tokens after `computed`: the KV of the blocks this
        completes is ready after this step's forward (push: each chunk's full blocks; pull: all
        of them once the prompt is complete)."""
        tracked = self._tracked.get(request_id)
        if tracked is None or not tracked.producer or tracked.ordered or tracked.preempted:
            return
        done = computed + scheduled
        push = tracked.params.mode is Mode.PUSH
        first = tracked.sent
        if done >= tracked.prompt_len:
            tracked.ordered = True
            needed = -(-tracked.prompt_len // self.block_size)
            blocks = tuple(block_ids)[first:needed]
            self._pending.ready.append(Order(request_id, tracked.params, blocks, producer=True, first=first))
        elif push and done // self.block_size > first:
            full = done // self.block_size  # blocks whose every token is computed
            tracked.sent = full
            blocks = tuple(block_ids)[first:full]
            self._pending.ready.append(
                Order(request_id, tracked.params, blocks, producer=True, first=first, final=False)
            )

    def preempted(self, request_id: str) -> None:
        """vLLM preempted the request (``SchedulerOutput.preempted_req_ids``) and freed its
        blocks: a transfer that has some of them is aborted (see the module docstring)."""
        tracked = self._tracked.get(request_id)
        if tracked is None or not tracked.producer or tracked.preempted:
            return
        if not tracked.handed_over:
            return  # nothing of it was handed over: its recomputed prefill is pushed as usual
        tracked.preempted = True
        self._pending.abort.append(
            Order(
                request_id,
                tracked.params,
                reason="prefill request preempted: vLLM freed its blocks",
                producer=True,
            )
        )

    # ---------------------------------------------------------------- both sides

    def finished(self, request_id: str, aborted: bool) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished`: returns vLLM's (delay_free, kv_transfer_params).

        Blocks a transfer may still touch are freed only once the workers report them released.
        """
        self._loaded.discard(request_id)
        self.refused.pop(request_id, None)
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return False, None
        if tracked.producer:
            if tracked.preempted or (tracked.sent and not tracked.ordered):
                # Earlier chunks' KV was handed over, but the transfer cannot complete: the
                # workers hold (or held) those blocks, so vLLM frees late, on finished_sending.
                if not tracked.preempted:
                    self._pending.abort.append(
                        Order(request_id, tracked.params, reason="prefill request ended mid-prefill", producer=True)
                    )
                tracked.delayed_free = True
                return True, None
            if not tracked.ordered:
                # Finished (or aborted) before its prefill completed: tell the peer, hold nothing.
                self._tracked.pop(request_id)
                self._pending.abort.append(
                    Order(request_id, tracked.params, reason="prefill request ended early", producer=True)
                )
                return False, None
            if aborted:
                self._pending.abort.append(
                    Order(request_id, tracked.params, reason="prefill request aborted", producer=True)
                )
            tracked.delayed_free = True
            return True, {"kvflow": tracked.params.to_params(), "kvflow_prefill_finished": True}
        if tracked.landed:
            self._tracked.pop(request_id)
            return False, None
        tracked.delayed_free = True
        reason = "decode request aborted" if aborted else "decode request ended before its KV arrived"
        self._pending.abort.append(Order(request_id, tracked.params, reason=reason))
        return True, None

    def output(self, finished_sending: set[str], finished_recving: set[str], failed_recving: set[str]) -> None:
        """`update_connector_output`: what the workers reported this step."""
        for request_id in finished_recving:
            tracked = self._tracked.get(request_id)
            if tracked is not None and not tracked.producer:
                tracked.landed = request_id not in failed_recving
                if request_id in failed_recving or tracked.delayed_free:
                    # vLLM frees a finished request's blocks on finished_recving too: the KV
                    # landed (or failed) just as the request ended, before its abort took effect
                    self._tracked.pop(request_id)
        for request_id in finished_sending:
            tracked = self._tracked.get(request_id)
            if tracked is not None and tracked.delayed_free:
                self._tracked.pop(request_id)

    def take_orders(self) -> Orders:
        """`build_connector_meta`: this step's orders (and a fresh list for the next step)."""
        orders, self._pending = self._pending, Orders()
        return orders

    def pending_work(self) -> bool:
        """`has_pending_push_work`: transfers whose end the workers have not reported yet."""
        return bool(self._pending) or any(
            t.delayed_free or (t.ordered and not t.producer and not t.landed) for t in self._tracked.values()
        )

    def tracked(self) -> int:
        return len(self._tracked)

    def _parse(
        self, request_id: str, params: Mapping[str, Any] | None, receiving: bool = False
    ) -> TransferParams | None:
        """The request's kvflow params; malformed ones, and KV to receive on an engine with
        prefix caching, are refused (logged once per request) and the request runs as if it had
        none: computed locally, never a crash of the scheduler."""
        try:
            parsed = TransferParams.parse(params)
            if parsed is not None and receiving and self.prefix_caching:
                raise ConfigError(
                    "this engine has prefix caching on and cannot receive KV (--no-enable-prefix-caching)"
                )
            return parsed
        except ConfigError as exc:
            if request_id not in self.refused:
                self.refused[request_id] = str(exc)
                log.error("request %s: %s; it is computed locally", request_id, exc)
            return None
