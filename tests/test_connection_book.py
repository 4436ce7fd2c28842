"""Which of the ROUTER's connections give their descriptors back when the process runs short
(kvflow/control/connection_book.py): a plain model under Hypothesis, and the order by example.

The properties: a connection carrying a routed peer's newest frames is never offered, nor one
younger than the grace that has not spoken; every other one is, unrouted senders first, then
the silent, then the superseded, oldest first within each; `prune` forgets exactly the closed.
"""

from __future__ import annotations

import resource
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.control.connection_book import ConnectionBook

SENDERS = ("P", "D", "X")

events = st.lists(
    st.tuples(
        st.sampled_from(["accepted", "spoke"]),
        st.integers(1, 12),  # inode
        st.sampled_from(SENDERS),
        st.floats(0, 10, allow_nan=False),
    ),
    max_size=40,
)


@given(events=events, routed=st.frozensets(st.sampled_from(SENDERS)), now=st.floats(0, 20, allow_nan=False))
def test_the_victims_are_every_connection_without_a_routed_peers_newest_frames_in_order(
    events: list[tuple[str, int, str, float]], routed: frozenset[str], now: float
) -> None:
    book = ConnectionBook(grace=1.0)
    model: dict[int, list[Any]] = {}  # inode -> [since, sender, spoke_at]
    for kind, inode, sender, at in sorted(events, key=lambda event: event[3]):
        entry = model.setdefault(inode, [at, None, 0.0])
        if kind == "accepted":
            book.accepted(inode, inode + 100, at)
        else:
            book.spoke(inode, inode + 100, sender, at)
            entry[1], entry[2] = sender, at
    newest: dict[str, float] = {}
    for _, sender, spoke_at in model.values():
        if sender is not None:
            newest[sender] = max(newest.get(sender, -1.0), spoke_at)
    groups: list[list[tuple[float, int]]] = [[], [], []]
    for inode, (since, sender, spoke_at) in model.items():
        if sender is None:
            if now - since > 1.0:
                groups[1].append((since, inode))
        elif sender not in routed:
            groups[0].append((spoke_at, inode))
        elif spoke_at < newest[sender]:
            groups[2].append((spoke_at, inode))
    expected = [(inode, inode + 100) for group in groups for _, inode in sorted(group)]
    assert book.victims(now, routed.__contains__) == expected
    assert len(book) == len(model)


def test_the_order_by_example() -> None:
    book = ConnectionBook(grace=1.0)
    book.accepted(1, 11, 0.0)  # silent since 0
    book.spoke(2, 12, "D", 1.0)  # D's old connection
    book.spoke(3, 13, "D", 2.0)  # D's newest: kept
    book.spoke(4, 14, "gone", 0.5)  # a peer no longer routed
    book.accepted(5, 15, 2.5)  # silent, within the grace at 3.0: kept
    assert book.victims(3.0, lambda sender: sender == "D") == [(4, 14), (1, 11), (2, 12)]
    book.prune(lambda inode, fd: inode != 4)  # 4 was closed meanwhile
    book.forget(1)
    book.forget(1)  # again: nothing
    assert book.victims(3.0, lambda sender: sender == "D") == [(2, 12)] and len(book) == 3


def test_a_negative_grace_is_refused() -> None:
    with pytest.raises(ValueError, match="grace"):
        ConnectionBook(grace=-1.0)


def test_pressure_lasts_the_window_after_a_connection_gave_way() -> None:
    book = ConnectionBook(grace=1.0)
    book.accepted(1, 11, 0.0)
    book.forget(1)  # closed by its other end: no pressure
    assert not book.pressed(5.0, 10.0)
    book.accepted(2, 12, 0.0)
    book.gave_way(2, 3.0)
    assert len(book) == 0 and book.pressed(3.0, 10.0) and book.pressed(13.0, 10.0)
    assert not book.pressed(13.5, 10.0)


@pytest.mark.parametrize("limit", [64, 128, 200, 256, 512, 1024, 4096, 1 << 16])
def test_what_the_channel_keeps_free_exceeds_what_a_hello_wants_at_every_limit(limit: int) -> None:
    # a peer whose connection got in (more than `keep_free` left) is not refused at its Hello,
    # and the Hello reserve covers at least two associations (about 11 descriptors each)
    from kvflow.control.connections import keep_free_for
    from kvflow.runtime.descriptors import reserve_for

    assert keep_free_for(limit) > reserve_for(limit) >= 22


def test_peers_being_added_count_against_the_descriptor_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hellos that arrive together all see the same count, before any of their files is open:
    16 names at once took a process at a limit of 256 to 6 descriptors left.  Each peer still
    being added counts as `PEER_DESCRIPTORS` more."""
    from kvflow.runtime import descriptors

    soft, reserve = 1024, 24
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (soft, soft))
    monkeypatch.setattr(descriptors, "open_descriptors", lambda: soft - reserve - descriptors.PEER_DESCRIPTORS)
    assert descriptors.headroom_problem(reserve) is None
    assert descriptors.headroom_problem(reserve, adding=1) is None
    problem = descriptors.headroom_problem(reserve, adding=2)
    assert problem is not None and f"{descriptors.PEER_DESCRIPTORS} for each of the 2 peers being added" in problem
