"""Pull transfers made ready for a decode peer P does not know yet (sequential routers).

A sequential router (vLLM's toy proxy, llm-d, Dynamo) sends P the request first and hands P's
answer to whichever D it picks: P's KV is ready before P knows who will read it.  The first
associated peer to claim the exact transfer id and epoch becomes its peer; another claimant is
refused; a transfer nobody claims goes back at its deadline without waiting for a fence (nobody
can be reading it).  Two pure cores, messages carried by hand.
"""

from __future__ import annotations

from kvflow.protocol.actions import Action, OpKind, ReleaseBlocks, Resolve, SendMessage, SubmitOp
from kvflow.protocol.core import TransferCore
from kvflow.protocol.messages import Claim, Message, Notice, Ready, TransferKey
from kvflow.protocol.requests import Abort, Expect, KvReady
from kvflow.protocol.state import Effect, Mode, Outcome, Role, State
from kvflow.protocol.vocabulary import ADDRESSED

KEY = TransferKey("3f9a-unguessable", 1)


def _sent(actions: list[Action]) -> list[tuple[str, Message]]:
    return [(a.peer, a.message) for a in actions if isinstance(a, SendMessage)]


def _released(actions: list[Action]) -> list[tuple[int, ...]]:
    return [a.block_ids for a in actions if isinstance(a, ReleaseBlocks)]


def _unclaimed_p(now: float = 0.0) -> TransferCore:
    p = TransferCore("P", num_layers=2)
    actions = p.kv_ready(KvReady(KEY, block_ids=[4, 5], mode=Mode.PULL), now=now, deadline=now + 30.0)
    assert _sent(actions) == []  # nobody to tell yet
    assert p.machine(KEY, Role.PREFILL).state is State.PREFILL_READY
    assert p.stats.unaddressed == 1  # the row's SEND_READY, with nobody to address it to
    return p


def test_the_effects_dropped_for_a_machine_without_a_peer_are_exactly_those_addressed_to_it() -> None:
    assert {e for e in Effect if e.name.startswith("SEND_")} | {Effect.SUBMIT_PENDING} == ADDRESSED
    p = _unclaimed_p()
    aborted = p.abort(Abort(KEY, Role.PREFILL, reason="client gone"), now=1.0)
    assert _sent(aborted) == [] and p.stats.unaddressed == 2  # its SEND_ABORT too
    assert _released(aborted) == [(4, 5)]  # and nobody can be reading: the blocks go back at once


def test_first_claimant_reads_and_p_releases_on_its_done() -> None:
    p = _unclaimed_p()
    d = TransferCore("D", num_layers=2)
    d.peer_connected("P", 0.0)
    claim = _sent(d.expect(Expect(KEY, peer="P", mode=Mode.PULL, block_ids=[7, 8]), now=1.0, deadline=20.0))
    assert claim == [("P", Claim(KEY))]
    answer = p.receive("D", Claim(KEY), 1.0)
    assert _sent(answer) == [("D", Ready(KEY, (4, 5)))]
    assert p.machine(KEY, Role.PREFILL).peer == "D"
    (read,) = [a for a in d.receive("P", Ready(KEY, (4, 5)), 1.0) if isinstance(a, SubmitOp)]
    assert (read.kind, read.local_blocks, read.remote_blocks) == (OpKind.READ, (7, 8), (4, 5))
    done = d.op_finished(read.op_id, 2.0)
    ((_, message),) = _sent(done)
    assert _released(p.receive("D", message, 2.0)) == [(4, 5)]
    assert p.machine(KEY, Role.PREFILL).state is State.DONE


def test_a_second_claimant_is_refused_and_changes_nothing() -> None:
    p = _unclaimed_p()
    p.receive("D", Claim(KEY), 1.0)
    refused = p.receive("X", Claim(KEY), 1.5)
    ((to, notice),) = _sent(refused)
    assert to == "X" and isinstance(notice, Notice) and "already claimed" in notice.reason
    m = p.machine(KEY, Role.PREFILL)
    assert (m.peer, m.state, p.stats.refused_claims) == ("D", State.PREFILL_READY, 1)
    assert p.receive("D", Claim(KEY), 1.6) == []  # the claimant again: nothing new


def test_nobody_claims_it_so_its_blocks_go_back_at_the_deadline_without_a_fence() -> None:
    p = _unclaimed_p()
    expired = p.timer(30.0)
    assert _released(expired) == [(4, 5)]
    assert [a.outcome for a in expired if isinstance(a, Resolve)] == [Outcome.EXPIRED]
    assert p.machine(KEY, Role.PREFILL).state is State.EXPIRED and not p.ledger.held_blocks
    late = p.receive("D", Claim(KEY), 31.0)  # D came after all: told at once, nothing read
    ((to, notice),) = _sent(late)
    assert to == "D" and isinstance(notice, Notice) and notice.outcome is Outcome.EXPIRED


def test_a_claim_before_the_kv_is_ready_waits_for_it() -> None:
    p = TransferCore("P", num_layers=2)
    assert p.receive("D", Claim(KEY), 0.5) == []
    actions = p.kv_ready(KvReady(KEY, block_ids=[4, 5], mode=Mode.PULL), now=1.0, deadline=31.0)
    assert _sent(actions) == [("D", Ready(KEY, (4, 5)))]


def test_d_giving_up_before_its_claim_releases_p_once_d_is_quiet() -> None:
    p = _unclaimed_p()
    d = TransferCore("D", num_layers=2)
    d.expect(Expect(KEY, peer="P", mode=Mode.PULL, block_ids=[7, 8]), now=1.0, deadline=20.0)  # not connected: no claim
    gave_up = _sent(d.abort(Abort(KEY, Role.DECODE), 2.0))
    released = []
    for _, message in gave_up:  # a notice, then "nothing in flight"
        released += _released(p.receive("D", message, 2.0))
    assert released == [(4, 5)]
    assert p.machine(KEY, Role.PREFILL).state is State.ABORTED


def test_a_claim_for_a_push_transfer_is_not_taken() -> None:
    p = TransferCore("P", num_layers=2)
    p.kv_ready(KvReady(KEY, block_ids=[4]), now=0.0, deadline=30.0)
    assert p.receive("D", Claim(KEY), 1.0) == []
    assert p.machine(KEY, Role.PREFILL).peer is None and p.stats.foreign_peer == 1
