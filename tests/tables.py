"""Walking a transition table: the states reachable from one, for the tables' totality tests."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping
from typing import Any, TypeVar

S = TypeVar("S", bound=Hashable)


def reachable_from(rows: Mapping[tuple[S, Any], tuple[S, Any]], start: S) -> set[S]:
    """Every state the rows (``(state, input) -> (target, what it does)``) lead to from `start`,
    itself included."""
    seen, frontier = {start}, deque([start])
    while frontier:
        current = frontier.popleft()
        for (source, _), (target, _) in rows.items():
            if source == current and target not in seen:
                seen.add(target)
                frontier.append(target)
    return seen
