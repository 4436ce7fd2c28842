"""An xPyD router: OpenAI completion requests split over vLLM prefill servers and decode servers.

Each request goes to one prefill server (P: same prompt, one token) and one decode server (D:
the original request), each the healthy one of its role with the fewest requests in flight, and
D's answer is streamed back.  Every backend's ``GET /health`` is checked periodically (each check
with a deadline); a backend that answers it with an error, refuses the connection, or leaves
``--health-misses`` checks in a row unanswered is skipped until it answers again, and with none
healthy for a role the client gets 503 naming the role, after one health check of that role
made at once (`Recheck`: a backend back from a restart serves the next request).
``GET /backends`` shows what the router sees.

With ``--first-token prefill``, a streamed request's first token goes to the client from P's
answer the moment P has it, and D's stream follows, checked against it (first_token.py): the
time to the first token is P's prefill and one hop.  Both legs ask kvflow's connector for P's
token (``first_token`` in their kvflow entry), so that D continues from it.

Ways to dispatch (``--mode``; what each leg is sent, and how, is legs.py):

* ``push`` (default) or ``pull``: both legs at the same time, carrying the same kvflow transfer
  parameters.  Why at the same time: with push, D registers its blocks while P is still
  prefilling, so P writes the KV the moment it is computed.  Sending D only after P answered
  would put a round trip and D's block allocation back on the critical path.  If either leg
  fails, the other is cancelled (closing its connection makes vLLM abort the request, and
  kvflow the transfer) and the client gets 502 naming the leg.
* ``sequential``: as vLLM's toy proxy, llm-d and Dynamo do: P first, with vLLM's own
  ``do_remote_decode`` params and no kvflow entry; then D with the ``kv_transfer_params`` of
  P's answer, from which D pulls the KV.  Any kvflow-served P (with a fixed kvflow port) works
  behind such a router.
* ``nixl-push``: for vLLM's ``NixlPushConnector``: both legs at once, P with vLLM's
  ``do_remote_decode`` params, D told P's engine id and NIXL side channel up front (a P's
  ``--prefill-kvflow`` is then that side channel, ``VLLM_NIXL_SIDE_CHANNEL_HOST:PORT``), so that
  D registers its blocks and P writes them once its prefill is done.  Both legs carry the same
  ``X-Request-Id``: P matches D's registration by that request id.

    python -m kvflow_tools.routing.router \\
        --prefill http://10.0.0.1:8100 --prefill-engine prefill-0 --prefill-kvflow tcp://10.0.0.1:5700 \\
        --prefill http://10.0.0.2:8100 --prefill-engine prefill-1 --prefill-kvflow tcp://10.0.0.2:5700 \\
        --decode http://10.0.0.3:8200 --decode-engine decode-0 --decode-kvflow tcp://10.0.0.3:5800

Each ``--prefill`` / ``--decode`` names one backend; its ``-engine`` and ``-kvflow`` options are
given as often, in the same order.

What a client can make it hold is bounded (`http_limits`, ``GET /limits``): a request's head
within ``--header-timeout`` (a kept-alive connection waits for its next request at most
``--idle-timeout``), its body within ``--body-timeout`` (408), ``--max-body`` (413) and the
``--body-budget`` of all bodies in flight (503), connections at ``--max-connections``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import signal
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvflow.errors import ConfigError
from kvflow.protocol.messages import address_problem
from kvflow.protocol.state import Mode
from kvflow_tools.errors import LegFailed, NoBackend, RequestRefused
from kvflow_tools.routing import first_token, http_limits, limit_options
from kvflow_tools.routing.backends import Backend as Backend
from kvflow_tools.routing.backends import BackendPool, Recheck, check_health
from kvflow_tools.routing.http_limits import LIMITS, ClientLimits, Limits, middleware
from kvflow_tools.routing.legs import (
    Legs,
    concurrent_legs,
    decode_body,
    kvflow_params,
    leg_headers,
    nixl_push_decode_body,
    prefill_body,
    sequential_legs,
)
from kvflow_tools.routing.relay import after_prefill, opened, relay

log = logging.getLogger("kvflow.router")

ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[Backend, ...]
    decode: tuple[Backend, ...]
    mode: Mode = Mode.PUSH
    timeout: float = 600.0  # bound on every wait: P's answer, D's head, each chunk of D's body
    sequential: bool = False  # P first, then D with P's answer (vLLM's toy proxy convention)
    health_interval: float = 5.0  # seconds between health checks of every backend
    health_timeout: float = 2.0  # the deadline of one health check
    nixl_push: bool = False  # both legs at once with vLLM's NixlPushConnector params
    health_misses: int = 3  # unanswered health checks in a row before a backend is skipped
    backend_keepalive: float = 2.0  # seconds an idle connection to a backend is reused; see make_app
    limits: Limits = Limits()  # what a client can make the router hold (http_limits)
    first_token: bool = False  # the first token from P's answer, sent at once (first_token.py)


@dataclass(frozen=True)
class Pools:
    prefill: BackendPool
    decode: BackendPool


CONFIG = web.AppKey("config", RouterConfig)
SESSION = web.AppKey("session", aiohttp.ClientSession)
POOLS = web.AppKey("pools", Pools)
RECHECK = web.AppKey("recheck", Recheck)


# ---------------------------------------------------------------- pure parts


def several_samples(body: Mapping[str, Any]) -> str | None:
    """Why a request with a kvflow transfer cannot be served (None: it can): vLLM makes each of
    `n` (or `best_of`) samples a request of its own on D, and a transfer fills one request's
    blocks, so every sample but one would fail."""
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            return f"{name} {body[name]!r}: a prompt's KV moves to one request on D; send one request per sample"
    return None


def error_body(status: int, message: str, leg: str | None = None) -> dict[str, Any]:
    kind = {502: "bad_gateway", 503: "service_unavailable"}.get(status, "invalid_request_error")
    error: dict[str, Any] = {"message": message, "type": kind, "code": status}
    return {"error": error | {"leg": leg}} if leg else {"error": error}


# ---------------------------------------------------------------- handlers


async def proxy(request: web.Request) -> web.StreamResponse:
    config, pools = request.app[CONFIG], request.app[POOLS]
    try:
        held = await request.app[LIMITS].body(request)  # against --body-budget until both legs are sent
        body = held.json()
    except RequestRefused as exc:
        response = web.json_response(error_body(exc.status, str(exc)), status=exc.status)
        response.force_close()  # the rest of its body is not read
        return response
    except ValueError as exc:
        return web.json_response(error_body(400, f"request body is not valid JSON: {exc}"), status=400)
    except RecursionError:
        return web.json_response(error_body(400, "request body is JSON nested too deeply"), status=400)
    if not isinstance(body, dict):
        return web.json_response(error_body(400, "request body must be a JSON object"), status=400)
    if not (config.sequential or config.nixl_push) and (why := several_samples(body)):
        return web.json_response(error_body(400, why), status=400)
    recheck, session = request.app[RECHECK], request.app[SESSION]
    try:
        p_lease = await recheck.acquire(session, pools.prefill)
    except NoBackend as exc:
        return web.json_response(error_body(503, str(exc), exc.role), status=503)
    try:
        d_lease = await recheck.acquire(session, pools.decode)
    except NoBackend as exc:
        p_lease.release()
        return web.json_response(error_body(503, str(exc), exc.role), status=503)
    request_id = uuid.uuid4().hex
    headers = leg_headers(request_id, request.headers.get("Authorization"))
    first = config.first_token and first_token.ineligible(body) is None
    if first:  # one seed on both legs: where D cannot continue from P's token, it draws the same (first_token.py)
        body = first_token.with_seed(body, secrets.randbelow(1 << 31))
    try:
        backends = (p_lease.backend, d_lease.backend)
        answer, decode = await _dispatch(request, body, backends, headers, request_id, first=first)
        held.release()  # its share of the budget is not held while the answer streams
        p_lease.release()
        if first:
            return await after_prefill(request, answer, decode, body, request_id, config.timeout)
        del body  # not held while D's answer streams
        return await relay(request, await opened(decode), request_id, config.timeout)
    except LegFailed as exc:
        log.warning("%s: %s", request_id, exc)
        return web.json_response(error_body(502, str(exc), exc.leg), status=502)
    finally:
        p_lease.release()
        d_lease.release()


async def _dispatch(
    request: web.Request,
    body: dict[str, Any],
    backends: tuple[Backend, Backend],
    headers: dict[str, str],
    rid: str,
    first: bool = False,
) -> Legs:
    """Both legs, as the config says (`backends`: P, D; `rid`: the request id), until P has
    answered: P's answer and the task opening D's leg.  The legs' bodies end with this call.
    `first`: the first token comes from P, so kvflow's P sends it to D too.
    :raises LegFailed: either leg failed (the other is cancelled)."""
    config, session, path = request.app[CONFIG], request.app[SESSION], request.path
    prefill, decode = backends
    urls = (prefill.url + path, decode.url + path)
    legs = (prefill.headers(headers), decode.headers(headers))
    if config.sequential:
        return await sequential_legs(session, body, urls, legs, rid, config.timeout)
    if config.nixl_push:
        xid = headers["X-Request-Id"]  # a completion's id ends in its prompt's index:
        p_id = f"chatcmpl-{xid}" if path.endswith("chat/completions") else f"cmpl-{xid}-0"
        p_body, d_body = prefill_body(body, None), nixl_push_decode_body(body, prefill, p_id)
    else:
        params = kvflow_params(config.mode, prefill, decode, uuid.uuid4().hex, first_token=first)  # a new transfer id
        p_body, d_body = prefill_body(body, params), decode_body(body, params)
    return await concurrent_legs(session, p_body, d_body, urls, legs, config.timeout)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def backends(request: web.Request) -> web.Response:
    pools = request.app[POOLS]
    return web.json_response({"prefill": pools.prefill.describe(), "decode": pools.decode.describe()})


async def _check_backends(session: aiohttp.ClientSession, pools: Pools, config: RouterConfig) -> None:
    """Every backend's health, now and then every `health_interval` seconds, until cancelled."""
    while True:
        for pool in (pools.prefill, pools.decode):
            await check_health(session, pool, config.health_timeout)
        await asyncio.sleep(config.health_interval)


