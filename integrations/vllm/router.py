"""A 1P1D router: OpenAI completion requests split over a vLLM prefill server and a decode server.

Each request goes to the prefill server (P: same prompt, one token) and to the decode server (D:
the original request) at the same time, both carrying the same kvflow transfer parameters, and
D's answer is streamed back.  Why at the same time: with push, D registers its blocks while P is
still prefilling, so P writes the KV the moment it is computed.  Sending D only after P answered
would put a round trip and D's block allocation back on the critical path.

If either leg fails, the other is cancelled (closing its connection makes vLLM abort the request,
and kvflow the transfer) and the client gets 502 naming the leg.

    python -m kvflow.integrations.vllm.router --prefill http://127.0.0.1:8100 --prefill-engine prefill-0 \\
        --prefill-kvflow tcp://127.0.0.1:5700 --decode http://127.0.0.1:8200 --decode-engine decode-0 \\
        --decode-kvflow tcp://127.0.0.1:5800
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvflow.errors import LegFailed
from kvflow.integrations.vllm.mapping import PeerRef, TransferParams
from kvflow.protocol.state import Mode

log = logging.getLogger("kvflow.router")

ROUTES = ("/v1/completions", "/v1/chat/completions")
ERROR_DETAIL_BYTES = 2048  # how much of a failed leg's answer is quoted to the client


@dataclass(frozen=True)
class Backend:
    url: str  # the vLLM server's HTTP base URL
    engine: str  # its `engine_id` in --kv-transfer-config
    kvflow: str  # its kvflow control address (rank 0 of DP rank 0), tcp://host:port
    tp_size: int = 0  # its tensor parallelism (0: not said; each side then assumes the other's equals its own)
    dp_rank: int | None = None  # the data-parallel rank to address (None: the server's choice, no DP)

    def peer(self) -> PeerRef:
        """The kvflow peer: with a DP rank, vLLM's engine id ``<engine>_dp<k>`` and kvflow's ports
        past the `tp_size` ports of each DP rank before it."""
        if self.dp_rank is None:
            return PeerRef(self.engine, self.kvflow, self.tp_size)
        host, port = self.kvflow.rsplit(":", 1)
        address = f"{host}:{int(port) + self.dp_rank * max(1, self.tp_size)}"
        return PeerRef(f"{self.engine}_dp{self.dp_rank}", address, self.tp_size)

    def headers(self, common: dict[str, str]) -> dict[str, str]:
        """A leg's headers: vLLM routes a request with ``X-data-parallel-rank`` to that DP rank."""
        return common if self.dp_rank is None else {**common, "X-data-parallel-rank": str(self.dp_rank)}


@dataclass(frozen=True)
class RouterConfig:
    prefill: Backend
    decode: Backend
    mode: Mode = Mode.PUSH
    timeout: float = 600.0  # bound on every wait: P's answer, D's head, each chunk of D's body


CONFIG = web.AppKey("config", RouterConfig)
SESSION = web.AppKey("session", aiohttp.ClientSession)


# ---------------------------------------------------------------- pure parts


def kvflow_params(config: RouterConfig, transfer_id: str, epoch: int = 1) -> dict[str, Any]:
    """The ``kvflow`` entry of both legs' ``kv_transfer_params``."""
    return TransferParams(transfer_id, epoch, config.mode, config.prefill.peer(), config.decode.peer()).to_params()


