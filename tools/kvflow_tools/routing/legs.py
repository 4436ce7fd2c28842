"""The two legs of one request: what P and D are sent, and how both are sent and awaited.

Why its own module: router.py is the HTTP front (the client's request, the choice of
backends, the app, the command line) and picks the way to dispatch from its config; this
module is everything that reaches the backends once P and D are chosen.  Its bodies and
headers are pure code (the kvflow entry both legs carry; vLLM's own params for sequential
dispatch and for its NixlPushConnector), which tests and benchmarks build without an app;
its two dispatches (both legs at once, either failing cancels the other; or P first, then D
with P's answer) bound every wait and name the failed leg in `LegFailed`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from kvflow.integrations.vllm.params import SEQUENTIAL_PREFILL_PARAMS, TransferParams
from kvflow.protocol.state import Mode
from kvflow_tools.errors import LegFailed
from kvflow_tools.routing.backends import Backend
from kvflow_tools.routing.relay import cancel

log = logging.getLogger("kvflow.router")

ERROR_DETAIL_BYTES = 2048  # how much of a failed leg's answer is quoted to the client
MAX_PREFILL_ANSWER = 1 << 20  # bytes of P's answer (one token's) the router holds; more fails the leg
Legs = tuple[bytes, "asyncio.Task[aiohttp.ClientResponse]"]  # P's answer, and the task opening D's leg


# ---------------------------------------------------------------- what each leg carries


def kvflow_params(
    mode: Mode, prefill: Backend, decode: Backend, transfer_id: str, epoch: int = 1, first_token: bool = False
) -> dict[str, Any]:
    """The ``kvflow`` entry of both legs' ``kv_transfer_params`` (concurrent dispatch);
    `first_token`: P sends D the first token it samples, and D continues from it."""
    return TransferParams(transfer_id, epoch, mode, prefill.peer(), decode.peer(), first_token).to_params()


def prefill_body(body: Mapping[str, Any], params: Mapping[str, Any] | None) -> dict[str, Any]:
    """P's request: the same prompt, one token, no streaming; its KV goes to D.  `params`: the
    kvflow entry (concurrent dispatch), or None for vLLM's own params (sequential)."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    min_tokens = out.pop("min_tokens", None)  # vLLM refuses min_tokens > max_tokens
    if isinstance(min_tokens, int) and min_tokens >= 1:
        out["min_tokens"] = 1  # and P must not stop on its one token where one engine would not
    if params is None:
        out["kv_transfer_params"] = dict(SEQUENTIAL_PREFILL_PARAMS)
    else:
        out["kv_transfer_params"] = {"do_remote_decode": True, "kvflow": dict(params)}
    return out


def nixl_push_decode_body(body: Mapping[str, Any], prefill: Backend, request_id: str) -> dict[str, Any]:
    """D's request for vLLM's NixlPushConnector: the client's, with P's engine id and NIXL side
    channel (the backend's ``kvflow`` address in this mode), to which D sends its registration,
    and P's request id (`request_id`: vLLM's, before its random suffix) for D's heartbeats."""
    host, port = prefill.kvflow.removeprefix("tcp://").rsplit(":", 1)
    out = dict(body)
    out["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": prefill.engine,
        "remote_host": host,
        "remote_port": int(port),
        "tp_size": max(1, prefill.tp_size),
        "pp_size": 1,
        "remote_request_id": request_id,
    }
    return out


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """D's request: the client's, told that its prompt's KV comes from P."""
    out = dict(body)
    out["kv_transfer_params"] = {"do_remote_prefill": True, "kvflow": dict(params)}
    return out


def answered_params(answer: Any) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of P's answer (what its connector's ``request_finished``
    returned), handed to D unchanged as vLLM's toy proxy does; None when there are none."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return dict(params) if isinstance(params, dict) else None


def leg_headers(request_id: str, authorization: str | None) -> dict[str, str]:
    """Both legs' headers: one ``X-Request-Id`` (`request_id`: the router's own name for the
    request, in its log lines too, never the transfer id, which is a capability: whoever knows it
    can ask P for that transfer's KV) and the client's ``Authorization``."""
    headers = {"X-Request-Id": f"kvflow-{request_id}"}
    if authorization is not None:
        headers["Authorization"] = authorization
    return headers


# ---------------------------------------------------------------- sending them


