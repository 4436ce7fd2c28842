"""vLLM's engine core asleep while every request waits for KV (`integrations/vllm/idle_sleep.py`),
and the bell that wakes it (`kvflow.runtime.bell`).

The bell is a real Unix socket; the engine process that rings it is a real one, moving KV over
NIXL.  The sleeping engine core is a stand-in object with vLLM's shape (a `queue.Queue` named
``input_queue``, a ``scheduler`` whose ``connector`` is the connector), calling the hook from
its own method as vLLM's does, so that the frame search meets it as it meets vLLM's.  Every
wait below has a deadline that only guards against a hang; nothing asserts a duration.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvflow
from kvflow.errors import ConfigError, InvalidBatch
from kvflow.integrations.vllm.idle_sleep import (
    FOLLOW_UP,
    EngineLoop,
    IdleSleep,
    StepView,
    engine_core_pid,
    find_engine_loop,
    may_sleep,
)
from kvflow.integrations.vllm.links import EngineLink
from kvflow.integrations.vllm.stats import RankMeter
from kvflow.protocol.actions import Resolve
from kvflow.protocol.requests import Expect, KvReady
from kvflow.protocol.state import Outcome, Role
from kvflow.runtime.bell import Bell, BellListener, bell_path
from kvflow.runtime.host_memory import share_in_place
from kvflow.runtime.meter import MeterReading, TransferMeter
from kvflow.runtime.process import EngineProcess, ProcessSpec
from kvflow.runtime.results import EngineCounters, Outcomes, TransferResult

# each layer's cache 2 MiB: an allocation of its own (malloc maps it), so that moving its pages in
# place (`share_in_place`) takes no page of the heap or of the other engine's caches with them
SPEC = kvflow.KVSpec(num_layers=2, block_size=16, num_kv_heads=8, head_dim=128, dtype="float16")
NUM_BLOCKS = 16
HANG = 30.0  # seconds: only a hang reaches this

WAITING_STEP = StepView(scheduled_tokens=0, finishing=0, orders=False, outstanding=True)


def until(condition: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + HANG
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"not within {HANG}s: {what}")
        time.sleep(0.002)


@pytest.fixture(autouse=True)
def private_bells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's bells in a temporary directory of its own."""
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    return tmp_path


# ---------------------------------------------------------------- the bell


def test_a_ring_reaches_the_listener_and_each_burst_wakes_it() -> None:
    heard: list[float] = []
    listener = BellListener(bell_path(os.getpid(), "decode-0"), lambda: heard.append(time.monotonic()))
    ringer = Bell(listener.path)
    try:
        ringer.ring()
        until(lambda: len(heard) == 1, "the first ring")
        for _ in range(20):
            ringer.ring()
        until(lambda: len(heard) >= 2, "the burst")
        assert len(heard) <= 21  # each datagram at most once (a slow listener drains a burst at once)
    finally:
        ringer.close()
        listener.close()


def test_a_ring_nobody_hears_is_counted_and_raises_nothing() -> None:
    ringer = Bell(bell_path(os.getpid(), "nobody-listens"))
    ringer.ring()
    assert (ringer.rung, ringer.missed) == (0, 1)
    ringer.close()
    ringer.ring()  # closed: still nothing raised
    assert ringer.missed == 2


def test_closing_a_listener_ends_its_thread_and_removes_its_socket() -> None:
    listener = BellListener(bell_path(os.getpid(), "decode-0"), lambda: None)
    assert stat.S_ISSOCK(os.lstat(listener.path).st_mode)
    thread = listener._thread
    listener.close()
    assert not os.path.exists(listener.path)
    assert not thread.is_alive()


def test_a_listener_replaces_a_socket_a_dead_one_left() -> None:
    path = bell_path(os.getpid(), "decode-0")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dead.bind(path)
    dead.close()  # as a killed listener leaves it: the file stays
    heard: list[int] = []
    second = BellListener(path, lambda: heard.append(1))
    ringer = Bell(path)
    try:
        ringer.ring()
        until(lambda: heard == [1], "the ring at the new listener")
    finally:
        ringer.close()
        second.close()


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o701])
def test_a_bell_directory_others_may_write_into_is_refused(private_bells: Path, mode: int) -> None:
    directory = private_bells / f"kvflow-bells-{os.getuid()}"
    directory.mkdir(mode=0o700)
    directory.chmod(mode)
    with pytest.raises(ConfigError, match="mode 0700"):
        bell_path(1, "decode-0")
    assert list(directory.iterdir()) == []


