"""What P's connector costs the engine step, and when P's blocks come back, with vLLM's real
Scheduler and hooks (the stand-in) and real bytes over the loopback transport.

Why: the hooks run on the model runner's thread inside every step of the batch, so they only
hand work to kvflow's engine thread; and P's blocks are capacity P admits requests into, so they
come back once nothing can read them (P's WRITE completed), not once D has answered.  Both are
checked by what happens, never by a clock: the hooks are watched for blocking waits and inline
planning or posting while kvflow's engine thread is held still; D's engine thread is held still
while P must give its blocks back.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from kvflow.protocol.state import Role, State
from kvflow.runtime.threaded import EngineThread
from tests.vllm_pairs import BLOCK_SIZE, dispatch, is_finished, kvflow_engine, make_pair, move_and_check, run, settle

HOLD_LIMIT = 30.0  # seconds an engine thread is held still at most (the test fails long before)
# calls the model runner's thread must never make inside a hook: waiting (for a future, an
# event, a condition, the engine thread), and descriptor planning or posting an op
FORBIDDEN = {"wait", "plan_transfer", "submit"}


@contextmanager
def held(thread: EngineThread) -> Iterator[None]:
    """The engine thread's loop runs nothing else while this holds (nothing it was handed runs)."""
    holding, release = threading.Event(), threading.Event()

    async def hold(_: Any) -> None:
        holding.set()
        release.wait(HOLD_LIMIT)  # blocks the loop on purpose

    thread.call(hold)
    assert holding.wait(HOLD_LIMIT), "the engine thread never ran the hold"
    try:
        yield
    finally:
        release.set()


class WatchedHooks:
    """The worker connector as the model runner calls it, every Python call made inside a hook
    (on this thread) recorded when its name is one of `FORBIDDEN`, and every ``time.sleep``;
    except the one wait a hook may make: the step's results on a step that ran nothing while
    transfers are outstanding (vLLM would step again at once), counted in `idle_waits`."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self.seen: list[str] = []
        self.idle_waits = 0

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name in FORBIDDEN:
            self.seen.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})")
        elif event == "c_call" and getattr(arg, "__name__", "") == "sleep":
            self.seen.append("time.sleep")

    def take(self) -> tuple[float, dict[str, float], float]:
        """What the stand-in reads after each step (the time and CPU in hooks: not measured here)."""
        return 0.0, {}, 0.0

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._worker, name)

        def watched(*args: Any, **kwargs: Any) -> Any:
            if name == "get_transfer_results" and self._worker._orders().idle_wait > 0:
                self.idle_waits += 1  # may sleep until the engine has news: nothing else to do
                return method(*args, **kwargs)
            sys.setprofile(self._profile)
            try:
                return method(*args, **kwargs)
            finally:
                sys.setprofile(None)

        return watched


def _threads(engine: Any) -> list[EngineThread]:
    return [t for t in (rank.worker._worker.thread for rank in engine.ranks) if t is not None]


def test_ps_hooks_only_hand_work_to_the_engine_thread() -> None:
    """P's engine thread is held still through P's whole prefill step: every hook returns, none
    waits or plans or posts on the model runner's thread, and the step's WRITEs are left
    pending; once the engine thread runs, they land and D reads P's KV byte for byte."""
    p, d = make_pair(extra={"push_layer_groups": 2})
    try:
        watched = [WatchedHooks(rank.worker) for engine in (p, d) for rank in engine.ranks]
        for rank, hooks in zip([*p.ranks, *d.ranks], watched, strict=True):
            rank.hooks = hooks  # type: ignore[assignment]
        (p_thread,) = _threads(p)
        with held(p_thread):  # before D registers: P's engine takes nothing until released
            p_req, d_req = dispatch(p, d, "t1", 3 * BLOCK_SIZE)
            run((d,), lambda: d.steps >= 1, 10.0)
            run((p,), lambda: p.steps >= 2, 10.0)  # the whole prefill, its KV handed over
            assert not kvflow_engine(p).core.live(), "P's engine ran while held"
        for hooks in watched:
            assert hooks.seen == [], f"a hook waited or worked inline: {hooks.seen}"
        settle((p, d), [p_req, d_req])
        assert d.checked == {d_req.request_id: 0}
        for hooks in watched:  # the whole transfer, every hook of every step
            assert hooks.seen == [], f"a hook waited or worked inline: {hooks.seen}"
    finally:
        p.close()
        d.close()


def test_ps_blocks_come_back_when_its_write_completed_not_when_d_answers() -> None:
    """D's engine thread is held still once P has D's registration, so D can neither take the
    WRITE's notification nor answer: P still gives its blocks back to vLLM (finished_sending)
    as soon as its WRITEs have completed; D then reads P's KV byte for byte."""
    p, d = make_pair()
    try:
        p_req, d_req = dispatch(p, d, "t2", 4 * BLOCK_SIZE)
        p_engine = kvflow_engine(p)

        def p_has_registration() -> bool:  # kept until P's request starts its transfer
            registered = any(m.role is Role.PREFILL and m.state is State.REGISTERED for m in p_engine.core.live())
            return registered or p_engine.stats()["early_messages"] > 0

        run((d,), p_has_registration, 10.0)
        (d_thread,) = _threads(d)
        with held(d_thread):
            # vLLM frees a delayed request's blocks, and forgets it, on finished_sending
            run((p,), lambda: p_req.request_id not in p.scheduler.requests, 10.0)
            assert p.free_blocks() == p.options.num_blocks - 1
            assert d.checked == {}, "D read the KV while held"
        settle((p, d), [p_req, d_req])
        assert d.checked == {d_req.request_id: 0}
    finally:
        p.close()
        d.close()


def test_d_sleeps_through_steps_with_nothing_to_do_until_its_kv_lands() -> None:
    """D's only request waits for P's KV, so each of D's steps schedules nothing and vLLM's engine
    core would step again at once.  D's results hook sleeps instead (up to ``idle_wait``): while
    P's engine thread is held still for half a second, D steps a few times, not hundreds (its
    step loop here looks again every millisecond), and once P's WRITE lands the sleep under way
    ends by kvflow's news of the blocks, not by its deadline (the link's ``woken``)."""
    p, d = make_pair(d_extra={"idle_wait": 1.0})
    try:
        move_and_check(p, d, "warm", BLOCK_SIZE)  # associated: D's registrations need nothing of P's
        p_req, d_req = dispatch(p, d, "idle-1", 3 * BLOCK_SIZE)
        (p_thread,) = _threads(p)
        decoding = threading.Thread(target=run, args=((d,), lambda: is_finished(d_req), 20.0), daemon=True)
        with held(p_thread):
            run((p,), lambda: p.steps >= 2, 10.0)  # the whole prefill, its WRITEs handed to the held engine
            decoding.start()  # D's engine core, on a thread of its own as in a deployment
            before = d.steps
            time.sleep(0.5)
            spins = d.steps - before
            link = d.ranks[0].worker._worker.link
            woken = link.woken  # D's registration is answered by now: what wakes D next is the KV
        run((p,), lambda: is_finished(p_req) and p.idle(), 20.0)
        decoding.join(30.0)
        assert not decoding.is_alive() and is_finished(d_req)
        assert spins <= 3, f"D stepped {spins} times in 0.5 s with nothing to do"
        assert link.woken > woken, "D's sleep ended by its deadline, not by the KV landing"
        settle((p, d), [p_req, d_req])
        assert d.checked[d_req.request_id] == 0
    finally:
        p.close()
        d.close()