def make_app(config: RouterConfig) -> web.Application:
    """:raises ConfigError: a role without backends, or a backend listed twice."""
    app = web.Application(client_max_size=config.limits.max_body, middlewares=[middleware])
    app[CONFIG] = config
    app[LIMITS] = ClientLimits(config.limits)
    app[POOLS] = Pools(
        BackendPool("prefill", config.prefill, config.health_misses),
        BackendPool("decode", config.decode, config.health_misses),
    )
    app[RECHECK] = Recheck(config.health_timeout)

    async def client(app: web.Application) -> AsyncIterator[None]:
        # No pool cap: a capped pool shared by both legs could be filled with D requests that
        # wait for P requests which cannot get a connection.  Idle connections are reused for
        # less time than the backends keep them (vLLM's server closes them after 5 s,
        # VLLM_HTTP_TIMEOUT_KEEP_ALIVE; aiohttp would reuse them for 15 s): a request sent on a
        # connection the server is closing at that moment fails with "Server disconnected".
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=config.backend_keepalive)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            app[SESSION] = session
            checks = asyncio.create_task(_check_backends(session, app[POOLS], config))
            try:
                yield
            finally:
                checks.cancel()
                await asyncio.wait({checks})

    app.cleanup_ctx.append(client)
    for path in ROUTES:
        app.router.add_post(path, proxy)
    app.router.add_get("/health", health)
    app.router.add_get("/backends", backends)
    app.router.add_get("/limits", http_limits.describe)
    return app


