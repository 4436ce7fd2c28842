"""vLLM scheduler events mapped to kvflow transfer orders: pure code, no vLLM import.

Why pure: vLLM's connector API is experimental and its call order subtle (hooks called twice,
side-effect-free lookups, delayed frees).  Keeping the decisions here, away from vLLM types,
lets them be tested exhaustively without vLLM and survive its API churn.

The router's ``kv_transfer_params`` are read by `kvflow.integrations.vllm.params`.

Sequential routers (vLLM's toy proxy, llm-d's routing sidecar, Dynamo) set no ``kvflow`` entry:
they send P ``do_remote_decode`` (``remote_*`` None, ``max_tokens`` 1) and hand what P's
``request_finished`` returned to D.  So P assigns the transfer itself (an unguessable transfer
id: it is the capability to read the KV), keeps the blocks after the request finishes, and
returns ``do_remote_prefill`` with a pull-mode ``kvflow`` entry naming P's engine and control
address; D, given that, pulls.  A decode request whose ``do_remote_prefill`` kvflow cannot
serve (malformed, another connector's params) is computed locally, but never silently: which
requests kvflow serves, and how a refused one is logged and counted, is
`kvflow.integrations.vllm.intake`'s.

`SchedulerBook` turns scheduler events into per-step `Orders` for the workers; where each request
is, and what every event does to it, is the table in `kvflow.integrations.vllm.stages`:

* decode (D): `update_state_after_alloc` -> an expect order (register these blocks);
  the request finished or aborted while its KV was still coming -> an abort order, and its
  blocks are freed late (vLLM's ``delay_free``) once the workers report them released; ended
  while still queued, before any allocation -> an abort order that only tells P;
* decode with prefix caching: D loads only what its local prefix-cache hit lacks.  It
  registers the blocks after the hit and says at which block position they start; P writes
  only those.  vLLM caches blocks loaded asynchronously only once the load completed, so no
  other request reads them before the KV has landed.  A full hit (D holds every block but the
  one with only the prompt's last token, which vLLM recomputes anyway) loads nothing: the
  request runs at once, and an empty registration tells P to release its blocks without a
  WRITE (push; pull loads that last block);
* prefill (P): ``on_new_request`` -> a promise order (heartbeats tell D the request is queued
  here, which keeps D waiting).  Push: each step that completes blocks of a request's prompt
  -> a ready order for those blocks, carried out by the workers during that step's forward
  (one WRITE per layer group as its last layer is saved; the rest at ``wait_for_save``).  A
  prompt longer than P's
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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.intake import RequestIntake, roles_problem
from kvflow.integrations.vllm.params import FIRST_TOKEN_ANSWER, PeerRef, TransferParams
from kvflow.integrations.vllm.stages import (
    ABORT_REASONS,
    DECODE_START,
    HOLDS_BLOCKS,
    OUTSTANDING,
    PREFILL_START,
    PRODUCING,
    SENDING_FROM,
    TABLE,
    Do,
    Event,
    Stage,
)
from kvflow.layout.groups import KVGroup
from kvflow.protocol.admission import PeerAllowList
from kvflow.protocol.state import Mode

__all__ = ("Blocks", "Order", "Orders", "SchedulerBook")


@dataclass(frozen=True, slots=True)
class Blocks:
    """One KV cache group's part of an expect or ready order: its blocks of block positions
    ``first..`` (expect: after D's prefix hit; a sliding-window group: within its window)."""

    first: int = 0
    ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Order:
    """One thing the workers do for one request: expect, ready (produce) or abort.  Expect and
    ready orders carry `blocks`, one entry per KV cache group; an expect order with a `reason`
    could not be made (D's blocks are not what vLLM's rules give), and fails the load."""

    request_id: str
    params: TransferParams
    blocks: tuple[Blocks, ...] = ()
    reason: str = ""
    producer: bool = False  # the order is for the side that produces the KV (P)
    allocated: bool = True  # D's abort: False when the request ended before it had any block
    final: bool = True  # ready: the last of the request's ready orders
    token: int = -1  # first: the first token P sampled, for D

    @property
    def block_count(self) -> int:
        """Blocks the order names, every group's together."""
        return sum(len(group.ids) for group in self.blocks)


@dataclass(slots=True)
class Orders:
    """What one scheduler step asks the workers to do (vLLM carries it as connector metadata)."""

    expect: list[Order] = field(default_factory=list)
    ready: list[Order] = field(default_factory=list)
    abort: list[Order] = field(default_factory=list)
    promise: list[Order] = field(default_factory=list)  # P: requests now queued here (see `new_request`)
    first: list[Order] = field(default_factory=list)  # P: first tokens sampled, for D (`finished`)
    # seconds the workers may sleep at the step's end waiting for their engines: the step
    # schedules nothing while transfers are outstanding (0: return at once)
    idle_wait: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.expect or self.ready or self.abort or self.promise or self.first)