async def _open(
    session: aiohttp.ClientSession, leg: str, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float
) -> aiohttp.ClientResponse:
    """POST and wait for the response head; an error status or no answer raises `LegFailed`."""
    try:
        async with asyncio.timeout(timeout):
            response = await session.post(url, json=body, headers=headers)
            if response.status < 400:
                return response
            try:
                detail = (await response.content.read(ERROR_DETAIL_BYTES)).decode(errors="replace")
            finally:
                response.close()
    except TimeoutError:
        raise LegFailed(leg, f"no answer from {url} within {timeout:g} s") from None
    except aiohttp.ClientError as exc:
        raise LegFailed(leg, f"{url}: {exc.__class__.__name__}: {exc}") from None
    why = f"{url} answered HTTP {response.status}: {detail}"
    if response.status >= 500:  # vLLM names no cause for a failed request (a failed KV load included)
        why += f"; its log names the cause, under request id {headers.get('X-Request-Id', '?')}"
    raise LegFailed(leg, why)


async def _prefill(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float
) -> bytes:
    """P's leg: done when P has answered in full, that is when its prefill (and the push) is
    over; returns the answer (one token's, small)."""
    response = await _open(session, "prefill", url, body, headers, timeout)
    answer = bytearray()
    try:
        async with asyncio.timeout(timeout):
            while chunk := await response.content.readany():
                answer += chunk
                if len(answer) > MAX_PREFILL_ANSWER:  # an endless answer must not grow the router
                    raise LegFailed("prefill", f"{url} answered more than {MAX_PREFILL_ANSWER} bytes")
            return bytes(answer)
    except TimeoutError:
        raise LegFailed("prefill", f"{url} did not finish its answer within {timeout:g} s") from None
    except aiohttp.ClientError as exc:
        raise LegFailed("prefill", f"{url}: {exc.__class__.__name__}: {exc}") from None
    finally:
        response.release()


async def sequential_legs(
    session: aiohttp.ClientSession,
    body: dict[str, Any],
    urls: tuple[str, str],
    headers: tuple[dict[str, str], dict[str, str]],
    request_id: str,
    timeout: float,
) -> Legs:
    """P, then D with what P answered (`urls` and `headers`: P's, D's; `request_id`: for the
    log).  :raises LegFailed: either leg failed."""
    (p_url, d_url), (p_headers, d_headers) = urls, headers
    answer = await _prefill(session, p_url, prefill_body(body, None), p_headers, timeout)
    try:
        params = answered_params(json.loads(answer))
    except (ValueError, RecursionError):
        raise LegFailed("prefill", f"{p_url} answered with something other than JSON: {answer[:200]!r}") from None
    if params is None:
        log.warning("%s: prefill answered without kv_transfer_params: decode computes the prompt again", request_id)
    d_body = dict(body)
    d_body.pop("kv_transfer_params", None)  # the client's own never reach a backend
    if params is not None:
        d_body["kv_transfer_params"] = params
    return answer, asyncio.create_task(_open(session, "decode", d_url, d_body, d_headers, timeout))


async def concurrent_legs(
    session: aiohttp.ClientSession,
    p_body: dict[str, Any],
    d_body: dict[str, Any],
    urls: tuple[str, str],
    headers: tuple[dict[str, str], dict[str, str]],
    timeout: float,
) -> Legs:
    """Both legs at once (`urls` and `headers`: P's, D's), until P has answered; D's response
    head may still be coming.  :raises LegFailed: either leg failed (the other is cancelled)."""
    (p_url, d_url), (p_headers, d_headers) = urls, headers
    p_task = asyncio.create_task(_prefill(session, p_url, p_body, p_headers, timeout))
    d_task = asyncio.create_task(_open(session, "decode", d_url, d_body, d_headers, timeout))
    legs_ok = False
    try:
        pending: set[asyncio.Task[Any]] = {p_task, d_task}
        while p_task in pending:  # D's head may come first; its body waits (in TCP buffers) until P is done
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda task: task is not p_task):  # P's failure first: its cause
                task.result()
        legs_ok = True
        return p_task.result(), d_task
    finally:  # a leg failed, or the client went away (aiohttp cancels the handler): stop both
        if not legs_ok:
            await asyncio.gather(cancel(p_task), cancel(d_task))
