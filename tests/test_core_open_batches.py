"""A push whose batch count D leaves open: P's token budget splits a long prompt into chunks
only P sees, so D registers `OPEN_BATCHES` and P's last WRITE notification says it is the last.

What must hold: D completes only once every batch up to P's last has landed; P's batches tile
D's blocks x layers exactly (a gap or an overlap is a clear error on P and fails D, never a
silent success); a batch after the last, or a second last, fails D.  Two pure cores."""

from __future__ import annotations

import pytest

from kvflow.control import wire
from kvflow.errors import ConfigError, InvalidBatch
from kvflow.protocol.actions import Action, Resolve, SendMessage, SubmitOp
from kvflow.protocol.core import CoreConfig, TransferCore
from kvflow.protocol.messages import (
    OPEN_BATCHES,
    Message,
    Notice,
    Registration,
    TransferKey,
    decode_notification,
    encode_notification,
)
from kvflow.protocol.requests import Expect, KvReady
from kvflow.protocol.state import Mode, Outcome, Role, State

KEY = TransferKey("long", 1)
CONFIG = CoreConfig(fence_timeout=2.0, retention=30.0)
LAYERS = 2


def messages(actions: list[Action]) -> list[Message]:
    return [a.message for a in actions if isinstance(a, SendMessage)]


def verdicts(actions: list[Action]) -> list[tuple[Role, Outcome]]:
    return [(a.role, a.outcome) for a in actions if isinstance(a, Resolve)]


def registered(blocks: int = 4) -> tuple[TransferCore, TransferCore]:
    """D registered `blocks` blocks with an open batch count; P has the registration."""
    p, d = TransferCore("P", LAYERS, CONFIG), TransferCore("D", LAYERS, CONFIG)
    d.peer_connected("P", 0.0)
    p.peer_connected("D", 0.0)
    ids = list(range(10, 10 + blocks))
    (registration,) = messages(
        d.expect(
            Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=ids, expected_batches=OPEN_BATCHES), now=0.0, deadline=50.0
        )
    )
    assert isinstance(registration, Registration) and registration.expected_batches == OPEN_BATCHES
    p.receive("D", registration, 0.1)
    return p, d


def chunk(
    p: TransferCore, first: int, count: int, layers: tuple[int, int], final: bool, now: float = 1.0
) -> list[Action]:
    ids = list(range(100 + first, 100 + first + count))
    return p.kv_ready(KvReady(KEY, block_ids=ids, final=final, first_position=first, layers=layers, peer="D"), now=now)


def written(p: TransferCore, actions: list[Action], now: float = 2.0) -> list[bytes]:
    """Complete every WRITE in `actions`; their notifications, in submission order."""
    notes = []
    for op in [a for a in actions if isinstance(a, SubmitOp)]:
        p.op_submitted(op.op_id, now)
        p.op_finished(op.op_id, now)
        notes.append(op.notification)
    return notes


def three_chunks(p: TransferCore) -> list[bytes]:
    """Positions 0..1 and 2 in two layer groups each, then the final chunk, position 3."""
    actions: list[Action] = []
    for first, count, final in ((0, 2, False), (2, 1, False), (3, 1, True)):
        actions += chunk(p, first, count, (0, 1), False)
        actions += chunk(p, first, count, (1, 2), final)
    return written(p, actions)


def test_decode_completes_only_when_every_batch_up_to_the_last_landed() -> None:
    p, d = registered()
    notes = three_chunks(p)
    assert len(notes) == 6
    assert [decode_notification(n)[2] for n in notes] == [False] * 5 + [True]
    # The last batch's notification first: D now knows the count, but five batches are missing.
    assert verdicts(d.notification("P", notes[-1], 3.0)) == []
    for note in notes[:-2]:
        assert verdicts(d.notification("P", note, 3.0)) == []
    assert d.machine(KEY, Role.DECODE).state is not State.NOTIFIED
    assert verdicts(d.notification("P", notes[-2], 3.0)) == [(Role.DECODE, Outcome.SUCCEEDED)]


def test_a_gap_fails_both_sides_with_a_clear_reason() -> None:
    p, d = registered()
    actions = chunk(p, 0, 2, (0, 2), False)
    actions += chunk(p, 3, 1, (0, 2), True)  # position 2 never produced
    notes = written(p, actions)
    assert len(notes) == 1  # the final batch is never written: it cannot complete the transfer
    (notice,) = [m for m in messages(actions) if isinstance(m, Notice)]
    assert notice.outcome is Outcome.FAILED
    assert "covers 6 block-layers up to position 4, D registered 4 blocks" in notice.reason
    assert verdicts(d.receive("P", notice, 2.5)) == [(Role.DECODE, Outcome.FAILED)]
    assert verdicts(d.notification("P", notes[0], 2.6)) == []


def test_an_overlap_is_refused_and_changes_nothing() -> None:
    p, _ = registered()
    chunk(p, 0, 2, (0, 2), False)
    before = len(p.machine(KEY, Role.PREFILL).batches)
    with pytest.raises(InvalidBatch, match="overlaps batch 0"):
        chunk(p, 1, 2, (1, 2), True)
    assert len(p.machine(KEY, Role.PREFILL).batches) == before


def test_more_than_registered_is_a_clear_error() -> None:
    p, _ = registered(2)
    actions = chunk(p, 0, 3, (0, 2), True)
    (notice,) = [m for m in messages(actions) if isinstance(m, Notice)]
    assert "reaches block position 3 but D registered 2 blocks" in notice.reason


@pytest.mark.parametrize(
    ("sequence", "problem"),
    [
        ([(1, True), (2, False)], "notification for batch 2, but P makes 2"),
        ([(1, True), (0, True)], "after it said batch 1"),
        ([(2, False), (1, True)], "but batch 2 landed"),
    ],
)
def test_a_batch_beyond_the_last_fails_decode(sequence: list[tuple[int, bool]], problem: str) -> None:
    """What a faulty peer could send: D fails the transfer (it waits for P's fence), and says why."""
    _, d = registered()
    actions: list[Action] = []
    for batch, last in sequence:
        actions += d.notification("P", encode_notification(KEY, batch, last), 3.0)
    assert verdicts(actions) == [(Role.DECODE, Outcome.FAILED)]
    assert problem in d.machine(KEY, Role.DECODE).reason


def test_a_fixed_count_still_checks_the_last_batch() -> None:
    d = TransferCore("D", LAYERS, CONFIG)
    d.peer_connected("P", 0.0)
    d.expect(Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[1, 2], expected_batches=3), now=0.0, deadline=50.0)
    assert verdicts(d.notification("P", encode_notification(KEY, 0, True), 1.0)) == [(Role.DECODE, Outcome.FAILED)]
    assert "D expects 3 writes" in d.machine(KEY, Role.DECODE).reason


def test_open_count_is_for_push_only_and_travels_on_the_wire() -> None:
    d = TransferCore("D", LAYERS, CONFIG)
    with pytest.raises(ConfigError, match="1 in pull mode"):
        d.expect(
            Expect(KEY, peer="P", mode=Mode.PULL, block_ids=[1], expected_batches=OPEN_BATCHES), now=0.0, deadline=5.0
        )
    with pytest.raises(ConfigError, match="got -1"):
        d.expect(Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[1], expected_batches=-1), now=0.0, deadline=5.0)
    assert d.machines() == []
    registration = Registration(KEY, (1, 2), OPEN_BATCHES, 5.0)
    envelope = wire.Envelope("D", 1, "P", 1, registration)
    assert wire.decode(wire.encode(envelope)).message == registration
