"""The router's ``--first-token prefill`` through real processes over HTTP on 127.0.0.1.

Two `tests.fake_openai_server` processes stand in for P and D (each answers what the request's
``fake`` entry tells it), and the router runs as its own script.  That the first token reaches
the client before D has sent anything is shown by holding D's stream, never by timing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.router_processes import WAIT, Process, start_fake, start_router, stop_clean
from tests.test_first_token import chunk, datas, p_answer, text_of

Urls = tuple[str, str, str]  # P, D, the router


@pytest.fixture(scope="module")
def urls() -> Iterator[Urls]:
    started: list[Process] = []
    try:
        p_proc, p_url = start_fake("P")
        started.append(p_proc)
        d_proc, d_url = start_fake("D")
        started.append(d_proc)
        router_proc, router_url = start_router(p_url, d_url, "--first-token", "prefill")
        started.append(router_proc)
        yield p_url, d_url, router_url
    finally:
        for process in reversed(started):
            stop_clean(process)


@pytest_asyncio.fixture
async def http(urls: Urls) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as session:
        for server in urls[:2]:
            async with session.post(server + "/reset") as response:
                assert response.status == 200
        yield session


async def records(http: aiohttp.ClientSession, server: str) -> list[dict[str, Any]]:
    async with http.get(server + "/requests") as response:
        found: list[dict[str, Any]] = await response.json()
        return found


async def ended(http: aiohttp.ClientSession, server: str) -> dict[str, Any]:
    """`server`'s one request, once it has ended."""
    async with asyncio.timeout(WAIT):
        while True:
            (record,) = await records(http, server)
            if record["outcome"] is not None:
                return record
            await asyncio.sleep(0.02)


def request(fake: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", "max_tokens": 8, "stream": True, "fake": fake} | more


async def next_event(response: aiohttp.ClientResponse) -> Any:
    line = await response.content.readuntil(b"\n\n")
    (data,) = datas(line)
    return data


@pytest.mark.asyncio
async def test_the_first_token_reaches_the_client_while_d_has_sent_nothing(
    urls: Urls, http: aiohttp.ClientSession
) -> None:
    p, d, router = urls
    d_events = [chunk("Hel"), chunk("lo"), chunk("!", "length")]
    fake = {"P": {"answer": p_answer("Hel")}, "D": {"events": d_events, "hold_after": 0}}
    async with http.post(router + "/v1/completions", json=request(fake)) as response:
        assert response.status == 200 and response.content_type == "text/event-stream"
        first = await next_event(response)
        assert first["choices"][0]["text"] == "Hel" and first["choices"][0]["finish_reason"] is None
        (d_record,) = await records(http, d)
        assert d_record["held"]  # D has sent nothing yet
        async with http.post(d + "/release") as released:
            assert released.status == 200
        rest = datas(await response.read())
    assert text_of([first, *rest]) == "Hello!" and rest[-1] == "[DONE]"
    (p_record,), d_record = await records(http, p), await ended(http, d)
    seed = p_record["body"]["seed"]
    assert isinstance(seed, int) and d_record["body"]["seed"] == seed  # both legs draw alike
    for leg in (p_record, d_record):  # kvflow's P sends D its token, and D continues from it
        assert leg["body"]["kv_transfer_params"]["kvflow"]["first_token"] is True


@pytest.mark.asyncio
async def test_a_first_token_that_stops_is_the_whole_answer_and_ds_request_is_cancelled(
    urls: Urls, http: aiohttp.ClientSession
) -> None:
    p, d, router = urls
    fake = {"P": {"answer": p_answer("Hel", "stop")}, "D": {"events": [chunk("Hel")], "hold_after": 0}}
    async with http.post(router + "/v1/completions", json=request(fake, seed=5)) as response:
        got = datas(await response.read())
    assert [g if g == "[DONE]" else g["choices"][0]["finish_reason"] for g in got] == ["stop", "[DONE]"]
    assert (await ended(http, d))["outcome"] == "cancelled"
    (p_record,) = await records(http, p)
    assert p_record["body"]["seed"] == 5  # the client's own seed


@pytest.mark.asyncio
async def test_unstreamed_a_final_first_token_is_ps_answer_without_its_transfer_params(
    urls: Urls, http: aiohttp.ClientSession
) -> None:
    p, d, router = urls
    fake = {"P": {"answer": p_answer("Hel", "length")}, "D": {"hold": True}}
    async with http.post(router + "/v1/completions", json=request(fake, stream=False, max_tokens=1)) as response:
        answer = await response.json()
    assert answer == p_answer("Hel", "length") | {"kv_transfer_params": None}  # as one engine's
    assert (await ended(http, d))["outcome"] == "cancelled"


@pytest.mark.asyncio
async def test_unstreamed_and_not_final_the_answer_is_ds(urls: Urls, http: aiohttp.ClientSession) -> None:
    p, d, router = urls
    fake = {"P": {"answer": p_answer("Hel", "length")}, "D": {}}
    async with http.post(router + "/v1/completions", json=request(fake, stream=False)) as response:
        answer = await response.json()
    assert answer["choices"][0]["text"] == "D-answer"


@pytest.mark.asyncio
async def test_a_d_that_draws_another_first_token_ends_the_answer_with_an_error(
    urls: Urls, http: aiohttp.ClientSession
) -> None:
    p, d, router = urls
    fake = {"P": {"answer": p_answer("Hel")}, "D": {"events": [chunk("Wor"), chunk("ld")]}}
    async with http.post(router + "/v1/completions", json=request(fake)) as response:
        got = datas(await response.read())
    assert got[0]["choices"][0]["text"] == "Hel"
    assert "D's text begins 'Wor'" in got[1]["error"]["message"] and got[2] == "[DONE]"
    assert (await ended(http, d))["outcome"] in ("answered", "cancelled")


@pytest.mark.asyncio
async def test_echo_gets_ds_stream_alone_and_no_seed(urls: Urls, http: aiohttp.ClientSession) -> None:
    p, d, router = urls
    fake = {"P": {"answer": p_answer("Hel")}, "D": {"events": [chunk("A"), chunk("B")]}}
    async with http.post(router + "/v1/completions", json=request(fake, echo=True)) as response:
        got = datas(await response.read())
    assert text_of(got) == "AB"
    (p_record,) = await records(http, p)
    assert "seed" not in p_record["body"]
    assert "first_token" not in p_record["body"]["kv_transfer_params"]["kvflow"]  # D draws its own


@pytest.mark.asyncio
@pytest.mark.parametrize("field", ["n", "best_of"])
async def test_several_samples_are_refused_before_any_leg(urls: Urls, http: aiohttp.ClientSession, field: str) -> None:
    p, d, router = urls
    async with http.post(router + "/v1/completions", json=request({}, **{field: 2})) as response:
        assert response.status == 400
        assert "send one request per sample" in (await response.json())["error"]["message"]
    assert await records(http, p) == [] and await records(http, d) == []


@pytest.mark.asyncio
async def test_when_ps_answer_cannot_stand_for_it_ds_stream_comes_alone(
    urls: Urls, http: aiohttp.ClientSession
) -> None:
    p, d, router = urls
    fake = {"P": {"answer": p_answer("\ufffd")}, "D": {"events": [chunk("\u00e9"), chunk("t\u00e9")]}}
    async with http.post(router + "/v1/completions", json=request(fake)) as response:
        got = datas(await response.read())
    assert text_of(got) == "\u00e9t\u00e9"
    assert json.dumps(got)  # every event is D's, whole
