"""A stand-in for a vLLM OpenAI server, for testing the 1P1D router with real processes and HTTP.

Run as ``python -m tests.fake_openai_server --name P``; it binds an ephemeral port on 127.0.0.1
and writes ``{"event": "ready", "port": N}`` as its first stdout line.

It records every completion request (path, body, headers, arrival and end times, outcome) and
serves them at ``GET /requests``.  SIGTERM stops it.  What it does with a request is read from the request body's
``fake`` entry, keyed by this server's name, so one client request can steer P and D apart:

    {"fake": {"P": {"hold": true, "status": 500}, "D": {"chunks": 3, "hold_after": 1}}}

* ``hold``: answer only after ``POST /release`` (at most `HOLD_LIMIT` s, then 504);
* ``status``: answer with this error status and a JSON error;
* ``chunks``: with ``"stream": true`` in the body, the number of SSE data events (default 3);
* ``hold_after``: stream that many events, then wait for ``POST /release`` before the rest;
* ``no_params``: answer a ``do_remote_decode`` request without ``kv_transfer_params``;
* ``answer``: a non-streamed answer's JSON, sent as given (with ``kv_transfer_params`` added as below);
* ``events``: a streamed answer's data events, sent as given (each a JSON value), then ``[DONE]``.

A request whose connection closes before the answer is complete ends with outcome "cancelled".
A non-streamed answer to a request with ``do_remote_decode`` carries ``kv_transfer_params``, as
vLLM's does: ``{"do_remote_prefill": true, "from": NAME, "request": N}``.
``GET /health`` answers 200, or the status last set by ``POST /health`` with ``{"status": N}``;
status 0 means no answer at all (each check waits until the health is set again, or the hold
limit).
``POST /reset`` forgets the records, releases whatever is held and makes the server healthy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from typing import Any

from aiohttp import web

HOLD_LIMIT = 30.0


class State:
    def __init__(self, name: str) -> None:
        self.name = name
        self.records: list[dict[str, Any]] = []
        self.release = asyncio.Event()
        self.health = 200
        self.health_set = asyncio.Event()  # set (and replaced) whenever the health changes


STATE = web.AppKey("state", State)


def _state(request: web.Request) -> State:
    return request.app[STATE]


async def _hold(state: State, record: dict[str, Any]) -> bool:
    """Wait for /release; False when it did not come in time."""
    record["held"] = True
    try:
        async with asyncio.timeout(HOLD_LIMIT):
            await state.release.wait()
    except TimeoutError:
        return False
    finally:
        record["held"] = False
    return True


def _event(index: int) -> bytes:
    data = {"id": "cmpl-fake", "object": "text_completion", "choices": [{"index": 0, "text": f"tok{index}"}]}
    return f"data: {json.dumps(data)}\n\n".encode()


async def completion(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    body = await request.json()
    record: dict[str, Any] = {
        "path": request.path,
        "body": body,
        "headers": {key.lower(): value for key, value in request.headers.items()},
        "arrived": time.time(),
        "ended": None,
        "outcome": None,
        "held": False,
    }
    state.records.append(record)
    how: dict[str, Any] = body.get("fake", {}).get(state.name, {})
    try:
        if how.get("hold") and not await _hold(state, record):
            record["outcome"] = "hold limit"
            return web.json_response({"error": {"message": "held too long"}}, status=504)
        if "status" in how:
            record["outcome"] = f"status {how['status']}"
            return web.json_response({"error": {"message": f"{state.name} told to fail"}}, status=how["status"])
        if not body.get("stream"):
            record["outcome"] = "answered"
            text = f"{state.name}-answer" + "x" * int(how.get("bloat", 0))  # "bloat": pad by that many bytes
            choice = {"index": 0, "text": text, "finish_reason": "length"}
            answer: dict[str, Any] = {"id": "cmpl-fake", "object": "text_completion", "choices": [choice]}
            answer = dict(how.get("answer", answer))
            if (body.get("kv_transfer_params") or {}).get("do_remote_decode") and not how.get("no_params"):
                number = len(state.records)
                answer["kv_transfer_params"] = {"do_remote_prefill": True, "from": state.name, "request": number}
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        given = how.get("events")
        for index in range(len(given) if given is not None else int(how.get("chunks", 3))):
            if index == how.get("hold_after") and not await _hold(state, record):
                record["outcome"] = "hold limit"
                return response
            await response.write(_event(index) if given is None else f"data: {json.dumps(given[index])}\n\n".encode())
            await asyncio.sleep(0)  # one write per event
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        record["outcome"] = "answered"
        return response
    except asyncio.CancelledError:
        record["outcome"] = "cancelled"
        raise
    except ConnectionError:  # the client went away mid-answer (the router gave the stream up): not the fake's error
        record["outcome"] = "cancelled"
        return web.Response(status=499)
    finally:
        record["ended"] = time.time()


async def health(request: web.Request) -> web.Response:
    state = _state(request)
    if state.health == 0:  # unanswered until the health changes
        async with asyncio.timeout(HOLD_LIMIT):
            await state.health_set.wait()
    return web.json_response({"status": state.health}, status=state.health)


def _set_health(state: State, status: int) -> None:
    state.health = status
    state.health_set.set()
    state.health_set = asyncio.Event()


async def set_health(request: web.Request) -> web.Response:
    _set_health(_state(request), int((await request.json())["status"]))
    return web.json_response({"health": _state(request).health})


async def requests(request: web.Request) -> web.Response:
    return web.json_response(_state(request).records)


async def release(request: web.Request) -> web.Response:
    _state(request).release.set()
    return web.json_response({"released": True})


async def reset(request: web.Request) -> web.Response:
    state = _state(request)
    state.release.set()
    state.release = asyncio.Event()
    state.records = []
    _set_health(state, 200)
    return web.json_response({"reset": True})


async def serve(name: str) -> None:
    app = web.Application()
    app[STATE] = State(name)
    for path in ("/v1/completions", "/v1/chat/completions"):
        app.router.add_post(path, completion)
    app.router.add_get("/requests", requests)
    app.router.add_get("/health", health)
    app.router.add_post("/health", set_health)
    app.router.add_post("/release", release)
    app.router.add_post("/reset", reset)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        sys.stdout.write(json.dumps({"event": "ready", "port": port}) + "\n")
        sys.stdout.flush()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description="a fake OpenAI completions server")
    parser.add_argument("--name", required=True, help="the key of this server's entry in a body's 'fake'")
    asyncio.run(serve(parser.parse_args().name))


if __name__ == "__main__":
    main()
