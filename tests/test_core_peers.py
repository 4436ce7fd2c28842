"""Two pure cores and what one peer can do to the other: whose verdict a written transfer gets
when D gives up first or is lost, and how far one peer's quotas reach."""

from __future__ import annotations

from kvflow.protocol.actions import Action, Resolve, SendMessage, SubmitOp
from kvflow.protocol.core import CoreConfig, TransferCore
from kvflow.protocol.messages import Message, TransferKey
from kvflow.protocol.state import Mode, Outcome, Role, State

KEY = TransferKey("r", 1)
CONFIG = CoreConfig(fence_timeout=2.0, retention=30.0)


def messages(actions: list[Action]) -> list[Message]:
    return [a.message for a in actions if isinstance(a, SendMessage)]


def verdicts(actions: list[Action]) -> list[tuple[Role, Outcome]]:
    return [(a.role, a.outcome) for a in actions if isinstance(a, Resolve)]


def written_push() -> tuple[TransferCore, TransferCore, bytes]:
    """D registered, P wrote everything and its WRITE completed; the notification is on its way."""
    p, d = TransferCore("P", 2, CONFIG), TransferCore("D", 2, CONFIG)
    d.peer_connected("P", 0.0)
    p.peer_connected("D", 0.0)
    (registration,) = messages(d.expect(KEY, peer="P", mode=Mode.PUSH, block_ids=[1, 2], deadline=5.0, now=0.0))
    p.receive("D", registration, 0.1)
    (op,) = [a for a in p.kv_ready(KEY, block_ids=[7, 8], now=0.2, peer="D", deadline=30.0) if isinstance(a, SubmitOp)]
    p.op_submitted(op.op_id, 0.3)
    finished = p.op_finished(op.op_id, 0.4)
    assert verdicts(finished) == []  # written, and P's blocks are back, but the verdict is D's
    assert p.machine(KEY, Role.PREFILL).state is State.WRITTEN
    return p, d, op.notification


def test_prefill_succeeds_only_on_decodes_word() -> None:
    p, d, note = written_push()
    landed = d.notification("P", note, 1.0)
    assert verdicts(landed) == [(Role.DECODE, Outcome.SUCCEEDED)]
    assert verdicts(p.receive("D", *messages(landed), 1.1)) == [(Role.PREFILL, Outcome.SUCCEEDED)]


def test_decode_expired_first_so_both_sides_fail() -> None:
    p, d, note = written_push()
    # D was stopped past its deadline: the notification is handled after it, before any timer
    # ran.  The deadline counts first, so D expires, and P, told so, does not claim success.
    late = d.notification("P", note, 6.0)
    assert verdicts(late) == [(Role.DECODE, Outcome.EXPIRED)]
    answer = p.receive("D", messages(late)[0], 1.5)  # each host has its own clock
    assert verdicts(answer) == [(Role.PREFILL, Outcome.FAILED)]
    assert "expired" in p.machine(KEY, Role.PREFILL).reason
    for message in messages(answer):  # P's fence lets D release its quarantined blocks
        d.receive("P", message, 6.2)
    assert d.ledger.held_blocks == 0 and p.ledger.held_blocks == 0


def test_prefill_that_loses_decode_before_its_word_reports_failure() -> None:
    p, _, _ = written_push()
    assert verdicts(p.peer_lost("D", 3.0)) == [(Role.PREFILL, Outcome.FAILED)]
    assert "before its verdict" in p.machine(KEY, Role.PREFILL).reason


def test_prefill_without_decodes_word_within_the_fence_timeout_reports_failure() -> None:
    p, _, _ = written_push()
    assert verdicts(p.timer(0.4 + CONFIG.fence_timeout)) == [(Role.PREFILL, Outcome.FAILED)]
    assert "no verdict" in p.machine(KEY, Role.PREFILL).reason