def test_a_bell_directory_that_is_a_file_is_refused(private_bells: Path) -> None:
    (private_bells / f"kvflow-bells-{os.getuid()}").write_text("not a directory")
    with pytest.raises(ConfigError, match="kvflow's bell directory"):
        bell_path(1, "decode-0")


# ---------------------------------------------------------------- the rule


@given(
    tokens=st.integers(0, 3),
    finishing=st.integers(0, 2),
    orders=st.booleans(),
    outstanding=st.booleans(),
    holds=st.lists(st.sampled_from(["waiting", "finished", "running"]), max_size=5),
)
def test_the_engine_core_sleeps_only_when_every_request_waits_and_the_step_does_nothing(
    tokens: int, finishing: int, orders: bool, outstanding: bool, holds: list[str]
) -> None:
    step = StepView(tokens, finishing, orders, outstanding)
    quiet = tokens == 0 and finishing == 0 and not orders and outstanding
    assert may_sleep(step, holds) is (quiet and "running" not in holds)


def test_the_engine_core_is_the_workers_parent_or_the_worker_itself() -> None:
    assert engine_core_pid("mp", 10, 1) == 1
    assert engine_core_pid("uni", 10, 1) == 10
    for backend in ("ray", "external_launcher", None, object()):
        assert engine_core_pid(backend, 10, 1) is None


# ---------------------------------------------------------------- the sleep


class Request:
    def __init__(self, status: str) -> None:
        self.status = status


class Scheduler:
    def __init__(self, connector: object) -> None:
        self.connector = connector
        self.requests: dict[str, Request] = {"r-1": Request("waiting")}


class EngineCore:
    """vLLM's engine core as the hook meets it: it calls the hook from its own step."""

    def __init__(self, connector: object) -> None:
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.scheduler = Scheduler(connector)

    def step(self, sleep: IdleSleep, step: StepView = WAITING_STEP) -> bool:
        return sleep.after_step(self.scheduler.connector, step, holds)


def holds(scheduler: Scheduler) -> Iterator[str]:
    return (request.status for request in scheduler.requests.values())


@pytest.fixture
def core() -> Iterator[tuple[EngineCore, IdleSleep, Bell]]:
    connector = object()
    sleep = IdleSleep("decode-0", limit=HANG)
    ringer = Bell(sleep.path)
    yield EngineCore(connector), sleep, ringer
    ringer.close()
    sleep.close()


def heard(sleep: IdleSleep, ringer: Bell) -> None:
    """The first ring, which shows the ranks ring this bell (before it, the core never sleeps)."""
    ringer.ring()
    until(lambda: sleep.heard, "the first ring")


def settled(engine: EngineCore, sleep: IdleSleep, ringer: Bell) -> None:
    """Past the first ring and the short sleep that follows any ring's step."""
    heard(sleep, ringer)
    assert engine.step(sleep) is True  # ended at once by the first ring
    assert engine.step(sleep) is True  # the follow-up, ended by its own bound
    assert (sleep.counters["idle_sleeps_ended_by_kvflow"], sleep.counters["idle_sleeps_ended_by_follow_up"]) == (1, 1)


