"""The connector book's request stages as a table (`kvflow.integrations.vllm.stages`): total, an
ignored event changes nothing, every stage is reachable and can end, P's and D's stages never
mix, a request that holds blocks keeps them until the workers report them; and the book reads
it in the corners vLLM's hooks can reach out of order (a second finish, a preemption or a report
that comes after the request's end)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given

from kvflow.integrations.vllm.mapping import SchedulerBook
from kvflow.integrations.vllm.stages import (
    ABORT_REASONS,
    DECODE_START,
    HOLDS_BLOCKS,
    OUTSTANDING,
    PREFILL_START,
    PRODUCING,
    SENDING_FROM,
    TABLE,
    Do,
    Event,
    Stage,
)
from kvflow_tools.diagrams import reachable_from
from tests.vllm_params import entry

PREFILL = reachable_from(TABLE, PREFILL_START)
DECODE = reachable_from(TABLE, DECODE_START)
REPORTS = (Event.RECEIVED, Event.RECEIVE_FAILED, Event.SENT)  # what the workers say


def test_every_stage_has_a_row_for_every_event_and_an_ignored_one_changes_nothing() -> None:
    assert set(TABLE) == {(stage, event) for stage in Stage for event in Event}
    for (stage, _), (target, dos) in TABLE.items():
        if Do.IGNORE in dos:
            assert dos == (Do.IGNORE,) and target is stage
    assert all(TABLE[(Stage.ENDED, event)] == (Stage.ENDED, (Do.IGNORE,)) for event in Event)


def test_every_stage_is_reachable_every_one_can_end_and_p_and_d_share_only_the_end() -> None:
    assert set(Stage) == PREFILL | DECODE
    assert {Stage.ENDED} == PREFILL & DECODE
    for stage in Stage:
        assert Stage.ENDED in reachable_from(TABLE, stage), stage
    assert PRODUCING | SENDING_FROM <= PREFILL and Stage.EXPECTING in DECODE


def test_every_abort_has_a_reason_and_only_a_complete_prefill_hands_its_kv_over() -> None:
    aborts = {do for do in Do if do.name.startswith("ABORT_")}
    assert set(ABORT_REASONS) == aborts and all(ABORT_REASONS.values())
    for (stage, event), (target, dos) in TABLE.items():
        assert len([do for do in dos if do in aborts]) <= 1, (stage, event)
        if Do.HAND_OVER in dos:
            assert (stage, target) == (Stage.READY, Stage.SENDING) and event in (Event.FINISHED, Event.ABORTED)
        if Do.ABORT_UNALLOCATED in dos:
            assert stage is Stage.WAITING


def test_blocks_held_past_the_request_come_back_only_when_the_workers_report_them() -> None:
    assert set(HOLDS_BLOCKS) <= OUTSTANDING
    ending = {Stage.SENDING: {Event.SENT}, Stage.DRAINING: set(REPORTS)}  # D's load may end as it is aborted
    assert set(ending) == HOLDS_BLOCKS
    for stage in HOLDS_BLOCKS:
        for event in Event:
            target, _ = TABLE[(stage, event)]
            assert target is (Stage.ENDED if event in ending[stage] else stage), (stage, event)
    # a request's end while blocks may still be written or read holds them; otherwise it frees at once
    for (stage, event), (target, _) in TABLE.items():
        if event in (Event.FINISHED, Event.ABORTED) and stage not in HOLDS_BLOCKS | {Stage.ENDED}:
            holds = stage in (Stage.HANDING, Stage.READY, Stage.PREEMPTED, Stage.READY_PREEMPTED, Stage.EXPECTING)
            assert (target in HOLDS_BLOCKS) == holds, stage


@given(st.lists(st.sampled_from(list(Event)), max_size=12), st.booleans())
def test_any_event_order_keeps_a_request_on_its_side_and_ends_it_once_reported(events: list[Event], p: bool) -> None:
    stage = PREFILL_START if p else DECODE_START
    for event in events:
        stage, _ = TABLE[(stage, event)]
        assert stage in (PREFILL if p else DECODE)
    for event in (Event.ABORTED, *REPORTS):  # vLLM ends it, the workers release what it held
        stage, _ = TABLE[(stage, event)]
    assert stage is Stage.ENDED


# ---------------------------------------------------------------- the book reads the table


def prefilled(book: SchedulerBook, rid: str = "p") -> None:
    book.new_request(rid, {"do_remote_decode": True, "kvflow": entry(f"t-{rid}")}, 16)
    book.scheduled(rid, 0, 16, [[1, 2, 3, 4]])


def test_a_second_finish_of_a_prefill_holds_its_blocks_and_orders_nothing_more() -> None:
    book = SchedulerBook(4)
    prefilled(book)
    book.take_orders()
    delay, params = book.finished("p", aborted=True)
    assert delay is True and params is not None
    assert [o.reason for o in book.take_orders().abort] == ["prefill request aborted"]
    assert book.finished("p", aborted=True) == book.finished("p", aborted=False) == (True, None)
    book.preempted("p")  # vLLM preempts no finished request; if it did, nothing is aborted twice
    assert not book.take_orders() and book.pending_work() and book.tracked() == 1
    book.output({"p"}, set(), set())
    assert book.tracked() == 0 and not book.pending_work()


def test_a_stray_load_report_for_a_queued_decode_request_does_not_silence_its_abort() -> None:
    book = SchedulerBook(4)
    book.new_request("d", {"do_remote_prefill": True, "kvflow": entry("t-d")}, 16)
    book.output(set(), {"d"}, set())  # no block was allocated: no load can have landed
    book.output(set(), {"d"}, {"d"})
    assert book.tracked() == 1
    assert book.finished("d", aborted=True) == (False, None)
    (abort,) = book.take_orders().abort
    assert (abort.request_id, abort.allocated) == ("d", False)  # P is told it may let the KV go


def test_a_preemption_after_the_ready_order_keeps_vllm_from_preempting_until_the_request_ends() -> None:
    book = SchedulerBook(4)
    prefilled(book)
    assert book.handing_off()
    book.preempted("p")
    assert [o.reason for o in book.take_orders().abort] == [ABORT_REASONS[Do.ABORT_PREEMPTED]]
    assert book.handing_off() and not book.producing("p")
    assert book.finished("p", aborted=False) == (True, None)  # aborted: nothing for D to load
    assert not book.handing_off()
