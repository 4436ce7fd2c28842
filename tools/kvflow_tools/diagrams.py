"""State diagrams drawn from the transition tables: ``python -m kvflow_tools.diagrams [--check]``.

Why generated: the tables in `kvflow.protocol.transfer_tables` are the protocol's documentation, but a few
hundred rows are hard to see whole.  This draws one Mermaid ``stateDiagram-v2`` per mode and
role from the same data the core runs on, and one for each of the other machines' tables
(`kvflow.protocol.lifecycle`, `kvflow.protocol.phases`, `kvflow.protocol.teardown`, and the vLLM
connector's request stages, `kvflow.integrations.vllm.stages`, and a worker rank's requests,
`kvflow.integrations.vllm.request_book`), so the picture cannot drift from the
code; a test regenerates it and fails when the committed file is out of date (``--check`` does
the same).

What is drawn: every row that changes state or does something; rows with the same source,
target and effects share one edge, labelled ``INPUTS / EFFECTS``.  A row the core feeds by itself
(`STATE_TRIGGERED`) gets its own edge, marked with its condition.  ``[*]`` marks the initial
state and, as a target, the terminal ones.  Rows that only swallow an input (no effects, or only
IGNORE) are listed under each diagram instead of drawn as loops.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import TypeVar

from kvflow.integrations.vllm import request_book, stages
from kvflow.protocol import lifecycle, phases, teardown
from kvflow.protocol.state import (
    STATE_TRIGGERED,
    Effect,
    Input,
    Mode,
    Role,
    State,
    initial_state,
    is_initiator,
)
from kvflow.protocol.transfer_tables import TABLES, TERMINAL

__all__ = ("DEFAULT_OUTPUT", "main", "reachable_from", "render", "render_table")

DEFAULT_OUTPUT = Path(__file__).resolve().parents[2] / "docs" / "state-diagrams.md"
REGENERATE = "python -m kvflow_tools.diagrams"
_SIDES = [(mode, role) for mode in Mode for role in Role]
_STATE_ORDER = {state: index for index, state in enumerate(State)}
_INPUT_ORDER = {input_: index for index, input_ in enumerate(Input)}

_HEADER = f"""\
# State diagrams

Generated from the transition tables in `kvflow/protocol/transfer_tables.py` (transfers),
`kvflow/protocol/lifecycle.py` (an engine's life), `kvflow/protocol/phases.py` (a peer's
association), `kvflow/protocol/teardown.py` (torn-down peers), `integrations/vllm/stages.py`
(a request in the vLLM connector's book) and `integrations/vllm/request_book.py` (a request on a
worker rank) by
`{REGENERATE}`; do not edit by hand (a test fails when this file is out of date).

How to read them:

- an edge is labelled `INPUTS / EFFECTS`: any of the inputs moves the machine along it, and the
  machine then does the effects in order;
- an edge marked `(state-triggered if CONDITION)` is taken without an outside event: the core
  feeds that input itself as soon as the machine is in the state and the condition holds;
- `[*] -->` marks the state a machine starts in, `--> [*]` the terminal states;
- inputs a state swallows without doing anything (late, repeated or stray ones) are listed
  under each diagram rather than drawn.
