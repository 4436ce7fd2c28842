"""The registry behind the compatibility matrix's tests: the table's rows, the scenarios that
check them, and the helpers scenarios share.

Why its own module: scenarios live in several modules (tests/vllm_compat_*.py, one per area,
plus tests/test_vllm_compat.py); each registers its rows here and tests/test_vllm_compat.py
imports them all before it checks that every row has a scenario.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

import kvflow.runtime.dataplane as dataplane_module
from kvflow.layout import DescriptorPlan, KVLayout, plan_transfer
from kvflow.transports.loopback import FaultPlan, LoopbackFabric
from kvflow_tools.standin import StandInEngine
from kvflow_tools.standin.fabrics import install_fabric
from tests.vllm_pairs import BLOCK_SIZE, dispatch, fabric, make_pair, move_and_check, settle

DOC = Path(__file__).resolve().parents[1] / "docs" / "vllm-compatibility.md"
OUTCOMES = {"moves", "refused at start-up", "refused at the handshake", "computed locally"}


# Where a row is shown (the table's last column): vLLM 0.34's and 0.33's scheduler and
# allocation with the stand-in (scripts/test runs the vLLM tests in .venv and .venv-vllm-033),
# and real vLLM 0.32 servers of the CPU build.
STAND_INS = {"0.34 stand-in", "0.33 stand-in"}
RELEASES = {*STAND_INS, "0.32 engine"}


def stand_in_here() -> str:
    """The "holds on" label of the vLLM this process runs the stand-in with."""
    import vllm

    return ".".join(vllm.__version__.split(".")[:2]) + " stand-in"


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


def areas() -> dict[str, str]:
    """id -> the row's area ("KV layout", "attention", ...)."""
    return {row_id: cells[1] for row_id, cells in _cells().items()}


def releases() -> dict[str, set[str]]:
    """id -> where the row is shown ("holds on")."""
    return {row_id: {part.strip() for part in cells[5].split(",")} for row_id, cells in _cells().items()}


def rows_here() -> list[str]:
    """The rows this process checks: those shown on the stand-in of the vLLM it runs, and those
    shown on no stand-in (their scenarios check release strings, whatever vLLM runs them)."""
    here = stand_in_here()
    return sorted(row for row, shown in releases().items() if here in shown or not shown & STAND_INS)


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
    empty; then `inspect(p, d)` asserts more, before the engines close.  Inside
    `integrity_probe`, the row is also run with the integrity check on, and must catch faults."""
    if _probed is not None:
        _probed.append(tid)
        return checked_with_faults(tid, prompt, inspect, options)
    p, d = make_pair(**options)
    try:
        move_and_check(p, d, tid, prompt)
        if inspect is not None:
            inspect(p, d)
    finally:
        d.close()
        p.close()


_probed: list[str] | None = None  # the rows `moves` ran since `integrity_probe` began


@contextlib.contextmanager
def integrity_probe() -> Iterator[list[str]]:
    """While it lasts, `moves` runs its row with the integrity check on both sides (the ids of
    the requests it ran are yielded): the KV moves and is checked as without it; a byte flipped
    in flight, then a planner that writes P's blocks into the wrong D blocks, each fail D's
    request with the block named; and the next request moves again."""
    global _probed
    _probed = []
    try:
        yield _probed
    finally:
        _probed = None


def checked_with_faults(tid: str, prompt: int, inspect: Inspect | None, options: dict[str, Any]) -> None:
    """What `moves` does inside `integrity_probe`: P and D made with `options` and the integrity
    check on; a request moves; one with a byte flipped in flight, then one whose blocks P's
    planner maps wrong, fail at D with the block named; and a last one moves."""
    assert options.get("transport", "loopback") == "loopback", "faults are injected on the loopback fabric"
    name, faults = fabric(), FaultPlan()
    network = LoopbackFabric(faults=faults)
    install_fabric(name, network)
    extra = {**options.pop("extra", {}), "fabric": name, "integrity": True, "transfer_timeout": 600.0}
    p, d = make_pair(extra=extra, **options)
    try:
        move_and_check(p, d, tid, prompt)
        if inspect is not None:
            inspect(p, d)
        faults.corrupt_ops.add(network.op_count + 1)  # the next op lands with a byte flipped
        _caught(p, d, f"{tid}-flipped", prompt)
        with _remapped():
            _caught(p, d, f"{tid}-remapped", prompt)
        d.checked.clear()
        move_and_check(p, d, f"{tid}-after", prompt)
    finally:
        d.close()
        p.close()


INTEGRITY_FAILURE = re.compile(r"integrity: \S+ -> \S+: the bytes that landed in layers? [\d, ]+ and blocks? \d")


def _caught(p: StandInEngine, d: StandInEngine, tid: str, prompt: int) -> None:
    """D's request fails before it decodes, a rank's transfer failing for the reason the
    integrity check gives, naming the rank pair, the layers and the blocks; nothing is leaked."""
    with _logged("kvflow.runtime.engine") as reasons, _logged("kvflow.vllm") as worker:
        p_req, d_req = dispatch(p, d, tid, prompt)
        settle((p, d), [p_req, d_req], limit=30.0)
    assert d_req.status == RequestStatus.FINISHED_ERROR and not d_req.output_token_ids, d_req.status
    assert any(INTEGRITY_FAILURE.search(reason) for reason in reasons), reasons
    # vLLM answers such a request with a bare HTTP 500: D's worker names the request and the
    # transfer whose engine line (above) says why; another rank's transfer of the same request
    # is then aborted on purpose, and says so
    said = re.compile(rf"the KV of {re.escape(d_req.request_id)} did not load: transfer (\S+) (\w+) ")
    outcomes = {m.group(1): m.group(2) for m in map(said.search, worker) if m}
    failed = {tag for tag, outcome in outcomes.items() if outcome == "failed"}
    assert failed and all(any(f"transfer {tag} failed: integrity" in r for r in reasons) for tag in failed), (
        worker,
        reasons,
    )
    assert set(outcomes.values()) <= {"failed", "aborted"}, worker


@contextlib.contextmanager
def _logged(name: str) -> Iterator[list[str]]:
    """The messages logger `name` logs at WARNING and above meanwhile."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def _remapped() -> Iterator[None]:
    """P's planner sends its blocks to D's in reverse order (one D block: to the block after it)."""
    planner = plan_transfer

    def remapped(
        local: KVLayout, remote: KVLayout, local_blocks: Sequence[int], remote_blocks: Sequence[int], *a: Any, **kw: Any
    ) -> DescriptorPlan:
        ids = list(remote_blocks)
        wrong = ids[::-1] if len(set(ids)) > 1 else [(ids[0] + 1) % remote.num_blocks]
        return planner(local, remote, local_blocks, wrong, *a, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dataplane_module, "plan_transfer", remapped)  # the writer looks it up by name
        yield


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