# ---------------------------------------------------------------- command line


def _http_url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{value!r} is not an http:// or https:// URL")
    return value.rstrip("/")


def _tcp_address(value: str) -> str:
    problem = address_problem(value)  # what the connectors accept in the params made from it
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{value!r}: a kvflow address {problem}")
    return value


_positive = limit_options.positive(float, "number of seconds")
ROLES = {"prefill": (8100, "prefill-0", 5700), "decode": (8200, "decode-0", 5800)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0: any free port")
    for side in ROLES:
        parser.add_argument(
            f"--{side}", type=_http_url, action="append", help=f"a {side} backend's vLLM base URL (repeatable)"
        )
        parser.add_argument(f"--{side}-engine", action="append", help="its engine_id in --kv-transfer-config")
        parser.add_argument(f"--{side}-kvflow", type=_tcp_address, action="append", help="its kvflow address")
        parser.add_argument(
            f"--{side}-tp-size", type=int, action="append", help="its tensor parallelism (when P's and D's differ)"
        )
        parser.add_argument(f"--{side}-dp-rank", type=int, action="append", help="the data-parallel rank to address")
    parser.add_argument(
        "--mode",
        choices=("push", "pull", "sequential", "nixl-push"),
        default="push",
        help="push or pull: both legs at once with a kvflow entry; sequential: P, then D with P's answer; "
        "nixl-push: both legs at once for vLLM's NixlPushConnector",
    )
    parser.add_argument(
        "--first-token",
        choices=("decode", "prefill"),
        default="decode",
        help="prefill: a streamed request's first token is sent from P's answer as soon as P has it, and D's "
        "stream follows, checked against it (default decode: D's stream alone)",
    )
    parser.add_argument("--timeout", type=_positive, default=600.0, help="seconds any one wait may take (default 600)")
    parser.add_argument("--health-interval", type=_positive, default=5.0, help="seconds between health checks")
    parser.add_argument("--health-timeout", type=_positive, default=2.0, help="deadline of one health check")
    parser.add_argument(
        "--health-misses",
        type=int,
        default=3,
        help="health checks in a row a backend may leave unanswered before it is skipped (an error answer or a "
        "refused connection: at once)",
    )
    parser.add_argument(
        "--backend-keepalive",
        type=_positive,
        default=2.0,
        help="seconds an idle connection to a backend is reused; keep it below the backends' own keep-alive "
        "(vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s)",
    )
    limit_options.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        limit_options.limits_from(args)
    except ConfigError as exc:
        parser.error(str(exc))
    for side, (http, engine, kvflow) in ROLES.items():
        urls = getattr(args, side) or [f"http://127.0.0.1:{http}"]
        engines = getattr(args, f"{side}_engine") or ([engine] if len(urls) == 1 else [])
        addresses = getattr(args, f"{side}_kvflow") or ([f"tcp://127.0.0.1:{kvflow}"] if len(urls) == 1 else [])
        if not len(urls) == len(engines) == len(addresses):
            parser.error(f"give --{side}, --{side}-engine and --{side}-kvflow once for each {side} backend")
        setattr(args, side, urls)
        setattr(args, f"{side}_engine", engines)
        setattr(args, f"{side}_kvflow", addresses)
        for option, default in (("tp_size", 0), ("dp_rank", None)):
            given = getattr(args, f"{side}_{option}") or [default] * len(urls)
            if len(given) != len(urls):
                parser.error(f"give --{side}-{option.replace('_', '-')} once for each {side} backend, or never")
            setattr(args, f"{side}_{option}", given)
    return args


def config_from(args: argparse.Namespace) -> RouterConfig:
    """:raises ConfigError: see `make_app`."""
    prefill, decode = (
        tuple(
            map(
                Backend,
                *(getattr(args, f"{side}{part}") for part in ("", "_engine", "_kvflow", "_tp_size", "_dp_rank")),
            )
        )
        for side in ("prefill", "decode")
    )
    sequential, nixl_push = args.mode == "sequential", args.mode == "nixl-push"
    mode = Mode.PULL if sequential else Mode.PUSH if nixl_push else Mode(args.mode)
    return RouterConfig(
        prefill,
        decode,
        mode,
        args.timeout,
        sequential,
        args.health_interval,
        args.health_timeout,
        nixl_push,
        args.health_misses,
        args.backend_keepalive,
        limit_options.limits_from(args),
        args.first_token == "prefill",
    )


async def serve(args: argparse.Namespace) -> None:
    """:raises ConfigError: see `make_app`."""
    runner, site = await http_limits.start(make_app(config_from(args)), args.host, args.port)
    try:
        host, port = site.address
        log.info(
            "router listening on http://%s:%d (P %s, D %s, %s; at most %d client connections)",
            host,
            port,
            " ".join(args.prefill),
            " ".join(args.decode),
            args.mode,
            runner.app[LIMITS].max_connections,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(parse_args(argv)))
    except ConfigError as exc:
        raise SystemExit(f"router: {exc}") from None


if __name__ == "__main__":
    main()
