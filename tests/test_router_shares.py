"""The router's connection book (tools/kvflow_tools/routing/shares.py) against a model of it.

Hypothesis drives connections from a few addresses through admission, requests and closes; after
each step the book must agree with a plain model: never more than the cap, no address over its
share, only an idle connection evicted and the one idle longest, a refusal only when nothing idle
could give way, and a refusal changing nothing.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvflow_tools.routing.shares import Admitted, Refused, Shares

ADDRESSES = ("10.0.0.1", "10.0.0.2", "10.0.0.3")


class SharesMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.book = Shares(1, 1)
        self.ids = itertools.count()
        self.address: dict[int, str] = {}  # the model: connection -> address
        self.idle: list[int] = []  # idle ones, longest idle first

    @initialize(cap=st.integers(1, 6), share=st.integers(1, 8))
    def bounds(self, cap: int, share: int) -> None:
        self.book = Shares(cap, share)

    def _held(self, address: str) -> int:
        return sum(1 for a in self.address.values() if a == address)

    @rule(address=st.sampled_from(ADDRESSES))
    def connect(self, address: str) -> None:
        book, connection = self.book, next(self.ids)
        sharing = book.per_client < book.max_connections
        if sharing and self._held(address) >= book.per_client:
            candidates = [c for c in self.idle if self.address[c] == address]
            kind = "client_share"
        elif len(self.address) >= book.max_connections:
            candidates, kind = list(self.idle), "connections"
        else:
            candidates, kind = [], ""
        before = (len(book), book.idle_count)
        decision = book.admit(connection, address)
        if kind and not candidates:
            assert isinstance(decision, Refused) and decision.kind == kind, decision
            assert (len(book), book.idle_count) == before  # nothing changed
            return
        assert isinstance(decision, Admitted)
        expected = candidates[0] if kind else None
        assert decision.evicted == expected
        if expected is not None:
            del self.address[expected]
            self.idle.remove(expected)
        self.address[connection] = address
        self.idle.append(connection)  # silent since it was accepted

    @precondition(lambda self: self.address)
    @rule(data=st.data())
    def request_comes(self, data: st.DataObject) -> None:
        connection = data.draw(st.sampled_from(sorted(self.address)))
        self.book.busy(connection)
        if connection in self.idle:
            self.idle.remove(connection)

    @precondition(lambda self: self.address)
    @rule(data=st.data())
    def answered(self, data: st.DataObject) -> None:
        connection = data.draw(st.sampled_from(sorted(self.address)))
        self.book.idle(connection)
        if connection in self.idle:
            self.idle.remove(connection)
        self.idle.append(connection)

    @precondition(lambda self: self.address)
    @rule(data=st.data())
    def closed(self, data: st.DataObject) -> None:
        connection = data.draw(st.sampled_from(sorted(self.address)))
        self.book.gone(connection)
        self.book.gone(connection)  # the second time: nothing
        del self.address[connection]
        if connection in self.idle:
            self.idle.remove(connection)

    @invariant()
    def agrees(self) -> None:
        book = self.book
        assert len(book) == len(self.address) <= book.max_connections
        assert book.idle_count == len(self.idle)
        for address in ADDRESSES:
            assert book.held_by(address) == self._held(address)
            if book.per_client < book.max_connections:
                assert book.held_by(address) <= book.per_client


TestSharesMachine = SharesMachine.TestCase
TestSharesMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(cap=st.integers(-2, 0), share=st.integers(-2, 3))
def test_a_bound_below_one_is_refused(cap: int, share: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Shares(cap, share)
    with pytest.raises(ValueError, match="at least 1"):
        Shares(share + 3, cap)


def test_a_connection_admitted_twice_is_refused_and_changes_nothing() -> None:
    book = Shares(4, 2)
    assert book.admit("a", "10.0.0.1") == Admitted()
    with pytest.raises(ValueError, match="held already"):
        book.admit("a", "10.0.0.2")
    assert len(book) == 1 and book.held_by("10.0.0.1") == 1 and book.held_by("10.0.0.2") == 0
