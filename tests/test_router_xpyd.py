"""The xPyD router against four fake OpenAI servers (two P, two D), each in its own process.

Selection (the healthy backend with the fewest requests in flight), health checks (a backend
failing ``GET /health``, or leaving three checks in a row unanswered, is skipped until it passes
again; none left for a role is 503 naming it) and the sequential mode (P first with vLLM's own
params, then D with P's answer), over real HTTP on 127.0.0.1.  Load is made by holding answers, never by timing.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.params import SEQUENTIAL_PREFILL_PARAMS
from kvflow_tools.errors import NoBackend
from kvflow_tools.routing.backends import Backend, BackendPool
from kvflow_tools.testing.params_fuzz import hostile_params
from tests.router_processes import ROUTER_MODULE, WAIT, Process, start_fake, stop_clean

NAMES = ("P1", "P2", "D1", "D2")


def start_router(urls: dict[str, str], mode: str) -> tuple[Process, str]:
    args = ["-m", ROUTER_MODULE, "--port", "0", "--mode", mode, "--health-interval", "0.1", "--health-timeout", "1"]
    for name, url in urls.items():
        role = "prefill" if name.startswith("P") else "decode"
        port = 5700 if role == "prefill" else 5800
        args += [f"--{role}", url, f"--{role}-engine", name.lower(), f"--{role}-kvflow", f"tcp://127.0.0.1:{port}"]
    process = Process(*args)
    return process, process.wait_for(r"router listening on (http://\S+)").group(1)


@dataclass
class Stack:
    urls: dict[str, str]
    concurrent: str
    sequential: str


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    processes: list[Process] = []
    try:
        urls = {}
        for name in NAMES:
            process, urls[name] = start_fake(name)
            processes.append(process)
        routers = []
        for mode in ("push", "sequential"):
            process, url = start_router(urls, mode)
            processes.append(process)
            routers.append(url)
        yield Stack(urls, *routers)
    finally:
        for process in reversed(processes):
            stop_clean(process)


@dataclass
class Live:
    stack: Stack
    http: aiohttp.ClientSession

    async def post(self, url: str, body: Any) -> Any:
        async with self.http.post(url, json=body) as response:
            assert response.status == 200
            return await response.json()

    async def records(self, name: str) -> list[dict[str, Any]]:
        async with self.http.get(self.stack.urls[name] + "/requests") as response:
            records: list[dict[str, Any]] = await response.json()
            return records

    async def set_health(self, name: str, status: int) -> None:
        await self.post(self.stack.urls[name] + "/health", {"status": status})

    async def until(self, what: str, check: Any) -> None:
        try:
            async with asyncio.timeout(WAIT):
                while True:
                    if await check():
                        return
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError(f"not within {WAIT}s: {what}") from None

    async def backends(self, router: str) -> dict[str, dict[str, Any]]:
        """What the router sees of each backend, by name."""
        async with self.http.get(router + "/backends") as response:
            seen = await response.json()
        return {b["engine"].upper(): b for role in ("prefill", "decode") for b in seen[role]}

    async def router_sees(self, router: str, healthy: dict[str, bool]) -> None:
        async def check() -> bool:
            seen = await self.backends(router)
            return all(seen[name]["healthy"] is value for name, value in healthy.items())

        await self.until(f"{router} sees {healthy}", check)

    async def complete(self, router: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with self.http.post(router + "/v1/completions", json=body) as response:
            return response.status, await response.json()


@pytest_asyncio.fixture
async def live(stack: Stack) -> AsyncIterator[Live]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as http:
        live = Live(stack, http)
        for name in NAMES:
            await live.post(stack.urls[name] + "/reset", {})
        everyone = dict.fromkeys(NAMES, True)
        for router in (stack.concurrent, stack.sequential):
            await live.router_sees(router, everyone)
        yield live


@pytest.mark.asyncio
async def test_each_request_goes_to_the_backends_with_the_fewest_in_flight(live: Live) -> None:
    hold_all = {"prompt": "x", "fake": {name: {"hold": True} for name in NAMES}}
    first = asyncio.create_task(live.complete(live.stack.concurrent, hold_all))

    async def one_held_per_role(count: int) -> bool:
        held = [sum(bool(r["held"]) for r in await live.records(name)) for name in NAMES]
        return sum(held[:2]) == count and sum(held[2:]) == count

    await live.until("the first request is held on a P and a D", lambda: one_held_per_role(1))
    second = asyncio.create_task(live.complete(live.stack.concurrent, hold_all))
    await live.until("the second request is held too", lambda: one_held_per_role(2))
    for name in NAMES:  # each backend got one: the second went where nothing was in flight
        assert len(await live.records(name)) == 1, name
        await live.post(live.stack.urls[name] + "/release", {})
    assert [(await task)[0] for task in (first, second)] == [200, 200]


@pytest.mark.asyncio
async def test_an_unhealthy_backend_is_skipped_until_it_is_healthy_again(live: Live) -> None:
    router = live.stack.concurrent
    await live.set_health("P1", 503)
    await live.router_sees(router, {"P1": False, "P2": True})
    for _ in range(3):
        assert (await live.complete(router, {"prompt": "x"}))[0] == 200
    assert (len(await live.records("P1")), len(await live.records("P2"))) == (0, 3)
    await live.set_health("P1", 200)
    await live.router_sees(router, {"P1": True})
    for _ in range(2):  # nothing in flight: ties go round-robin, so P1 gets one of two
        assert (await live.complete(router, {"prompt": "x"}))[0] == 200
    assert len(await live.records("P1")) == 1


@pytest.mark.asyncio
async def test_a_backend_late_with_its_health_is_kept_until_it_misses_three_checks_in_a_row(live: Live) -> None:
    router = live.stack.concurrent
    await live.set_health("P1", 0)  # GET /health is left unanswered

    async def missed_once() -> bool:
        return bool((await live.backends(router))["P1"].get("misses", 0) >= 1)

    await live.until("P1 has missed a check", missed_once)
    await live.router_sees(router, {"P1": False})  # the third miss in a row
    seen = (await live.backends(router))["P1"]
    assert seen["misses"] >= 3 and re.search(r"no answer within 1 s \((\d+) checks in a row\)", seen["why"])
    await live.set_health("P1", 200)
    await live.router_sees(router, {"P1": True})
    assert "misses" not in (await live.backends(router))["P1"]


def test_misses_in_a_row_take_a_backend_out_an_answer_resets_them_an_error_is_at_once() -> None:
    one, two = Backend("http://a", "a", "tcp://127.0.0.1:1"), Backend("http://b", "b", "tcp://127.0.0.1:2")
    pool = BackendPool("prefill", [one, two], misses_allowed=3)
    for _ in range(2):
        pool.missed(one, "slow")
    assert [b["healthy"] for b in pool.describe()] == [True, True]
    pool.mark(one, True)  # an answer in time: the count starts again
    for _ in range(2):
        pool.missed(one, "slow")
    assert pool.describe()[0]["healthy"] and pool.describe()[0]["misses"] == 2
    pool.missed(one, "slow")
    assert not pool.describe()[0]["healthy"] and pool.describe()[0]["why"] == "slow (3 checks in a row)"
    assert pool.acquire().backend == two
    pool.mark(two, False, "HTTP 503")  # an error answer: out at once
    with pytest.raises(NoBackend, match="HTTP 503"):
        pool.acquire()
    with pytest.raises(ConfigError, match="at least 1"):
        BackendPool("decode", [one], misses_allowed=0)


@pytest.mark.asyncio
@pytest.mark.parametrize("router", ["concurrent", "sequential"])
async def test_no_healthy_backend_for_a_role_is_503_naming_it(live: Live, router: str) -> None:
    url = getattr(live.stack, router)
    for name in ("D1", "D2"):
        await live.set_health(name, 500)
    await live.router_sees(url, {"D1": False, "D2": False, "P1": True})
    status, answer = await live.complete(url, {"prompt": "x"})
    assert status == 503
    assert answer["error"]["leg"] == "decode" and "no healthy decode backend" in answer["error"]["message"]
    assert "HTTP 500" in answer["error"]["message"]  # what the health check saw
    for name in NAMES:
        assert await live.records(name) == [], name  # nothing was dispatched


@pytest.mark.asyncio
async def test_sequential_sends_p_vllms_params_then_d_ps_answer(live: Live) -> None:
    status, answer = await live.complete(live.stack.sequential, {"prompt": "x", "max_tokens": 9})
    assert status == 200 and answer["choices"][0]["text"].startswith("D")
    ((p_name, p),) = [(name, r) for name in ("P1", "P2") for r in await live.records(name)]
    (d,) = [r for name in ("D1", "D2") for r in await live.records(name)]
    assert p["body"]["kv_transfer_params"] == SEQUENTIAL_PREFILL_PARAMS and p["body"]["max_tokens"] == 1
    assert d["body"]["kv_transfer_params"] == {"do_remote_prefill": True, "from": p_name, "request": 1}
    assert d["body"]["max_tokens"] == 9 and d["arrived"] >= p["ended"]  # D only after P's answer
    assert d["headers"]["x-request-id"] == p["headers"]["x-request-id"]


@pytest.mark.asyncio
@pytest.mark.parametrize("router", ["concurrent", "sequential"])
async def test_the_clients_own_kv_transfer_params_never_reach_a_backend(live: Live, router: str) -> None:
    # Any client may put kv_transfer_params in its body (an epoch of 2**64, a made-up P): the
    # router's legs carry only what the router (or P's answer) sets, also when P answers none.
    planted = {"do_remote_prefill": True, "kvflow": {"transfer_id": "x", "epoch": 2**64}}
    no_params = {name: {"no_params": True} for name in ("P1", "P2")}
    body = {"prompt": "x", "kv_transfer_params": planted, "fake": no_params}
    status, _ = await live.complete(getattr(live.stack, router), body)
    assert status == 200
    legs = [r["body"] for name in NAMES for r in await live.records(name)]
    assert len(legs) == 2
    for leg in legs:
        assert str(2**64) not in json.dumps(leg.get("kv_transfer_params")), leg


@pytest.mark.asyncio
@pytest.mark.parametrize("router", ["concurrent", "sequential"])
async def test_no_hostile_kv_transfer_params_reach_a_backend_or_fail_a_request(live: Live, router: str) -> None:
    # A live fuzz: every client writes its own kv_transfer_params (any JSON: `params_fuzz`),
    # each marked so that whatever of them a leg carried would show.
    genuine = {
        "do_remote_prefill": True,
        "kvflow": {
            "transfer_id": "MARK-t",
            "epoch": 1,
            "mode": "push",
            "prefill": {"engine": "MARK-p", "address": "tcp://127.0.0.1:5700"},
            "decode": {"engine": "MARK-d", "address": "tcp://127.0.0.1:5800"},
        },
    }
    rng = random.Random(3)
    no_params = {name: {"no_params": True} for name in ("P1", "P2")}  # P's answer carries none
    for n in range(30):
        body = {"prompt": "x", "kv_transfer_params": hostile_params(genuine, rng), "fake": no_params if n % 2 else {}}
        status, _ = await live.complete(getattr(live.stack, router), body)
        assert status == 200
    legs = [r["body"] for name in NAMES for r in await live.records(name)]
    assert len(legs) == 60
    assert not [leg for leg in legs if "MARK" in json.dumps(leg.get("kv_transfer_params"))]


@pytest.mark.asyncio
async def test_sequential_with_a_failing_prefill_never_calls_decode(live: Live) -> None:
    body = {"prompt": "x", "fake": {"P1": {"status": 500}, "P2": {"status": 500}}}
    status, answer = await live.complete(live.stack.sequential, body)
    assert status == 502 and answer["error"]["leg"] == "prefill" and "HTTP 500" in answer["error"]["message"]
    for name in ("D1", "D2"):
        assert await live.records(name) == []
