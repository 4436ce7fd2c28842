"""Transition tables that say what every (state, event) pair does: a row, or declared ignored.

Why: a table built as "every pair ignored (or refused), then the rows" is total by
construction, so a test of its totality cannot fail, and a row someone forgot reads as a
decision to ignore that no one took.  `complete` takes the rows and, apart, the pairs declared
ignored, and refuses at import a pair that is in neither, in both, or not of the table's
states and events: adding a state or an event then fails until each of its pairs is decided.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from types import MappingProxyType
from typing import TypeVar

from kvflow.errors import UsageError

__all__ = ("complete", "pairs")

S = TypeVar("S", bound=Enum)
E = TypeVar("E", bound=Enum)
R = TypeVar("R")


def pairs(states: Iterable[S], events: Iterable[E]) -> set[tuple[S, E]]:
    """Every pair of one of `states` and one of `events`.  Never raises."""
    listed = list(events)
    return {(state, event) for state in states for event in listed}


def complete(
    name: str,
    states: type[S],
    events: type[E],
    rows: Mapping[tuple[S, E], R],
    ignored: Iterable[tuple[S, E]],
    ignore: Callable[[S], R],
) -> Mapping[tuple[S, E], R]:
    """The table `name`: `rows`, and `ignore(state)` for each pair of `ignored`, read-only.

    :raises UsageError: a pair of `states` x `events` has no row and is not declared ignored,
        has both, or a row or a declaration names a pair outside `states` x `events`.
    """
    declared = set(ignored)
    every = pairs(states, events)
    problems = [
        (what, sorted(f"{s.name}/{e.name}" for s, e in found))
        for what, found in (
            ("no row and not declared ignored", every - set(rows) - declared),
            ("a row and declared ignored", declared & set(rows)),
            ("not a pair of its states and events", (set(rows) | declared) - every),
        )
        if found
    ]
    if problems:
        raise UsageError(f"table {name}: " + "; ".join(f"{what}: {', '.join(found)}" for what, found in problems))
    return MappingProxyType({**{pair: ignore(pair[0]) for pair in declared}, **rows})