"""


def render() -> str:
    """The whole Markdown document, the same text for the same tables."""
    parts = [_HEADER]
    for mode, role in _SIDES:
        parts.append(_render_side(mode, role))
    title = "## An engine's life (`kvflow/protocol/lifecycle.py`)"
    life = render_table(title, (lifecycle.START, ()), lifecycle.TABLE, [lifecycle.Life.CLOSED], lifecycle.Do.REFUSE)
    parts.append(life)
    title = "## A peer's association (`kvflow/protocol/phases.py`)"
    parts.append(render_table(title, (phases.Phase.NONE, ()), phases.TABLE, []))
    for kind, rows in teardown.TABLES.items():
        title = f"## A torn-down peer, {kind.value} (`kvflow/protocol/teardown.py`)"
        parts.append(render_table(title, teardown.START, rows, [teardown.Phase.ENDED]))
    for who, start in (("prefill (P)", stages.PREFILL_START), ("decode (D)", stages.DECODE_START)):
        title = f"## A {who} request in the vLLM connector's book (`integrations/vllm/stages.py`)"
        mine = reachable_from(stages.TABLE, start)
        side = {key: row for key, row in stages.TABLE.items() if key[0] in mine and key[0] is not stages.Stage.ENDED}
        parts.append(render_table(title, (start, ()), side, [stages.Stage.ENDED], stages.Do.IGNORE))
    parts += _worker_requests()
    return "\n".join(parts)


def _worker_requests() -> list[str]:
    """A worker rank's requests, P's and D's apart (D's start loading, or refused)."""
    stage, drawn = request_book.Stage, []
    for who, firsts in (("prefill (P)", [stage.SENDING]), ("decode (D)", [stage.LOADING, stage.REFUSED])):
        title = f"## A {who} request on a worker rank (`integrations/vllm/request_book.py`)"
        reached = set[request_book.Stage]().union(*(reachable_from(request_book.TABLE, first) for first in firsts))
        rows = {key: row for key, row in request_book.TABLE.items() if key[0] in reached and key[0] is not stage.ENDED}
        drawn.append(render_table(title, (firsts[0], ()), rows, [stage.ENDED], request_book.Do.IGNORE))
    return drawn


def reachable_from(rows: Mapping[tuple[S, E], tuple[S, object]], start: S) -> set[S]:
    """Every state the rows (``(state, input) -> (target, what it does)``) lead to from `start`,
    itself included."""
    seen, frontier = {start}, [start]
    while frontier:
        current = frontier.pop()
        for (source, _), (target, _) in rows.items():
            if source == current and target not in seen:
                seen.add(target)
                frontier.append(target)
    return seen


S = TypeVar("S", bound=Enum)  # a machine's states
E = TypeVar("E", bound=Enum)  # its events
D = TypeVar("D", bound=Enum)  # what its rows do


def render_table(
    title: str,
    start: tuple[S, tuple[D, ...]],
    rows: Mapping[tuple[S, E], tuple[S, tuple[D, ...]]],
    ends: Sequence[S],
    refuse: D | None = None,
) -> str:
    """One diagram of a small machine's table: rows keyed by (state, event) to (target, what it
    does).  Rows that keep the state and do nothing, or only `refuse`, are listed under it."""
    edges: dict[tuple[S, S, tuple[D, ...]], list[E]] = defaultdict(list)
    swallowed: dict[S, list[E]] = defaultdict(list)
    refused: dict[S, list[E]] = defaultdict(list)
    for (source, event), (target, dos) in rows.items():
        if target is source and not dos:
            swallowed[source].append(event)
        elif target is source and refuse is not None and dos == (refuse,):
            refused[source].append(event)
        else:
            edges[(source, target, dos)].append(event)
    first, effects = start
    lines = [title, "", "```mermaid", "stateDiagram-v2"]
    lines.append(f"    [*] --> {first.name}" + (" : / " + ", ".join(d.name for d in effects) if effects else ""))
    order = {state: index for index, state in enumerate(type(first))}
    for source, target, dos in sorted(edges, key=lambda e: (order[e[0]], order[e[1]], [d.name for d in e[2]])):
        events = ", ".join(e.name for e in sorted(edges[(source, target, dos)], key=lambda e: e.name))
        lines.append(
            f"    {source.name} --> {target.name} : {events}" + (" / " + ", ".join(d.name for d in dos) if dos else "")
        )
    lines += [f"    {end.name} --> [*]" for end in ends]
    lines.append("```")
    for heading, listed in (
        ("Swallowed without effect", swallowed),
        ("Refused, nothing changes", refused),
    ):
        if listed:
            lines += ["", f"{heading}:", ""]
            for state in sorted(listed, key=order.__getitem__):
                kept = sorted(listed[state], key=lambda e: e.name)
                lines.append(f"- {state.name}: " + ", ".join(e.name for e in kept))
    lines.append("")
    return "\n".join(lines)


def _render_side(mode: Mode, role: Role) -> str:
    table, triggers = TABLES[(mode, role)], STATE_TRIGGERED[(mode, role)]
    triggered = {(state, input_): condition for (state, condition), input_ in triggers.items()}
    edges: dict[tuple[State, State, tuple[Effect, ...], str], list[Input]] = defaultdict(list)
    swallowed: dict[State, list[Input]] = defaultdict(list)
    for (source, input_), (target, effects) in table.items():
        condition = triggered.get((source, input_))
        if condition is None and target is source and effects in ((), (Effect.IGNORE,)):
            swallowed[source].append(input_)
            continue
        mark = f" (state-triggered if {condition.name})" if condition is not None else ""
        edges[(source, target, effects, mark)].append(input_)
    side = "initiator" if is_initiator(mode, role) else "target"
    lines = [
        f"## {mode.value} mode, {role.value} side ({side})",
        "",
        "```mermaid",
        "stateDiagram-v2",
        f"    [*] --> {initial_state(role).name}",
    ]
    for source, target, effects, mark in sorted(edges, key=_edge_order):
        inputs = ", ".join(i.name for i in sorted(edges[(source, target, effects, mark)], key=_INPUT_ORDER.__getitem__))
        label = inputs + (" / " + ", ".join(a.name for a in effects) if effects else "") + mark
        lines.append(f"    {source.name} --> {target.name} : {label}")
    states = {state for state, _ in table} | {step.target for step in table.values()}
    for state in sorted(states & TERMINAL, key=_STATE_ORDER.__getitem__):
        lines.append(f"    {state.name} --> [*]")
    lines += ["```", "", "Swallowed without effect:", ""]
    for state in sorted(swallowed, key=_STATE_ORDER.__getitem__):
        inputs = ", ".join(i.name for i in sorted(swallowed[state], key=_INPUT_ORDER.__getitem__))
        lines.append(f"- {state.name}: {inputs}")
    lines.append("")
    return "\n".join(lines)


def _edge_order(edge: tuple[State, State, tuple[Effect, ...], str]) -> tuple[int, int, list[str], str]:
    source, target, effects, mark = edge
    return _STATE_ORDER[source], _STATE_ORDER[target], [a.name for a in effects], mark


def main(argv: list[str] | None = None) -> int:
    """Write the diagrams (exit 0), or with ``--check`` compare them (exit 1 when stale).

    :raises OSError: the output file cannot be read or written.
    """
    parser = argparse.ArgumentParser(prog="kvflow diagrams", description="state diagrams from the tables")
    parser.add_argument("--check", action="store_true", help="fail if the file is out of date, write nothing")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="default: docs/state-diagrams.md")
    args = parser.parse_args(argv)
    text = render()
    output: Path = args.output
    if args.check:
        if not output.exists() or output.read_text(encoding="utf-8") != text:
            sys.stderr.write(f"{output} is out of date with the transition tables; run: {REGENERATE}\n")
            return 1
        return 0
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