def in_a_while(action: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(0.05, action)
    timer.start()
    return timer


def test_before_its_bell_has_rung_the_engine_core_never_sleeps(core) -> None:  # type: ignore[no-untyped-def]
    engine, sleep, _ = core
    assert engine.step(sleep) is False
    assert sleep.counters == {}


def test_a_ring_before_the_sleep_ends_it_at_once_and_is_consumed(core) -> None:  # type: ignore[no-untyped-def]
    """News that came while the core was busy is for the next step: a sleep begun after it
    must not wait for another ring."""
    engine, sleep, ringer = core
    heard(sleep, ringer)
    assert engine.step(sleep) is True
    assert sleep.counters["idle_sleeps_ended_by_kvflow"] == 1
    assert engine.step(sleep) is True  # no ring left over: this one waits out its (follow-up) bound
    assert sleep.counters["idle_sleeps_ended_by_follow_up"] == 1


def test_after_kvflows_news_the_next_sleep_is_short_and_the_one_after_it_long(core) -> None:  # type: ignore[no-untyped-def]
    """The step a ring starts asks the rank's engine for its gauges; the step after it reports
    them (a silent peer's teardown, the blocks it holds): so the sleep between is short."""
    engine, sleep, ringer = core
    settled(engine, sleep, ringer)
    sleep.limit = 2 * FOLLOW_UP
    assert engine.step(sleep) is True
    assert sleep.counters["idle_sleeps_ended_by_limit"] == 1  # no news: the whole limit
    assert sleep.counters["idle_sleep_ms"] >= 1000 * (FOLLOW_UP + 2 * FOLLOW_UP) - 5


def test_the_sleep_ends_when_kvflow_rings(core) -> None:  # type: ignore[no-untyped-def]
    engine, sleep, ringer = core
    settled(engine, sleep, ringer)
    timer = in_a_while(ringer.ring)
    assert engine.step(sleep) is True
    timer.join()
    assert sleep.counters["idle_sleeps_ended_by_kvflow"] == 2
    assert sleep.counters["idle_sleeps_ended_by_limit"] == 0


def test_the_sleep_ends_when_vllm_has_input(core) -> None:  # type: ignore[no-untyped-def]
    engine, sleep, ringer = core
    settled(engine, sleep, ringer)
    timer = in_a_while(lambda: engine.input_queue.put(("ADD", "r-2")))
    assert engine.step(sleep) is True
    timer.join()
    assert sleep.counters["idle_sleeps_ended_by_request"] == 1
    assert engine.input_queue.get_nowait() == ("ADD", "r-2")  # left for vLLM to read


def test_input_already_queued_ends_the_sleep_at_once(core) -> None:  # type: ignore[no-untyped-def]
    engine, sleep, ringer = core
    settled(engine, sleep, ringer)
    engine.input_queue.put(("ABORT", "r-1"))
    assert engine.step(sleep) is True
    assert sleep.counters["idle_sleeps_ended_by_request"] == 1


def test_with_neither_the_sleep_ends_at_its_limit(core) -> None:  # type: ignore[no-untyped-def]
    engine, sleep, ringer = core
    settled(engine, sleep, ringer)
    sleep.limit = 0.05
    assert engine.step(sleep) is True
    assert sleep.counters["idle_sleeps_ended_by_limit"] == 1
    assert sleep.counters["idle_sleep_ms"] >= 50


def test_a_request_that_runs_or_a_step_that_works_keeps_the_engine_core_awake(core) -> None:  # type: ignore[no-untyped-def]
    engine, sleep, ringer = core
    heard(sleep, ringer)
    engine.scheduler.requests["r-2"] = Request("running")
    assert engine.step(sleep) is False
    del engine.scheduler.requests["r-2"]
    for busy in (
        StepView(1, 0, False, True),
        StepView(0, 1, False, True),
        StepView(0, 0, True, True),
        StepView(0, 0, False, False),
    ):
        assert engine.step(sleep, busy) is False
    assert sum(v for k, v in sleep.counters.items() if k.startswith("idle_sleeps")) == 0


def test_an_engine_core_the_frames_do_not_show_is_never_slept_in(core, caplog) -> None:  # type: ignore[no-untyped-def]
    _, sleep, ringer = core
    heard(sleep, ringer)
    assert sleep.after_step(object(), WAITING_STEP, holds) is False  # called from no engine core
    assert sleep.after_step(object(), WAITING_STEP, holds) is False
    assert [r.message for r in caplog.records].count(
        "kvflow: vLLM's engine core was not found from its scheduler's hook; it steps without pause while "
        "requests wait for KV (idle_sleep has no effect)"
    ) == 1


def test_the_frame_search_finds_the_object_whose_scheduler_holds_this_connector() -> None:
    class Looking(EngineCore):
        def look(self, wanted: object) -> object:
            return find_engine_loop(wanted)

    connector = object()
    engine = Looking(connector)
    loop = engine.look(connector)
    assert isinstance(loop, EngineLoop)
    assert loop.inputs is engine.input_queue and loop.scheduler is engine.scheduler
    assert engine.look(object()) is None  # another connector's engine core is not this one's
    assert find_engine_loop(connector) is None  # called from no engine core


# ---------------------------------------------------------------- the engine process rings


def cache() -> list[np.ndarray]:
    return [np.zeros((2, NUM_BLOCKS, SPEC.block_len), np.uint8) for _ in range(SPEC.num_layers)]


def engine_process(name: str, caches: list[np.ndarray], bell: str = "") -> EngineProcess:
    regions = [kvflow.region_of(a) for a in caches]
    spans = share_in_place(regions)
    try:
        layout = kvflow.KVLayout.per_layer_regions(SPEC, NUM_BLOCKS, regions)
        spec = ProcessSpec(name, layout, transport_options={"cuda": False}, bell=bell)
        return EngineProcess(spec, spans)
    finally:
        for span in spans:
            os.close(span.fd)


def answered(process: EngineProcess, future: concurrent.futures.Future[Any]) -> bool:
    process.pump()
    return future.done()


def test_an_engine_process_rings_when_blocks_come_back_or_a_call_fails() -> None:
    rings: list[int] = []
    path = bell_path(os.getpid(), "decode-0")
    p_cache, d_cache = cache(), cache()
    p, d = engine_process("prefill-0", p_cache), engine_process("decode-0", d_cache, path)
    listener = BellListener(path, lambda: rings.append(1))
    try:
        connected = d.call("connect", "prefill-0", p.address)
        until(lambda: answered(d, connected), "the connection")
        quiet = d.call("stats")  # an answer that changes nothing a step reports: no ring
        until(lambda: answered(d, quiet), "the stats")
        time.sleep(0.1)
        assert rings == []
        d.submit(Expect(kvflow.TransferKey("t-1", 1), "prefill-0", [1, 2]))
        p.submit(KvReady(kvflow.TransferKey("t-1", 1), [3, 4]))
        until(lambda: len(rings) >= 1, "a ring for D's blocks coming back")
        assert [r.block_ids for r in d.poll_released()] == [(1, 2)]
        before = len(rings)
        refused = d.submit(Expect(kvflow.TransferKey("t-2", 1), "prefill-0", [-1]))
        until(lambda: len(rings) > before, "a ring for the refused call")
        until(lambda: answered(d, refused), "the refusal")
        with pytest.raises(InvalidBatch):
            refused.result()
    finally:
        d.close()
        p.close()
        listener.close()


def test_each_outcome_is_handed_to_on_end_even_while_its_blocks_stay_quarantined() -> None:
    """A transfer that fails while its blocks stay held (a silent peer's) gives nothing back, yet
    the host's scheduler must step to show the failure and the hold in its metrics: the engine
    rings on each outcome (`on_end`), not only on released blocks."""
    ended: list[TransferResult] = []
    outcomes = Outcomes("decode-0", 16, TransferMeter(), EngineCounters(), None, lambda f, *a: f(*a), ended.append)
    key = kvflow.TransferKey("t-1", 1)
    outcomes.resolve(Resolve(key, Role.DECODE, Outcome.FAILED, "peer prefill-0 lost"), now=1.0)
    assert ended == [TransferResult(key, Role.DECODE, Outcome.FAILED, "peer prefill-0 lost")]
    assert list(outcomes.released) == []


class SnapshotLink:
    """The part of a rank's engine link the meter uses: its readings, and the snapshot calls
    made (name, lazy), each answered at once with gauges that show a silent peer's hold."""

    def __init__(self) -> None:
        self.readings: list[MeterReading] = []
        self.calls: list[tuple[str, bool]] = []

    def meter_take(self) -> MeterReading:
        return self.readings.pop(0) if self.readings else MeterReading()

    def command(self, name: str, *args: Any, lazy: bool = False, always: bool = False) -> Any:
        self.calls.append((name, lazy))
        answer: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        gauges = {"quarantined_blocks": 12, "in_flight": {}, "teardowns": {"holding": 1}, "hold_release_in_s": 95.0}
        answer.set_result({"rejected": {}, "gauges": gauges})
        return answer


def test_a_step_that_reads_an_outcome_asks_for_the_gauges_at_once_and_the_next_reports_them() -> None:
    fake, meter = SnapshotLink(), RankMeter("decode-0-tp0")
    link = cast(EngineLink, fake)
    meter.take(link)  # the first step: a snapshot asked lazily (it goes with the next call)
    assert fake.calls == [("snapshot", True)]
    meter.take(link)  # the answer read; the next one not due yet
    fake.readings.append(MeterReading(outcomes={"failed": 1}))
    meter.take(link)  # a transfer ended: asked at once, not lazily, whatever the interval
    assert fake.calls == [("snapshot", True), ("snapshot", False)]
    reported = meter.take(link)  # the step after it (the engine core's follow-up)
    assert reported is not None and reported.data["ranks"]["decode-0-tp0"]["quarantined_blocks"] == 12