@dataclass(slots=True)
class _Tracked:
    params: TransferParams
    prompt_len: int
    stage: Stage  # where the request is (`kvflow.integrations.vllm.stages`)
    producer: bool  # this engine produces the KV (P) for the request
    assigned: bool = False  # P assigned the transfer itself (a sequential router's request)
    sent: int = 0  # P: block positions earlier chunks' ready orders covered


class SchedulerBook:
    """The scheduler side's state, one per vLLM engine (scheduler process)."""

    def __init__(
        self,
        block_size: int,
        prefix_caching: bool = False,
        *,
        producer: PeerRef | None = None,
        allowed: PeerAllowList | None = None,
        groups: Sequence[KVGroup] = (),
    ) -> None:
        """`prefix_caching`: this engine shares cached blocks between requests.  As D it then
        receives KV only into the blocks after a request's local hit (never into a shared
        block: those are the hit's), and vLLM shares received blocks only once they landed.

        `producer`: this engine's id and the control address its rank-0 worker binds, which
        P names in the params it returns for a sequential router's request; None when the
        address is not known before the worker binds (port 0), and such requests are refused.

        `allowed`: the engines and networks this engine may transfer with; a request whose
        params name another peer is refused like malformed params (default: `PeerAllowList()`).

        `groups`: the model's KV cache groups, in vLLM's order (default: one group of full
        attention): each order carries one block list per group, a sliding-window group's only
        the block positions it keeps once the prompt is computed (`KVGroup.kept_from`), a
        Mamba / linear-attention group's its running-state block once the prompt is computed.
        With such a group P prefills all but the prompt's last token (the connector shortens P's
        request, `replay`), and D loads those and computes the last one.

        ``counters``: ``unservable``, requests whose ``do_remote_prefill`` or
        ``do_remote_decode`` kvflow could not serve (each logged once, with why) and so were
        computed locally without a transfer; ``assigned``, transfers this engine assigned
        itself for a sequential router's request.

        :raises ConfigError: a block size that is not positive.
        """
        if block_size <= 0:
            raise ConfigError("block_size must be positive")
        self.block_size = block_size
        self.groups = tuple(groups) or (KVGroup((0, 1)),)
        # prompt tokens P leaves for D to compute: with Mamba state, D needs the state after the
        # prompt's next-to-last token, and computes the last one itself (as vLLM's NIXL does)
        self.replay = 1 if any(group.state for group in self.groups) else 0
        self.prefix_caching = prefix_caching
        self.intake = RequestIntake(producer, allowed)  # which requests kvflow serves
        self._tracked: dict[str, _Tracked] = {}
        self._loaded: set[str] = set()  # D requests whose one remote load was ordered
        self._pending = Orders()

    @property
    def refused(self) -> dict[str, str]:
        """Request id -> why its kvflow params were refused (`RequestIntake.refused`)."""
        return self.intake.refused

    @property
    def counters(self) -> dict[str, int]:
        """The counts by name (`kvflow.integrations.vllm.intake.BookCounts`), a copy.  Never raises."""
        return self.intake.counters

    # ---------------------------------------------------------------- decode side

    def matched_tokens(
        self, request_id: str, params: Mapping[str, Any] | None, prompt_len: int, computed: int
    ) -> tuple[int, bool]:
        """`get_num_new_matched_tokens`: side-effect free.  A remote-prefill request loads every
        prompt token it has not computed (`computed`: its local prefix-cache hit, whole
        blocks), asynchronously; with only the last token missing (a full hit: vLLM recomputes
        that token anyway) a push transfer loads nothing."""
        params = self.intake.mapping(request_id, params)
        parsed = self.intake.parse(request_id, params, receiving=True) if params.get("do_remote_prefill") else None
        if parsed is None:
            return 0, False
        if request_id in self._loaded:
            return 0, False  # its remote load happened (and failed): vLLM recomputes it locally
        count = prompt_len - self.replay - computed
        if count == 1 and computed and parsed.mode is Mode.PUSH and not self.replay:
            return 0, False  # a full hit: `allocated` sends P an empty registration
        return (count, True) if count > 0 else (0, False)

    def may_load(self, request_id: str, params: object) -> bool:
        """vLLM 0.34's `may_load_async`: whether `matched_tokens` may answer an asynchronous
        load for the request, which is a remote prefill with a kvflow entry this engine accepts
        and has not been loaded yet.  Side-effect free and silent: `matched_tokens` logs and
        counts what it refuses.  (A prompt D's prefix cache holds whole is the one case it
        answers yes and `matched_tokens` no.)"""
        if not isinstance(params, Mapping) or roles_problem(params) is not None:
            return False
        if not params.get("do_remote_prefill") or request_id in self._loaded:
            return False
        return self.intake.accepted(params, receiving=True)[0] is not None

    def allocated(
        self,
        request_id: str,
        params: Mapping[str, Any] | None,
        prompt_len: int,
        block_ids: Sequence[Sequence[int | None]],
        external: int,
    ) -> None:
        """`update_state_after_alloc`: the first call registers the blocks after the request's
        local prefix-cache hit (`block_ids`: each KV cache group's blocks, the hit's first,
        vLLM's null block as None; a sliding-window group registers only the positions it keeps).
        With no external tokens (a full hit, or vLLM skips the load) D computes the rest itself:
        P is told, once, that D needs nothing (push), and the request is not tracked (vLLM
        expects no load result for it)."""
        params = self.intake.mapping(request_id, params)
        if not params.get("do_remote_prefill"):
            return
        parsed = self.intake.parse(request_id, params, receiving=True)
        if parsed is None or request_id in self._loaded:
            return  # refused; or loaded (or released) already
        known = self._tracked.get(request_id)
        if known is not None and known.stage not in (DECODE_START, *PRODUCING):
            return  # called again after the load: nothing new to register
        # remembered at on_new_request (as D; as P if its params asked for both sides), or not at all
        tracked = self._tracked[request_id] = _Tracked(parsed, prompt_len, DECODE_START, producer=False)
        loaded = prompt_len - self.replay  # the tokens P computes (see `replay`)
        needed = -(-loaded // self.block_size)
        self._loaded.add(request_id)
        if external <= 0:
            self._feed(request_id, tracked, Event.NOTHING_TO_LOAD)  # nothing to abort any more
            if parsed.mode is Mode.PUSH:
                nothing = tuple(Blocks(needed) for _ in self.groups)
                self._pending.expect.append(Order(request_id, parsed, nothing))
            return
        first = (loaded - external) // self.block_size  # the local hit is whole blocks
        blocks, problem = self._held(block_ids, first, needed, loaded, final=True)
        self._feed(request_id, tracked, Event.ALLOCATED)
        self._pending.expect.append(Order(request_id, parsed, blocks, reason=problem))

    # ---------------------------------------------------------------- prefill side

    def new_request(self, request_id: str, params: Mapping[str, Any] | None, prompt_len: int) -> None:
        """`on_new_request`: remember requests with a remote side.

        P (``do_remote_decode``): a promise order goes out, so that P's heartbeats tell D the
        request is queued here and D keeps waiting for it however long P's queue is; without a
        kvflow entry (a sequential router's request) P assigns the transfer itself.  D
        (``do_remote_prefill``): remembered before it has blocks, so that if it ends while still
        queued, P is told (an abort order) instead of holding its KV to its deadline; and a
        promise order goes out too, so that D's heartbeats keep P holding KV it made ready
        however long D's queue is (P would free it after its transfer timeout)."""
        params = self.intake.mapping(request_id, params)
        if params.get("do_remote_decode"):
            if params.get("kvflow") is None:
                assigned = self.intake.assign(request_id)
                if assigned is not None:
                    self._tracked[request_id] = _Tracked(
                        assigned, prompt_len, PREFILL_START, producer=True, assigned=True
                    )
                return
            parsed = self.intake.parse(request_id, params)
            if parsed is not None:
                self._tracked[request_id] = _Tracked(parsed, prompt_len, PREFILL_START, producer=True)
                self._pending.promise.append(Order(request_id, parsed, producer=True))
        elif params.get("do_remote_prefill"):
            parsed = self.intake.parse(request_id, params, receiving=True)
            if parsed is not None:
                self._tracked[request_id] = _Tracked(parsed, prompt_len, DECODE_START, producer=False)
                self._pending.promise.append(Order(request_id, parsed))

    def producing(self, request_id: str) -> bool:
        """Whether a step of this request may hand KV over (`scheduled` wants its blocks)."""
        tracked = self._tracked.get(request_id)
        return tracked is not None and tracked.stage in PRODUCING

    def scheduled(
        self, request_id: str, computed: int, scheduled: int, block_ids: Sequence[Sequence[int | None]]
    ) -> None:
        """A step schedules `scheduled` tokens after `computed`: the KV of the blocks this
        completes is ready after this step's forward (push: each chunk's full blocks; pull: all
        of them once the prompt is complete).  `block_ids`: the request's blocks in each KV cache
        group (vLLM's null block as None); a sliding-window group hands over only the positions
        it keeps once the prompt is computed, which vLLM never frees before the request ends."""
        if not self.producing(request_id):
            return
        tracked = self._tracked[request_id]
        done = computed + scheduled
        push = tracked.params.mode is Mode.PUSH
        first = tracked.sent
        if done >= tracked.prompt_len:
            self._feed(request_id, tracked, Event.PROMPT_DONE)
            needed = -(-tracked.prompt_len // self.block_size)
            blocks, problem = self._held(block_ids, first, needed, tracked.prompt_len, final=True)
            self._pending.ready.append(Order(request_id, tracked.params, blocks, reason=problem, producer=True))
        elif push and done // self.block_size > first:
            full = done // self.block_size  # blocks whose every token is computed
            tracked.sent = full
            blocks, problem = self._held(block_ids, first, full, tracked.prompt_len, final=False)
            order = Order(request_id, tracked.params, blocks, reason=problem, producer=True, final=False)
            if order.block_count:  # none: every group's blocks of this chunk are out of its window
                self._feed(request_id, tracked, Event.HANDED)
                self._pending.ready.append(order)

    def _held(
        self, block_ids: Sequence[Sequence[int | None]], first: int, stop: int, prompt_len: int, *, final: bool
    ) -> tuple[tuple[Blocks, ...], str]:
        """Each KV cache group's blocks of positions ``first..stop`` that it keeps once the
        prompt's `prompt_len` tokens are computed (a state group's running-state block, at
        position 0, once the prompt is `final`), and what is wrong with them ("" if nothing:
        vLLM's null block, or a group vLLM does not list, where a block must be, is named, and
        the group's part stops short of it, so that the transfer fails instead of moving it)."""
        parts: list[Blocks] = []
        problem = ""
        if len(block_ids) != len(self.groups):
            problem = f"vLLM lists {len(block_ids)} KV cache groups' blocks, the connector knows {len(self.groups)}"
        for index, group in enumerate(self.groups):
            if group.state:
                state = group.state_block(block_ids[index]) if index < len(block_ids) and final else None
                if final and state is None:
                    problem = problem or f"KV cache group {index} holds no running-state block"
                parts.append(Blocks(0, () if state is None else (state,)))
                continue
            start = max(first, group.kept_from(prompt_len, self.block_size))
            ids = tuple(block_ids[index])[start:stop] if index < len(block_ids) else ()
            holes = [start + i for i, block in enumerate(ids) if block is None]
            if start < stop and (holes or len(ids) != stop - start):
                where = holes[0] if holes else start + len(ids)
                problem = problem or f"KV cache group {index} holds no block at position {where}"
                ids = ids[: where - start]
            parts.append(Blocks(start, tuple(block for block in ids if block is not None)))
        return tuple(parts), problem

    def preempted(self, request_id: str) -> None:
        """vLLM preempted the request (``SchedulerOutput.preempted_req_ids``) and freed its
        blocks: a transfer that has some of them is aborted (see the module docstring); one
        with none of them handed over (`sent` never passes a block that would have been) is
        pushed as usual once recomputed."""
        tracked = self._tracked.get(request_id)
        if tracked is not None:
            self._feed(request_id, tracked, Event.PREEMPTED)

    # ---------------------------------------------------------------- both sides

    def finished(
        self, request_id: str, aborted: bool, first_token: int | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished`: returns vLLM's (delay_free, kv_transfer_params).

        Blocks a transfer may still touch are freed only once the workers report them released.
        `first_token`: the token P sampled; when the request's params ask for it, a first order
        sends it to D (the engine steps again for it: `pending_work`).
        """
        self._loaded.discard(request_id)
        self.intake.refused.pop(request_id, None)
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return False, None
        dos = self._feed(request_id, tracked, Event.ABORTED if aborted else Event.FINISHED)
        hold = tracked.stage in HOLDS_BLOCKS
        if Do.HAND_OVER not in dos:
            return hold, None
        # (with Mamba state P's prompt was shortened, `replay`: its token is not the first one)
        if tracked.params.first_token and first_token is not None and not aborted and not self.replay:
            self._pending.first.append(Order(request_id, tracked.params, producer=True, token=first_token))
        if not tracked.assigned:
            answer: dict[str, Any] = {"kvflow": tracked.params.to_params(), "kvflow_prefill_finished": True}
            if self.replay:  # P's token came from the prompt less its last token: not the first
                answer[FIRST_TOKEN_ANSWER] = False
            return hold, answer
        if aborted:
            return hold, None  # a sequential router's request: no decode engine will claim it
        return hold, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "kvflow": tracked.params.to_params(),
            "remote_engine_id": tracked.params.prefill.engine,
            "remote_request_id": request_id,
        }

    def output(self, finished_sending: set[str], finished_recving: set[str], failed_recving: set[str]) -> None:
        """`update_connector_output`: what the workers reported this step."""
        for request_id in finished_recving:
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                failed = request_id in failed_recving
                self._feed(request_id, tracked, Event.RECEIVE_FAILED if failed else Event.RECEIVED)
        for request_id in finished_sending:
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                self._feed(request_id, tracked, Event.SENT)

    def _feed(self, request_id: str, tracked: _Tracked, event: Event) -> tuple[Do, ...]:
        """Move the request along its row for `event`: queue the abort order the row asks for,
        and forget the request once it ended.  Returns what the row does."""
        stage, dos = TABLE[(tracked.stage, event)]
        tracked.stage = stage
        for do in dos:
            reason = ABORT_REASONS.get(do)
            if reason is not None:
                allocated = do is not Do.ABORT_UNALLOCATED
                order = Order(request_id, tracked.params, reason=reason, producer=tracked.producer, allocated=allocated)
                self._pending.abort.append(order)
        if stage is Stage.ENDED:
            self._tracked.pop(request_id, None)
            # ended in the step it arrived: nothing to promise (its abort order tells the peer)
            self._pending.promise = [o for o in self._pending.promise if o.request_id != request_id]
        return dos

    def take_orders(self) -> Orders:
        """`build_connector_meta`: this step's orders (and a fresh list for the next step)."""
        orders, self._pending = self._pending, Orders()
        return orders

    def pending_work(self) -> bool:
        """`has_pending_push_work`: transfers whose end the workers have not reported yet (a promise
        alone is no such work: the promised request keeps the engine stepping)."""
        pending = self._pending
        return bool(pending.expect or pending.ready or pending.abort or pending.first) or any(
            t.stage in OUTSTANDING for t in self._tracked.values()
        )

    def handing_off(self) -> bool:
        """`has_pending_block_frees`: a request whose ready order went out has not finished yet.

        vLLM then preempts nothing (it waits a step instead): with async scheduling the step
        after a request's last prefill chunk is scheduled before that chunk's output is read,
        while the request still runs, and preempting it would free (and hand to another request)
        the blocks kvflow is sending from.  The request finishes when that output is read."""
        return any(t.stage in SENDING_FROM for t in self._tracked.values())

    def tracked(self) -> int:
        return len(self._tracked)