def prefill_body(body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """P's request: the same prompt, one token, no streaming; its KV goes to D."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)  # vLLM refuses min_tokens > max_tokens
    out["kv_transfer_params"] = {"do_remote_decode": True, "kvflow": dict(params)}
    return out


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """D's request: the client's, told that its prompt's KV comes from P."""
    out = dict(body)
    out["kv_transfer_params"] = {"do_remote_prefill": True, "kvflow": dict(params)}
    return out


def leg_headers(transfer_id: str, authorization: str | None) -> dict[str, str]:
    headers = {"X-Request-Id": f"kvflow-{transfer_id}"}
    if authorization is not None:
        headers["Authorization"] = authorization
    return headers


def error_body(status: int, message: str, leg: str | None = None) -> dict[str, Any]:
    kind = "bad_gateway" if status == 502 else "invalid_request_error"
    error: dict[str, Any] = {"message": message, "type": kind, "code": status}
    return {"error": error | {"leg": leg}} if leg else {"error": error}


# ---------------------------------------------------------------- the two legs


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
    raise LegFailed(leg, f"{url} answered HTTP {response.status}: {detail}")


async def _prefill(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float
) -> None:
    """P's leg: done when P has answered in full, that is when its prefill (and the push) is over."""
    response = await _open(session, "prefill", url, body, headers, timeout)
    try:
        async with asyncio.timeout(timeout):
            while await response.content.readany():  # one token: read and drop
                pass
    except TimeoutError:
        raise LegFailed("prefill", f"{url} did not finish its answer within {timeout:g} s") from None
    except aiohttp.ClientError as exc:
        raise LegFailed("prefill", f"{url}: {exc.__class__.__name__}: {exc}") from None
    finally:
        response.release()


async def _cancel(task: asyncio.Task[Any]) -> None:
    """Stop a leg; a response it already holds is closed, which makes vLLM abort the request."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None and isinstance(task.result(), aiohttp.ClientResponse):
        task.result().close()


# ---------------------------------------------------------------- handlers


async def proxy(request: web.Request) -> web.StreamResponse:
    config, session = request.app[CONFIG], request.app[SESSION]
    try:
        body = json.loads(await request.read())
    except ValueError as exc:
        return web.json_response(error_body(400, f"request body is not valid JSON: {exc}"), status=400)
    if not isinstance(body, dict):
        return web.json_response(error_body(400, "request body must be a JSON object"), status=400)

    transfer_id = uuid.uuid4().hex
    params = kvflow_params(config, transfer_id)
    headers = leg_headers(transfer_id, request.headers.get("Authorization"))
    p_url, d_url = config.prefill.url + request.path, config.decode.url + request.path
    p_headers, d_headers = config.prefill.headers(headers), config.decode.headers(headers)
    p_task = asyncio.create_task(_prefill(session, p_url, prefill_body(body, params), p_headers, config.timeout))
    d_task = asyncio.create_task(_open(session, "decode", d_url, decode_body(body, params), d_headers, config.timeout))
    legs_ok = False
    try:
        pending: set[asyncio.Task[Any]] = {p_task, d_task}
        while p_task in pending:  # D's head may come first; its body waits (in TCP buffers) until P is done
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda task: task is not p_task):  # P's failure first: its cause
                task.result()
        upstream = await d_task
        legs_ok = True
    except LegFailed as exc:
        log.warning("%s: %s", transfer_id, exc)
        return web.json_response(error_body(502, str(exc), exc.leg), status=502)
    finally:  # a leg failed, or the client went away (aiohttp cancels the handler): stop both
        if not legs_ok:
            await asyncio.gather(_cancel(p_task), _cancel(d_task))
    return await _relay(request, upstream, transfer_id, config.timeout)


async def _relay(
    request: web.Request, upstream: aiohttp.ClientResponse, transfer_id: str, timeout: float
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
        log.warning("%s: answer cut short: %s", transfer_id, exc.__class__.__name__)
        if request.transport is not None:
            request.transport.close()
        return response
    finally:
        if complete:
            upstream.release()
        else:
            upstream.close()  # D stops generating for a client that is gone
    await response.write_eof()
    log.info("%s: HTTP %d", transfer_id, upstream.status)
    return response


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def make_app(config: RouterConfig, max_body: int = 64 << 20) -> web.Application:
    app = web.Application(client_max_size=max_body)
    app[CONFIG] = config

    async def client(app: web.Application) -> AsyncIterator[None]:
        # No pool cap: a capped pool shared by both legs could be filled with D requests that
        # wait for P requests which cannot get a connection.
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            app[SESSION] = session
            yield

    app.cleanup_ctx.append(client)
    for path in ROUTES:
        app.router.add_post(path, proxy)
    app.router.add_get("/health", health)
    return app


# ---------------------------------------------------------------- command line


def _http_url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{value!r} is not an http:// or https:// URL")
    return value.rstrip("/")


def _tcp_address(value: str) -> str:
    host, _, port = value.removeprefix("tcp://").rpartition(":")
    if not value.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r} is not tcp://HOST:PORT")
    return value


def _positive(value: str) -> float:
    if not float(value) > 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of seconds")
    return float(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0: any free port")
    for side, http, engine, kvflow in (("prefill", 8100, "prefill-0", 5700), ("decode", 8200, "decode-0", 5800)):
        parser.add_argument(f"--{side}", type=_http_url, default=f"http://127.0.0.1:{http}", help="vLLM base URL")
        parser.add_argument(f"--{side}-engine", default=engine, help="its engine_id in --kv-transfer-config")
        parser.add_argument(
            f"--{side}-kvflow", type=_tcp_address, default=f"tcp://127.0.0.1:{kvflow}", help="its kvflow address"
        )
        parser.add_argument(
            f"--{side}-tp-size", type=int, default=0, help="its tensor parallelism (needed when P's and D's differ)"
        )
        parser.add_argument(f"--{side}-dp-rank", type=int, default=None, help="the data-parallel rank to address")
    parser.add_argument("--mode", choices=("push", "pull"), default="push", help="kvflow transfer mode")
    parser.add_argument("--timeout", type=_positive, default=600.0, help="seconds any one wait may take (default 600)")
    parser.add_argument("--max-body", type=int, default=64 << 20, help="largest request body in bytes")
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    config = RouterConfig(
        Backend(args.prefill, args.prefill_engine, args.prefill_kvflow, args.prefill_tp_size, args.prefill_dp_rank),
        Backend(args.decode, args.decode_engine, args.decode_kvflow, args.decode_tp_size, args.decode_dp_rank),
        Mode(args.mode),
        args.timeout,
    )
    app = make_app(config, args.max_body)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
        host, port = runner.addresses[0][:2]
        log.info("router listening on http://%s:%d (P %s, D %s, %s)", host, port, args.prefill, args.decode, args.mode)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
