"""A `RuleBasedStateMachine` over the vLLM connector's `SchedulerBook`.

Why stateful: vLLM calls the scheduler hooks in many orders (chunked prefills, aborts at any
point, reports racing with request ends).  Random legal sequences of D- and P-side events are
checked against a model of what the book must order and keep, step by step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvflow.integrations.vllm.mapping import Blocks, Order, SchedulerBook
from kvflow.integrations.vllm.params import TransferParams
from tests.vllm_params import entry, must_parse, needed

REQUEST_IDS = ("r0", "r1", "r2")
TRACKED = {"waiting", "landed", "held", "prefilling", "ordered", "preempted"}  # states the book must track
OUTSTANDING = {"waiting", "held"}  # states whose end the workers have not reported yet


@dataclass
class Req:
    side: str  # "D", "P", or "R" (refused params)
    state: str
    params: dict[str, Any]
    prompt_len: int
    count: int = 0  # D: tokens it loads
    computed: int = 0  # P: prefill progress; D: its local prefix-cache hit
    told: bool = False  # D, nothing to load: P was told so (an empty registration)
    sent: int = 0  # P (push): block positions handed over by earlier chunks


class BookMachine(RuleBasedStateMachine):
    """Random legal D- and P-side event sequences against a model of what the book must decide."""

    @initialize(block_size=st.sampled_from([1, 4, 16]))
    def setup(self, block_size: int) -> None:
        self.book = SchedulerBook(block_size)
        self.block_size = block_size
        self.reqs: dict[str, Req] = {}
        self.expect: list[Order] = []
        self.ready: list[Order] = []
        self.abort: list[tuple[str, TransferParams | None]] = []
        self.serial = 0

    def _new_params(self, flag: str, mode: str) -> dict[str, Any]:
        self.serial += 1
        return {flag: True, "kvflow": entry(f"t{self.serial}", mode=mode)}

    def _free(self) -> list[str]:
        return [rid for rid in REQUEST_IDS if rid not in self.reqs]

    def _in(self, side: str, *states: str) -> list[str]:
        return [rid for rid, r in self.reqs.items() if r.side == side and r.state in states]

    # ---------------------------------------------------------------- decode side

    @precondition(lambda self: bool(self._free()))
    @rule(data=st.data(), prompt_len=st.integers(1, 40), mode=st.sampled_from(["push", "pull"]))
    def decode_arrives(self, data: st.DataObject, prompt_len: int, mode: str) -> None:
        rid = data.draw(st.sampled_from(self._free()))
        # the local prefix-cache hit, whole blocks (vLLM's is at most prompt_len - 1 tokens)
        computed = data.draw(st.integers(0, prompt_len // self.block_size)) * self.block_size
        params = self._new_params("do_remote_prefill", mode)
        count = prompt_len - computed
        if count == 1 and computed and mode == "push":
            count = 0  # a full hit: only the last token, which vLLM recomputes anyway, is missing
        got = self.book.matched_tokens(rid, params, prompt_len, computed)
        assert got == ((count, True) if count else (0, False))
        self.reqs[rid] = Req("D", "matched" if count else "local", params, prompt_len, count=count, computed=computed)

    @precondition(lambda self: bool(self._in("D", "matched", "local", "waiting", "landed", "failed")))
    @rule(data=st.data())
    def decode_matched_again(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._in("D", "matched", "local", "waiting", "landed", "failed")))
        req = self.reqs[rid]
        got = self.book.matched_tokens(rid, req.params, req.prompt_len, req.computed)
        assert got == ((req.count, True) if req.state == "matched" else (0, False))

    @precondition(lambda self: bool(self._in("D", "matched", "local", "waiting", "landed")))
    @rule(data=st.data(), first=st.integers(0, 1000), spare=st.integers(0, 3))
    def decode_allocated(self, data: st.DataObject, first: int, spare: int) -> None:
        rid = data.draw(st.sampled_from(self._in("D", "matched", "local", "waiting", "landed")))
        req = self.reqs[rid]
        n = needed(req.prompt_len, self.block_size)
        blocks = list(range(first, first + n + spare))  # the hit's blocks first
        self.book.allocated(rid, req.params, req.prompt_len, [blocks], req.count if req.state == "matched" else 0)
        hit = req.computed // self.block_size
        if req.state == "matched":  # the first call registers the blocks after the hit; later ones add nothing
            self.expect.append(Order(rid, must_parse(req.params), (Blocks(hit, tuple(blocks[hit:n])),)))
            req.state = "waiting"
        elif req.state == "local" and not req.told and req.params["kvflow"]["mode"] == "push":
            self.expect.append(Order(rid, must_parse(req.params), (Blocks(n),)))  # P needn't wait
            req.told = True

    @precondition(lambda self: bool(self._in("D", "waiting")))
    @rule(data=st.data(), ok=st.booleans())
    def decode_load_reported(self, data: st.DataObject, ok: bool) -> None:
        rid = data.draw(st.sampled_from(self._in("D", "waiting")))
        self.book.output(set(), {rid}, set() if ok else {rid})
        self.reqs[rid].state = "landed" if ok else "failed"

    # ---------------------------------------------------------------- prefill side

    @precondition(lambda self: bool(self._free()))
    @rule(data=st.data(), prompt_len=st.integers(1, 40), mode=st.sampled_from(["push", "pull"]))
    def prefill_arrives(self, data: st.DataObject, prompt_len: int, mode: str) -> None:
        rid = data.draw(st.sampled_from(self._free()))
        params = self._new_params("do_remote_decode", mode)
        self.book.new_request(rid, params, prompt_len)
        self.reqs[rid] = Req("P", "prefilling", params, prompt_len)

    @precondition(lambda self: bool(self._in("P", "prefilling", "ordered", "preempted")))
    @rule(data=st.data(), tokens=st.integers(1, 24), first=st.integers(0, 1000))
    def prefill_scheduled(self, data: st.DataObject, tokens: int, first: int) -> None:
        """A chunk (or the whole prompt, or a decode step) is scheduled.  Push: the blocks it
        fills completely go out now, the rest with a later chunk; pull: all at the end."""
        rid = data.draw(st.sampled_from(self._in("P", "prefilling", "ordered", "preempted")))
        req = self.reqs[rid]
        n = needed(req.prompt_len, self.block_size)
        blocks = list(range(first, first + n + 1))
        self.book.scheduled(rid, req.computed, tokens, [blocks])
        req.computed += tokens
        params = must_parse(req.params)
        if req.state != "prefilling":
            return
        if req.computed >= req.prompt_len:
            self.ready.append(Order(rid, params, (Blocks(req.sent, tuple(blocks[req.sent : n])),), producer=True))
            req.state = "ordered"
        elif req.params["kvflow"]["mode"] == "push" and req.computed // self.block_size > req.sent:
            full = req.computed // self.block_size
            self.ready.append(
                Order(rid, params, (Blocks(req.sent, tuple(blocks[req.sent : full])),), producer=True, final=False)
            )
            req.sent = full

    @precondition(lambda self: bool(self._in("P", "prefilling", "ordered", "preempted")))
    @rule(data=st.data())
    def prefill_preempted(self, data: st.DataObject) -> None:
        """vLLM preempts the request, frees its blocks and recomputes it from the start."""
        rid = data.draw(st.sampled_from(self._in("P", "prefilling", "ordered", "preempted")))
        req = self.reqs[rid]
        self.book.preempted(rid)
        if req.state != "preempted" and (req.sent or req.state == "ordered"):
            self.abort.append((rid, must_parse(req.params)))
            req.state = "preempted"
        req.computed = 0

    # ---------------------------------------------------------------- refused params

    @precondition(lambda self: bool(self._free()))
    @rule(data=st.data(), bad=st.sampled_from([{"epoch": -1}, {"mode": 3}, {"transfer_id": ""}, {"decode": None}]))
    def malformed_request_arrives(self, data: st.DataObject, bad: dict[str, Any]) -> None:
        rid = data.draw(st.sampled_from(self._free()))
        kv = {**entry("bad"), **bad}
        params = {"do_remote_prefill": True, "do_remote_decode": True, "kvflow": kv}
        assert self.book.matched_tokens(rid, params, 10, 0) == (0, False)
        self.book.allocated(rid, params, 10, [[1, 2, 3]], 10)
        self.book.new_request(rid, params, 10)
        self.book.scheduled(rid, 0, 10, [[1, 2, 3]])
        self.reqs[rid] = Req("R", "refused", params, 10)

    # ---------------------------------------------------------------- both sides

    @precondition(lambda self: any(r.state != "held" for r in self.reqs.values()))
    @rule(data=st.data(), aborted=st.booleans())
    def request_finished(self, data: st.DataObject, aborted: bool) -> None:
        rid = data.draw(st.sampled_from([rid for rid, r in self.reqs.items() if r.state != "held"]))
        self._finish(rid, aborted)

    def _finish(self, rid: str, aborted: bool) -> None:
        req = self.reqs[rid]
        parsed = must_parse(req.params) if req.side != "R" else None
        got = self.book.finished(rid, aborted=aborted)
        if req.side == "D" and req.state == "waiting":
            assert got == (True, None)
            self.abort.append((rid, parsed))
            req.state = "held"
        elif req.side == "P" and req.state == "prefilling" and not req.sent:
            assert got == (False, None)
            self.abort.append((rid, parsed))
            del self.reqs[rid]
        elif req.side == "P" and req.state in ("prefilling", "preempted"):  # chunks went out
            assert got == (True, None)
            if req.state == "prefilling":
                self.abort.append((rid, parsed))
            req.state = "held"
        elif req.side == "P":  # its ready order went out
            assert got == (True, {"kvflow": req.params["kvflow"], "kvflow_prefill_finished": True})
            if aborted:
                self.abort.append((rid, parsed))
            req.state = "held"
        else:
            assert got == (False, None)
            del self.reqs[rid]

    @precondition(lambda self: bool(self._in("D", "held") + self._in("P", "held")))
    @rule(data=st.data(), how=st.sampled_from(["late free", "failed load", "landed"]))
    def blocks_released(self, data: st.DataObject, how: str) -> None:
        """A held request's blocks come back: as a late free, or (D) as a load that failed, or
        that succeeded just as the request ended (reported before the worker saw the abort)."""
        rid = data.draw(st.sampled_from(self._in("D", "held") + self._in("P", "held")))
        if how == "failed load" and self.reqs[rid].side == "D":
            self.book.output(set(), {rid}, {rid})
        elif how == "landed" and self.reqs[rid].side == "D":
            self.book.output(set(), {rid}, set())
        else:
            self.book.output({rid}, set(), set())
        del self.reqs[rid]

    @precondition(lambda self: bool(self._free()))
    @rule(data=st.data())
    def stray_reports(self, data: st.DataObject) -> None:
        ids = set(data.draw(st.lists(st.sampled_from(self._free()), max_size=2)))
        self.book.output(ids, ids, ids)

    @rule()
    def step(self) -> None:
        orders = self.book.take_orders()
        assert orders.expect == self.expect
        assert orders.ready == self.ready
        assert [(o.request_id, o.params) for o in orders.abort] == self.abort
        assert all(o.reason and not o.blocks for o in orders.abort)
        assert all(o.block_count for o in orders.ready)
        self.expect, self.ready, self.abort = [], [], []
        assert not self.book.take_orders()

    # ---------------------------------------------------------------- invariants

    @invariant()
    def tracks_exactly_the_live_transfers(self) -> None:
        expected = sum(r.state in TRACKED for r in self.reqs.values())
        assert self.book.tracked() == expected >= 0

    @invariant()
    def pending_work_while_something_is_outstanding(self) -> None:
        outstanding = bool(self.expect or self.ready or self.abort) or any(
            r.state in OUTSTANDING for r in self.reqs.values()
        )
        assert self.book.pending_work() is outstanding

    @invariant()
    def refused_lists_the_live_malformed_requests(self) -> None:
        assert set(self.book.refused) == {rid for rid, r in self.reqs.items() if r.side == "R"}

    def teardown(self) -> None:
        """Every request ends and the workers report every release: the book is left empty."""
        if not hasattr(self, "book"):
            return
        for rid in list(self.reqs):
            if self.reqs[rid].state != "held":
                self._finish(rid, aborted=True)
        for rid in list(self.reqs):
            self.book.output({rid}, set(), set())
            del self.reqs[rid]
        self.step()
        assert self.book.tracked() == 0 and not self.book.pending_work() and self.book.refused == {}


BookMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBookMachine = BookMachine.TestCase
