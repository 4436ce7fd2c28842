"""Chunks of P's that end inside one of D's larger blocks (D's block size twice P's): P's token
budget, not D's block size, decides where a chunk ends, so one D block may be filled by two
WRITEs, each at its own token offset.  Two pure cores.

What must hold: each WRITE names the D blocks it touches and where in the first one its P
blocks start (`SubmitOp.fine_start`); D completes only once both halves of the shared block
have landed; and a transfer that ends while a D block is only half written (abort, failure,
expiry) keeps D's blocks quarantined until P's WRITEs are fenced, then returns every block
once on both sides."""

from __future__ import annotations

from kvflow.protocol.actions import Action, ReleaseBlocks, Resolve, SendMessage, SubmitOp
from kvflow.protocol.core import CoreConfig, TransferCore
from kvflow.protocol.messages import OPEN_BATCHES, Message, TransferKey
from kvflow.protocol.requests import Abort, Expect, KvReady
from kvflow.protocol.state import Mode, Outcome, Role

KEY = TransferKey("shared", 1)
CONFIG = CoreConfig(fence_timeout=2.0, retention=30.0)
LAYERS = 2
D_BLOCKS = (10, 11, 12)  # six P blocks' positions


def messages(actions: list[Action]) -> list[Message]:
    return [a.message for a in actions if isinstance(a, SendMessage)]


def verdicts(actions: list[Action]) -> list[tuple[Role, Outcome]]:
    return [(a.role, a.outcome) for a in actions if isinstance(a, Resolve)]


def released(actions: list[Action]) -> list[int]:
    return [block for a in actions if isinstance(a, ReleaseBlocks) for block in a.block_ids]


def ops(actions: list[Action]) -> list[SubmitOp]:
    return [a for a in actions if isinstance(a, SubmitOp)]


def registered() -> tuple[TransferCore, TransferCore]:
    """D (blocks twice P's) registered three blocks with an open batch count; P has it."""
    p, d = TransferCore("P", LAYERS, CONFIG), TransferCore("D", LAYERS, CONFIG)
    d.peer_connected("P", 0.0, block_ratio=2)
    p.peer_connected("D", 0.0, block_ratio=2)
    expected = d.expect(
        Expect(KEY, peer="P", mode=Mode.PUSH, block_ids=D_BLOCKS, expected_batches=OPEN_BATCHES), now=0.0, deadline=50.0
    )
    (registration,) = messages(expected)
    p.receive("D", registration, 0.1)
    return p, d


def chunk(p: TransferCore, first: int, count: int, final: bool, now: float = 1.0) -> list[Action]:
    ids = list(range(100 + first, 100 + first + count))
    return p.kv_ready(KvReady(KEY, block_ids=ids, final=final, first_position=first, peer="D"), now=now)


def written(p: TransferCore, submitted: list[SubmitOp], now: float = 2.0) -> list[bytes]:
    for op in submitted:
        p.op_submitted(op.op_id, now)
        p.op_finished(op.op_id, now)
    return [op.notification for op in submitted]


def test_a_chunk_ending_inside_a_d_block_is_written_at_its_token_offset() -> None:
    """P positions 0..2 (a 40-token budget's first chunks), then 3..5: D block 11 gets its first
    half from the first WRITE and its second half, from P position 1 of it, from the second."""
    p, d = registered()
    first, second = ops(chunk(p, 0, 3, False)), ops(chunk(p, 3, 3, True))
    assert [(op.local_blocks, op.remote_blocks, op.fine_start) for op in first + second] == [
        ((100, 101, 102), (10, 11), 0),
        ((103, 104, 105), (11, 12), 1),
    ]
    notes = written(p, first + second)
    # the second WRITE alone (the last, so D knows the count) leaves block 11 half written: not done
    assert verdicts(d.notification("P", notes[1], 3.0)) == []
    assert verdicts(d.notification("P", notes[0], 3.1)) == [(Role.DECODE, Outcome.SUCCEEDED)]
    assert released(d.delivered(KEY, 3.2)) == list(D_BLOCKS)
    assert not d.ledger.held_blocks


def test_an_abort_while_a_d_block_is_half_written_fences_before_any_block_returns() -> None:
    p, d = registered()
    first = ops(chunk(p, 0, 3, False))
    (note,) = written(p, first)
    assert verdicts(d.notification("P", note, 3.0)) == []  # block 11 holds P's first half only
    aborted = d.abort(Abort(KEY, Role.DECODE, "request ended"), 3.1)
    assert verdicts(aborted) == [(Role.DECODE, Outcome.ABORTED)] and not released(aborted)
    assert d.ledger.quarantined_blocks == len(D_BLOCKS)  # P's second WRITE may still be coming
    answered: list[Action] = []
    for message in messages(aborted):
        answered += p.receive("D", message, 3.2)
    assert sorted(released(answered)) == [100, 101, 102]  # P: nothing in flight, all its blocks back
    returned: list[Action] = []
    for message in messages(answered):
        returned += d.receive("P", message, 3.3)
    assert released(returned) == list(D_BLOCKS)
    assert not d.ledger.held_blocks and not p.ledger.held_blocks
    assert not ops(chunk(p, 3, 3, True, now=3.4))  # the rest of the prompt is never written


def test_a_failed_second_write_fails_d_and_every_block_returns_once() -> None:
    p, d = registered()
    first, second = ops(chunk(p, 0, 3, False)), ops(chunk(p, 3, 3, True))
    (note,) = written(p, first)
    d.notification("P", note, 2.1)
    p.op_submitted(second[0].op_id, 2.2)
    failed = p.op_finished(second[0].op_id, 2.3, "link down")
    assert verdicts(failed) == [(Role.PREFILL, Outcome.FAILED)]
    assert sorted(released(failed)) == list(range(100, 106))
    outcome: list[Action] = []
    for message in messages(failed):
        outcome += d.receive("P", message, 2.4)
    assert verdicts(outcome) == [(Role.DECODE, Outcome.FAILED)]
    assert released(outcome) == list(D_BLOCKS)  # P's notice says nothing of it is in flight
    assert not d.ledger.held_blocks and not p.ledger.held_blocks


def test_expiry_while_a_d_block_is_half_written_releases_only_after_the_fence() -> None:
    p, d = registered()
    (note,) = written(p, ops(chunk(p, 0, 3, False)))
    d.notification("P", note, 3.0)
    expired = d.timer(50.0)
    assert verdicts(expired) == [(Role.DECODE, Outcome.EXPIRED)] and not released(expired)
    assert d.ledger.quarantined_blocks == len(D_BLOCKS)
    lost = d.timer(52.5)  # no fence from P within fence_timeout: P is declared lost
    assert not released(lost)
    assert released(d.peer_lost("P", 52.6)) == list(D_BLOCKS)
    assert not d.ledger.held_blocks
