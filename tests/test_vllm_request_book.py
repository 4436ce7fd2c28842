"""A worker rank's book of requests (`kvflow.integrations.vllm.request_book`): what it reports to
vLLM, and when, whatever order the engine's answers, its releases, aborts and vLLM's finished ids
come in.

The table's rows are checked against a model written apart from it: a decode request is in
``finished_recving`` once, when its last pair has ended, and in ``failed_recving`` (its blocks as
load errors) when a pair never started, or failed and the request was not aborted; a prefill
request is in ``finished_sending`` once, when kvflow holds none of its blocks and vLLM has said it
finished, in either order; a reported request is forgotten.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvflow.errors import ConfigError, TransferTimeout
from kvflow.integrations.vllm.request_book import TABLE, Do, Event, RequestBook, Stage
from kvflow.protocol.actions import ReleaseBlocks
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Outcome, Role
from kvflow_tools.diagrams import reachable_from

OUTCOMES = st.sampled_from([Outcome.SUCCEEDED] * 3 + [Outcome.ABORTED, Outcome.FAILED, Outcome.EXPIRED])  # most land
NOTHING: tuple[set[str], set[str], set[str]] = (set(), set(), set())


def release(key: TransferKey, role: Role, outcome: Outcome = Outcome.SUCCEEDED) -> ReleaseBlocks:
    return ReleaseBlocks(key, role, (), outcome)


def failed(error: Exception) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_exception(error)
    return future


def test_a_request_ends_on_a_rank_when_its_last_pair_ends_and_fails_if_any_failed() -> None:
    aborted: list[tuple[TransferKey, Role, str]] = []
    book = RequestBook("decode-tp0", lambda key, role, reason: aborted.append((key, role, reason)))
    a, b = TransferKey("a", 1), TransferKey("b", 1)
    book.expecting("r", [a, b], [4, 5])
    assert book.results([release(a, Role.DECODE, Outcome.FAILED)], []) == NOTHING
    assert aborted == [(b, Role.DECODE, "another rank's transfer of r failed")]  # the rest ends at once
    assert book.results([release(TransferKey("zz", 1), Role.DECODE)], []) == NOTHING  # unknown pair: nothing
    assert book.results([release(b, Role.DECODE, Outcome.ABORTED)], []) == (set(), {"r"}, {"r"})
    assert book.take_load_errors() == {4, 5} and book.take_load_errors() == set()
    assert book.stage("r") is None and book.results([release(b, Role.DECODE)], []) == NOTHING


def test_an_aborted_load_is_received_not_failed_unless_a_pair_never_started() -> None:
    book = RequestBook("decode-tp0", lambda key, role, reason: None)
    a, b, c = TransferKey("a", 1), TransferKey("b", 1), TransferKey("c", 1)
    book.expecting("r", [a], [1])
    book.expecting("s", [b, c], [2])
    book.awaiting("s", failed(TransferTimeout("no handshake")), c)
    book.abort("r", "decode request aborted")
    book.abort("s", "decode request aborted")
    assert book.stage("r") is book.stage("s") is Stage.ABORTING
    assert book.results([release(a, Role.DECODE, Outcome.ABORTED)], []) == (set(), {"r"}, set())
    assert book.results([release(b, Role.DECODE, Outcome.ABORTED)], []) == (set(), {"s"}, {"s"})
    assert book.take_load_errors() == {2}
    book.refused("t", [3], failed(ConfigError("no such P rank")))
    book.abort("t", "decode request aborted")  # nothing was registered: nothing to abort
    assert book.results([], ["t"]) == (set(), {"t"}, {"t"}) and book.take_load_errors() == {3}


def test_a_prefill_request_is_sent_once_released_and_finished_in_either_order() -> None:
    book = RequestBook("prefill-tp0", lambda key, role, reason: None)
    a, b = TransferKey("a", 1), TransferKey("b", 1)
    assert book.hand_over("early", a) and not book.hand_over("early", a)  # a pair opens once
    assert book.hand_over("late", b)
    assert book.results([release(a, Role.PREFILL)], []) == NOTHING and book.stage("early") is Stage.RELEASED
    assert book.results([], ["late"]) == NOTHING and book.finished_waiting == 1
    assert book.results([release(b, Role.PREFILL, Outcome.FAILED)], ["early", "unknown"]) == (
        {"early", "late"},
        set(),
        set(),
    )
    assert book.finished_waiting == 0 and book.stage("early") is book.stage("late") is None
    book.nothing_taken("none")  # no part transfer on this rank: vLLM frees its blocks once finished
    assert book.results([], ["none"]) == ({"none"}, set(), set())


def test_a_prefill_pair_handed_over_again_after_its_release_holds_the_blocks_until_it_ends() -> None:
    book = RequestBook("prefill-tp0", lambda key, role, reason: None)
    a, b = TransferKey("a", 1), TransferKey("b", 1)
    book.hand_over("r", a)
    book.results([release(a, Role.PREFILL, Outcome.ABORTED)], [])
    assert book.hand_over("r", b) and book.stage("r") is Stage.SENDING
    assert book.results([], ["r"]) == NOTHING  # kvflow holds its blocks again
    assert book.results([release(b, Role.PREFILL)], []) == ({"r"}, set(), set())


def test_the_table_ends_every_stage_and_reports_only_what_ends_a_request() -> None:
    for start in (Stage.REFUSED, Stage.LOADING, Stage.SENDING, Stage.RELEASED):
        assert Stage.ENDED in reachable_from(TABLE, start), start
    reports = {Do.REPORT_RECEIVED, Do.REPORT_FAILED, Do.REPORT_SENT}
    for (stage, event), (target, dos) in TABLE.items():
        if Do.IGNORE in dos:
            assert dos == (Do.IGNORE,) and target is stage, (stage, event)
        assert (target is Stage.ENDED and stage is not Stage.ENDED) == bool(reports & set(dos)), (stage, event)
    assert all(TABLE[(Stage.ENDED, event)] == (Stage.ENDED, (Do.IGNORE,)) for event in Event)


@dataclass
class Model:
    """What the rules say of one request, kept apart from the book."""

    role: Role
    blocks: tuple[int, ...] = ()
    keys: list[TransferKey] = field(default_factory=list)
    open: list[TransferKey] = field(default_factory=list)
    answers: dict[TransferKey | None, concurrent.futures.Future[Any]] = field(default_factory=dict)
    lost: set[TransferKey] = field(default_factory=set)
    failed: bool = False
    hard: bool = False
    aborted: bool = False
    refused: bool = False
    finished: bool = False


class RequestBookMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.aborts: list[tuple[TransferKey, Role]] = []
        self.book = RequestBook("rank", lambda key, role, reason: self.aborts.append((key, role)))
        self.live: dict[str, Model] = {}
        self.ended: set[str] = set()  # reported: forgotten
        self.said_finished: set[str] = set()
        self.releases: list[ReleaseBlocks] = []
        self.finishing: list[str] = []
        self.count = 0

    def _new(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def _key(self, request_id: str) -> TransferKey:
        self.count += 1
        return TransferKey(f"{request_id}/{self.count}", 1)

    def _pick(self, data: st.DataObject, role: Role, *, held: bool = True) -> str | None:
        ids = sorted(rid for rid, m in self.live.items() if m.role is role and (bool(m.open) or not held))
        return data.draw(st.sampled_from(ids)) if ids else None

    # ------------------------------------------------------------------ D

    @rule(pairs=st.integers(1, 2))
    def expect(self, pairs: int) -> None:
        rid = self._new("d")
        model = self.live[rid] = Model(Role.DECODE, (self.count, self.count + 100))
        model.keys = [self._key(rid) for _ in range(pairs)]
        model.open = list(model.keys)
        self.book.expecting(rid, model.keys, model.blocks)
        for key in model.keys:
            model.answers[key] = concurrent.futures.Future()
            self.book.awaiting(rid, model.answers[key], key)

    @rule()
    def refuse(self) -> None:
        rid = self._new("d")
        model = self.live[rid] = Model(Role.DECODE, (self.count,), refused=True)
        model.answers[None] = failed(ConfigError("no such P rank"))
        self.book.refused(rid, model.blocks, model.answers[None])

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = self._pick(data, Role.DECODE, held=False)
        if rid is None:
            return
        model, self.aborts = self.live[rid], []
        self.book.abort(rid, "decode request aborted")
        if not model.refused:
            model.aborted = True
            assert self.aborts == [(key, Role.DECODE) for key in model.open]

    # ------------------------------------------------------------------ P

    @rule(data=st.data(), new=st.booleans())
    def hand_over(self, data: st.DataObject, new: bool) -> None:
        pick = self._pick(data, Role.PREFILL, held=False)
        rid = self._new("p") if new or pick is None else pick
        model = self.live.setdefault(rid, Model(Role.PREFILL))
        if model.finished:
            return  # vLLM says a request finished once its last chunk is saved
        if not model.open:  # (again) kvflow takes its blocks
            model.keys, model.failed, model.hard = [], False, False
        key = self._key(rid)
        assert self.book.hand_over(rid, key)
        model.keys.append(key)
        model.open.append(key)
        model.answers[key] = concurrent.futures.Future()
        self.book.awaiting(rid, model.answers[key], key)
        assert not self.book.hand_over(rid, model.keys[0])  # a pair opens once

    @rule()
    def nothing_taken(self) -> None:
        rid = self._new("p")
        self.live[rid] = Model(Role.PREFILL)
        self.book.nothing_taken(rid)

    # ------------------------------------------------------------------ the engine and vLLM

    @rule(data=st.data(), ok=st.sampled_from([True, True, True, False]))  # most start
    def answer(self, data: st.DataObject, ok: bool) -> None:
        pending = sorted(
            ((rid, key) for rid, m in self.live.items() for key, f in m.answers.items() if key and not f.done()),
            key=str,
        )
        if not pending:
            return
        rid, key = data.draw(st.sampled_from(pending))
        answer = self.live[rid].answers[key]
        answer.set_result(None) if ok else answer.set_exception(TransferTimeout("refused"))

    @rule(data=st.data(), outcome=OUTCOMES)
    def release(self, data: st.DataObject, outcome: Outcome) -> None:
        self._release(data, outcome)

    @rule(data=st.data(), outcome=OUTCOMES)
    def release_another(self, data: st.DataObject, outcome: Outcome) -> None:
        self._release(data, outcome)

    def _release(self, data: st.DataObject, outcome: Outcome) -> None:
        queued = {r.key for r in self.releases}
        pairs = sorted(((rid, k) for rid, m in self.live.items() for k in m.open if k not in queued), key=str)
        if pairs:
            rid, key = data.draw(st.sampled_from(pairs))
            self.releases.append(release(key, self.live[rid].role, outcome))

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        ids = sorted(set(self.live) - self.said_finished)
        if ids:
            rid = data.draw(st.sampled_from(ids))
            self.said_finished.add(rid)
            self.finishing.append(rid)

    @rule(dies=st.sampled_from([False] * 7 + [True]))  # now and then
    def engine_dies(self, dies: bool) -> None:
        if not dies:
            return
        self.book.engine_lost()
        for model in self.live.values():
            model.lost |= set(model.open)

    @rule()
    def results(self) -> None:
        self.aborts = []
        expected: tuple[set[str], set[str], set[str]] = (set(), set(), set())
        aborts: list[tuple[TransferKey, Role]] = []
        errors: set[int] = set()
        for rid, model in list(self.live.items()):
            for key, answer in list(model.answers.items()):
                if answer.done():
                    del model.answers[key]
                    if answer.exception() is not None:
                        self._close(rid, key, expected, aborts, errors, hard=True)
        for rid, model in list(self.live.items()):
            for key in [key for key in model.open if key in model.lost]:
                self._close(rid, key, expected, aborts, errors, hard=True)
            model.lost.clear()
        for each in self.releases:
            owner = next((rid for rid, m in self.live.items() if each.key in m.open), None)
            if owner is not None:
                bad = each.role is Role.DECODE and each.outcome is not Outcome.SUCCEEDED
                self._close(owner, each.key, expected, aborts, errors, failed=bad)
        for rid in self.finishing:
            finishing = self.live.get(rid)
            if finishing is not None and finishing.role is Role.PREFILL:
                finishing.finished = True
                if not finishing.open:
                    self._report(rid, expected[0])
        got = self.book.results(self.releases, list(self.finishing))
        self.releases, self.finishing = [], []
        assert got == expected
        assert self.aborts == aborts
        assert self.book.take_load_errors() == errors

    def _close(self, rid: str, key: TransferKey | None, expected: Any, aborts: list[Any], errors: set[int],
               *, failed: bool = False, hard: bool = False) -> None:  # fmt: skip
        model = self.live.get(rid)
        if model is None:  # reported already (a closed pair's answer, after the last one)
            return
        if key in model.open:
            assert key is not None
            model.open.remove(key)
            model.failed |= failed or hard
            model.hard |= hard
            if model.open:
                if model.role is Role.DECODE and (failed or hard):
                    aborts += [(other, Role.DECODE) for other in model.open]
                return
        elif key is not None or not model.refused:
            if model.role is Role.DECODE and (failed or hard):
                aborts += [(other, Role.DECODE) for other in model.open]
            return
        if model.role is Role.PREFILL:
            if model.finished:
                self._report(rid, expected[0])
            return
        self._report(rid, expected[1])
        if model.refused or model.hard or (model.failed and not model.aborted):
            expected[2].add(rid)
            errors |= set(model.blocks)

    def _report(self, rid: str, into: set[str]) -> None:
        assert rid not in self.ended  # once
        into.add(rid)
        self.ended.add(rid)
        del self.live[rid]

    @invariant()
    def a_reported_request_is_forgotten_and_a_live_one_is_not(self) -> None:
        assert all(self.book.stage(rid) is None for rid in self.ended)
        assert all(self.book.stage(rid) is not None for rid in self.live)
        waiting = sum(1 for m in self.live.values() if m.role is Role.PREFILL and m.finished and m.open)
        assert self.book.finished_waiting == waiting

    @invariant()
    def aborting_is_what_vllm_aborted(self) -> None:
        for rid, model in self.live.items():
            if model.role is Role.DECODE and not model.refused:
                assert (self.book.stage(rid) is Stage.ABORTING) == model.aborted


RequestBookMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_the_book_reports_each_request_once_as_the_rules_say = RequestBookMachine.TestCase
