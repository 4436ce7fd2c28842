"""The router's answers to its clients: D's as it arrives, or the first token from P's answer, then D's.

Why its own module: router.py decides where each leg of a request goes and when a leg has
failed; this module only moves an answer that has begun to the client and ends it cleanly,
or cuts it short where nothing cleaner is left (the headers are out).  What a first token from
P may say, and how D's stream is checked against it, is pure code in first_token.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from kvflow_tools.errors import Diverged, LegFailed
from kvflow_tools.routing import first_token
from kvflow_tools.routing.first_token import DecodeTail, Head

__all__ = ("after_prefill", "cancel", "opened", "relay")

log = logging.getLogger("kvflow.router")


async def cancel(task: asyncio.Task[Any]) -> None:
    """Stop a leg; a response it already holds is closed, which makes vLLM abort the request."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None and isinstance(task.result(), aiohttp.ClientResponse):
        task.result().close()


async def opened(decode: asyncio.Task[aiohttp.ClientResponse]) -> aiohttp.ClientResponse:
    """D's response head, from the task opening D's leg; the leg is cancelled if this wait is
    (the client went away).  :raises LegFailed: D's leg failed."""
    try:
        return await decode
    except BaseException:
        await cancel(decode)
        raise


async def relay(
    request: web.Request, upstream: aiohttp.ClientResponse, request_id: str, timeout: float
) -> web.StreamResponse:
    """D's answer to the client, chunk by chunk as it arrives."""
    response = web.StreamResponse(status=upstream.status)
    response.content_type = upstream.content_type
    if upstream.charset:
        response.charset = upstream.charset
    complete = False
    try:
        await response.prepare(request)
        while True:
            async with asyncio.timeout(timeout):
                chunk = await upstream.content.readany()
                if not chunk:
                    break
                await response.write(chunk)
        complete = True
    except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
        # Headers are out: all that is left is to end the connection, so the client sees a
        # truncated answer rather than a clean end.
        log.warning("%s: answer cut short: %s", request_id, exc.__class__.__name__)
        _drop(request)
        return response
    finally:
        if complete:
            upstream.release()
        else:
            upstream.close()  # D stops generating for a client that is gone
    await response.write_eof()
    log.info("%s: HTTP %d", request_id, upstream.status)
    return response


async def after_prefill(
    request: web.Request,
    answer: bytes,
    decode: asyncio.Task[aiohttp.ClientResponse],
    body: Mapping[str, Any],
    request_id: str,
    timeout: float,
) -> web.StreamResponse:
    """The answer once P has answered (`answer`), with the first token from it where it can
    stand for one engine's (first_token.py); otherwise D's answer (`decode`: the task opening
    D's leg) alone.  :raises LegFailed: D's leg failed before anything was sent."""
    chat = request.path.endswith("chat/completions")
    try:
        parsed = json.loads(answer)
    except (ValueError, RecursionError):
        parsed = None
    first = first_token.head(parsed, body, chat) if parsed is not None else None
    if first is None:
        log.info("%s: the first token comes from D: P's answer cannot stand for it", request_id)
    elif not body.get("stream"):
        if first.final:  # P's answer is the whole answer: D's request ends unread
            await cancel(decode)
            if "kv_transfer_params" in parsed:
                parsed["kv_transfer_params"] = None  # as one engine's: P's were for D
            log.info("%s: answered by P alone", request_id)
            return web.json_response(parsed)
    else:
        return await _first_then_decode(request, first, decode, chat, request_id, timeout)
    return await relay(request, await opened(decode), request_id, timeout)


async def _first_then_decode(
    request: web.Request,
    first: Head,
    decode: asyncio.Task[aiohttp.ClientResponse],
    chat: bool,
    request_id: str,
    timeout: float,
) -> web.StreamResponse:
    response = web.StreamResponse(status=200)
    response.content_type = "text/event-stream"
    upstream: aiohttp.ClientResponse | None = None
    complete = False
    try:
        await response.prepare(request)
        await response.write(first.events)
        if first.final:
            log.info("%s: answered by P alone", request_id)
            complete = True
            return response
        upstream = await opened(decode)
        if upstream.content_type != "text/event-stream":
            detail = (await upstream.content.read(2048)).decode(errors="replace")
            raise LegFailed("decode", f"answered HTTP {upstream.status} {upstream.content_type}: {detail}")
        tail = DecodeTail(first, chat)
        while True:
            async with asyncio.timeout(timeout):
                chunk = await upstream.content.readany()
            if not chunk:
                break
            out = tail.feed(chunk)
            if out:
                await response.write(out)
        if not tail.passed:
            raise Diverged("D's stream ended before it gave the first token")
        complete = True
    except (LegFailed, Diverged) as exc:
        log.error("%s: answer cut short after the first token from P: %s", request_id, exc)
        await _error_event(response, str(exc))
    except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
        log.warning("%s: answer cut short: %s", request_id, exc.__class__.__name__)
        _drop(request)
        return response
    finally:
        if not decode.done() or upstream is None:
            await cancel(decode)  # D's request ends: the answer is complete, cut or its client gone
        elif complete:
            upstream.release()
        else:
            upstream.close()
    await response.write_eof()
    log.info("%s: HTTP 200, first token from P", request_id)
    return response


async def _error_event(response: web.StreamResponse, message: str) -> None:
    """End a stream that has begun as vLLM ends one that failed: an error event, then [DONE]."""
    error = {"error": {"message": message, "type": "bad_gateway", "code": 502, "leg": "decode"}}
    with contextlib.suppress(ConnectionError):
        await response.write(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")


def _drop(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.close()
