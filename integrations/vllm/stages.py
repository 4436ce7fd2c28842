"""A request's stage in the connector's book, as a table: what each scheduler event does to it.

Why a table: the scheduler side (`kvflow.integrations.vllm.mapping`) answers vLLM's hooks in
whatever order vLLM calls them: a preemption after the prompt's blocks were handed over, a
request that ends mid-prefill, a load reported just as the request ends.  Kept as flags on a
record, each hook tested its own combination of them; as rows over (stage, event) every
combination has one answer, the tests check that the table is total, `kvflow diagrams` draws it,
and the book reads it.  Pure: no vLLM, no I/O.

P's requests (this engine prefills, `do_remote_decode`) start `QUEUED`, D's (`do_remote_prefill`)
`WAITING`; a request the book forgets is `ENDED`.  An event a stage has no row for is ignored
and changes nothing (`Do.IGNORE`): vLLM schedules no finished request, and a worker's report for
a request that is not waiting for one is stray.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from kvflow.protocol.tables import complete, pairs

__all__ = (
    "ABORT_REASONS",
    "DECODE_START",
    "Do",
    "Event",
    "HOLDS_BLOCKS",
    "OUTSTANDING",
    "PREFILL_START",
    "PRODUCING",
    "SENDING_FROM",
    "Stage",
    "TABLE",
)


class Stage(Enum):
    # P: this engine computes the request's KV
    QUEUED = "queued"  # none of its KV handed to the workers yet
    HANDING = "handing"  # push: earlier chunks' blocks handed over, the prompt not complete
    READY = "ready"  # the (final) ready order went out; the request still runs
    PREEMPTED = "preempted"  # preempted after a chunk was handed over: its transfer is aborted
    READY_PREEMPTED = "ready-preempted"  # preempted after its ready order: aborted, still running
    SENDING = "sending"  # finished; vLLM frees its blocks once the workers released them
    # D: this engine receives it
    WAITING = "waiting"  # queued, no block allocated
    EXPECTING = "expecting"  # blocks allocated and the expect order out; the KV has not landed
    LANDED = "landed"  # the KV arrived
    DRAINING = "draining"  # finished before its KV arrived; blocks freed once the workers released them
    # both
    ENDED = "ended"  # forgotten: vLLM may free (or has freed) every block


class Event(Enum):
    HANDED = "handed"  # P, push: a step handed a chunk's full blocks over, the prompt not complete
    PROMPT_DONE = "prompt-done"  # P: the step completing the prompt sent its (final) ready order
    PREEMPTED = "preempted"  # vLLM preempted the request and freed its blocks
    ALLOCATED = "allocated"  # D: blocks allocated, an expect order out
    NOTHING_TO_LOAD = "nothing-to-load"  # D: allocated with no token to load: it computes the rest
    FINISHED = "finished"  # `request_finished`, not aborted
    ABORTED = "aborted"  # `request_finished`, aborted
    RECEIVED = "received"  # D: the workers report the KV landed (finished_recving)
    RECEIVE_FAILED = "receive-failed"  # D: ... that the load failed (failed_recving too)
    SENT = "sent"  # the workers released the blocks (finished_sending)


class Do(Enum):
    IGNORE = "ignore"  # not an event for this stage: nothing changes
    HAND_OVER = "hand-over"  # `request_finished` returns the params D needs (P's KV is complete)
    # an abort order for the workers (the peer is told), with `ABORT_REASONS`' reason
    ABORT_EARLY = "abort-early"
    ABORT_MID_PREFILL = "abort-mid-prefill"
    ABORT_PREEMPTED = "abort-preempted"
    ABORT_PREFILL = "abort-prefill"
    ABORT_UNALLOCATED = "abort-unallocated"  # only P is told: D holds no block of it
    ABORT_DECODE = "abort-decode"
    ABORT_UNLANDED = "abort-unlanded"


ABORT_REASONS: Mapping[Do, str] = {
    Do.ABORT_EARLY: "prefill request ended early",
    Do.ABORT_MID_PREFILL: "prefill request ended mid-prefill",
    Do.ABORT_PREEMPTED: "prefill request preempted: vLLM freed its blocks",
    Do.ABORT_PREFILL: "prefill request aborted",
    Do.ABORT_UNALLOCATED: "decode request aborted before its blocks were allocated",
    Do.ABORT_DECODE: "decode request aborted",
    Do.ABORT_UNLANDED: "decode request ended before its KV arrived",
}

Row = tuple[Stage, tuple[Do, ...]]

PREFILL_START = Stage.QUEUED
DECODE_START = Stage.WAITING


def _finished(stage: Stage, target: Stage, *dos: Do) -> dict[tuple[Stage, Event], Row]:
    """`request_finished` moves `stage` the same way whether or not vLLM aborted the request."""
    return {(stage, event): (target, dos) for event in (Event.FINISHED, Event.ABORTED)}


_ROWS: dict[tuple[Stage, Event], Row] = {
    # P.  A preemption before any block was handed over starts the prefill over, as vLLM does.
    (Stage.QUEUED, Event.HANDED): (Stage.HANDING, ()),
    (Stage.QUEUED, Event.PROMPT_DONE): (Stage.READY, ()),
    (Stage.QUEUED, Event.PREEMPTED): (Stage.QUEUED, ()),
    **_finished(Stage.QUEUED, Stage.ENDED, Do.ABORT_EARLY),  # ended before its prefill completed: hold nothing
    (Stage.HANDING, Event.HANDED): (Stage.HANDING, ()),
    (Stage.HANDING, Event.PROMPT_DONE): (Stage.READY, ()),
    (Stage.HANDING, Event.PREEMPTED): (Stage.PREEMPTED, (Do.ABORT_PREEMPTED,)),
    # the workers hold (or held) earlier chunks' blocks: vLLM frees them on finished_sending
    **_finished(Stage.HANDING, Stage.SENDING, Do.ABORT_MID_PREFILL),
    (Stage.READY, Event.PREEMPTED): (Stage.READY_PREEMPTED, (Do.ABORT_PREEMPTED,)),
    (Stage.READY, Event.FINISHED): (Stage.SENDING, (Do.HAND_OVER,)),
    (Stage.READY, Event.ABORTED): (Stage.SENDING, (Do.ABORT_PREFILL, Do.HAND_OVER)),
    **_finished(Stage.PREEMPTED, Stage.SENDING),
    **_finished(Stage.READY_PREEMPTED, Stage.SENDING),
    (Stage.SENDING, Event.SENT): (Stage.ENDED, ()),
    # D
    (Stage.WAITING, Event.ALLOCATED): (Stage.EXPECTING, ()),
    (Stage.WAITING, Event.NOTHING_TO_LOAD): (Stage.ENDED, ()),
    **_finished(Stage.WAITING, Stage.ENDED, Do.ABORT_UNALLOCATED),  # P may hold its KV, or compute it later: tell P
    (Stage.EXPECTING, Event.RECEIVED): (Stage.LANDED, ()),
    (Stage.EXPECTING, Event.RECEIVE_FAILED): (Stage.ENDED, ()),
    (Stage.EXPECTING, Event.FINISHED): (Stage.DRAINING, (Do.ABORT_UNLANDED,)),
    (Stage.EXPECTING, Event.ABORTED): (Stage.DRAINING, (Do.ABORT_DECODE,)),
    (Stage.LANDED, Event.RECEIVE_FAILED): (Stage.ENDED, ()),
    **_finished(Stage.LANDED, Stage.ENDED),
    # vLLM frees a finished request's blocks on finished_recving too: the KV landed (or failed)
    # just as the request ended, before its abort took effect
    (Stage.DRAINING, Event.RECEIVED): (Stage.ENDED, ()),
    (Stage.DRAINING, Event.RECEIVE_FAILED): (Stage.ENDED, ()),
    (Stage.DRAINING, Event.SENT): (Stage.ENDED, ()),
}

_P = (Stage.QUEUED, Stage.HANDING, Stage.READY, Stage.PREEMPTED, Stage.READY_PREEMPTED, Stage.SENDING)
_D = (Stage.WAITING, Stage.EXPECTING, Stage.LANDED, Stage.DRAINING)
_RECEIVING = (Event.ALLOCATED, Event.NOTHING_TO_LOAD, Event.RECEIVED, Event.RECEIVE_FAILED)
_PRODUCING = (Event.HANDED, Event.PROMPT_DONE, Event.PREEMPTED)
_ENDING = (Event.FINISHED, Event.ABORTED)

# Ignored: what the other role's requests go through, anything once forgotten, and what comes
# again or late in a stage past it.
_IGNORED = {
    *pairs(_P, _RECEIVING),
    *pairs(_D, _PRODUCING),  # (vLLM preempts a decode request as it likes: kvflow holds nothing then)
    *pairs([Stage.ENDED], Event),
    # P: the prompt is complete, or the request was preempted, sent or finished already
    *pairs([Stage.READY, Stage.PREEMPTED, Stage.READY_PREEMPTED, Stage.SENDING], [Event.HANDED, Event.PROMPT_DONE]),
    *pairs([Stage.PREEMPTED, Stage.READY_PREEMPTED, Stage.SENDING], [Event.PREEMPTED]),
    *pairs([Stage.SENDING], _ENDING),
    *pairs([Stage.QUEUED, Stage.HANDING, Stage.READY, Stage.PREEMPTED, Stage.READY_PREEMPTED], [Event.SENT]),
    # D: no load started yet, one under way or landed, or a finished one draining
    *pairs([Stage.WAITING], [Event.RECEIVED, Event.RECEIVE_FAILED, Event.SENT]),
    *pairs([Stage.EXPECTING, Stage.LANDED], [Event.ALLOCATED, Event.NOTHING_TO_LOAD, Event.SENT]),
    *pairs([Stage.LANDED], [Event.RECEIVED]),
    *pairs([Stage.DRAINING], [Event.ALLOCATED, Event.NOTHING_TO_LOAD, *_ENDING]),
}

TABLE: Mapping[tuple[Stage, Event], Row] = complete(
    "request stages", Stage, Event, _ROWS, _IGNORED, lambda stage: (stage, (Do.IGNORE,))
)

PRODUCING = frozenset({Stage.QUEUED, Stage.HANDING})  # P: a step may hand its KV over
HOLDS_BLOCKS = frozenset({Stage.SENDING, Stage.DRAINING})  # finished; vLLM frees late (`delay_free`)
OUTSTANDING = frozenset({Stage.EXPECTING, *HOLDS_BLOCKS})  # the workers will report its end
# P: the workers may be sending from its blocks while the request still runs (vLLM must not
# preempt, see `SchedulerBook.handing_off`)
SENDING_FROM = frozenset({Stage.READY, Stage.READY_PREEMPTED})
