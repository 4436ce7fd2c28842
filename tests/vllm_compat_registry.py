"""The registry behind the compatibility matrix's tests: the table's rows, the scenarios that
check them, and the helpers scenarios share.

Why its own module: scenarios live in several modules (tests/vllm_compat_*.py, one per area,
plus tests/test_vllm_compat.py); each registers its rows here and tests/test_vllm_compat.py
imports them all before it checks that every row has a scenario.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvflow_tools.standin import StandInEngine
from tests.vllm_pairs import BLOCK_SIZE, dispatch, make_pair, move_and_check, settle

DOC = Path(__file__).resolve().parents[1] / "docs" / "vllm-compatibility.md"
OUTCOMES = {"moves", "refused at start-up", "refused at the handshake", "computed locally"}


RELEASES = {"0.33 stand-in", "0.32 engine"}  # where a row is shown (the table's last column)


def _cells() -> dict[str, list[str]]:
    found = {}
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 6:
            found[cells[0].strip("`")] = cells
    return found


def rows() -> dict[str, tuple[str, str]]:
    """id -> (outcome, the first quoted text of "what kvflow does")."""
    found = {}
    for row_id, cells in _cells().items():
        quoted = re.findall(r"`([^`]+)`", cells[4])
        found[row_id] = (cells[3], quoted[0] if quoted else "")
    return found


def releases() -> dict[str, set[str]]:
    """id -> where the row is shown ("holds on")."""
    return {row_id: {part.strip() for part in cells[5].split(",")} for row_id, cells in _cells().items()}


Scenario = Callable[[str, pytest.LogCaptureFixture], None]
SCENARIOS: dict[str, Scenario] = {}


def scenario(*ids: str) -> Callable[[Scenario], Scenario]:
    def register(fn: Scenario) -> Scenario:
        for row_id in ids:
            SCENARIOS[row_id] = fn
        return fn

    return register


Inspect = Callable[[StandInEngine, StandInEngine], object]


def moves(tid: str, prompt: int = 3 * BLOCK_SIZE + 7, inspect: Inspect | None = None, **options: Any) -> None:
    """P and D made with `options`; one request's KV moves and is checked; both engines end
    empty; then `inspect(p, d)` asserts more, before the engines close."""
    p, d = make_pair(**options)
    try:
        move_and_check(p, d, tid, prompt)
        if inspect is not None:
            inspect(p, d)
    finally:
        d.close()
        p.close()


def refused_at_handshake(
    fragment: str, caplog: pytest.LogCaptureFixture, p_deadline: float | None = None, **options: Any
) -> None:
    """D's request fails at once, naming `fragment`, and P frees its blocks at once too: its
    transfer deadline (600 s here) is not what ends P's request.  With `p_deadline`, P's request
    ends at that deadline (P ranks D never reaches hear nothing of the refusal)."""
    deadline = 600.0 if p_deadline is None else p_deadline
    options["extra"] = {"transfer_timeout": deadline, **options.get("extra", {})}
    p, d = make_pair(**options)
    try:
        with caplog.at_level(logging.ERROR, logger="kvflow.vllm"):
            p_req, d_req = dispatch(p, d, "refused", 2 * BLOCK_SIZE)
            settle((p, d), [p_req, d_req], limit=30.0)
        assert d_req.status == RequestStatus.FINISHED_ERROR
        assert fragment in caplog.text, caplog.text
    finally:
        d.close()
        p.close()


def bound(fn: Callable[..., None], **arguments: Any) -> Scenario:
    """A scenario that runs `fn(**arguments)`."""

    def run(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
        fn(**arguments)

    return run
