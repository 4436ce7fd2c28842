"""The 1P1D router example (tools/kvflow_tools/routing/router.py) against stand-in OpenAI servers.

Everything runs as real processes over real HTTP on 127.0.0.1: two `tests.fake_openai_server`
processes stand in for P and D, and the router runs as its own script.  Concurrency is shown by
holding P's answer until D's request has arrived, never by timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from kvflow.integrations.vllm.params import TransferParams
from kvflow.protocol.state import Mode
from kvflow_tools.routing import legs, router
from tests.router_processes import ROOT, ROUTER_MODULE, WAIT, Process, start_fake, start_router, stop_clean

SCRIPTS = ROOT / "examples" / "vllm_1p1d"


@dataclass
class Stack:
    p: str
    d: str
    router: str


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    fakes: list[Process] = []
    try:
        p_proc, p_url = start_fake("P")
        fakes.append(p_proc)
        d_proc, d_url = start_fake("D")
        fakes.append(d_proc)
        router_proc, router_url = start_router(p_url, d_url)
        try:
            yield Stack(p_url, d_url, router_url)
        finally:
            stop_clean(router_proc)
    finally:
        for fake in fakes:
            stop_clean(fake)


@dataclass
class Live:
    stack: Stack
    http: aiohttp.ClientSession

    async def records(self, server: str) -> list[dict[str, Any]]:
        async with self.http.get(server + "/requests") as response:
            records: list[dict[str, Any]] = await response.json()
            return records

    async def wait_record(self, server: str, what: str, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The newest request recorded by `server` that passes `check`, polled for at most WAIT s."""
        try:
            async with asyncio.timeout(WAIT):
                while True:
                    matching = [r for r in await self.records(server) if check(r)]
                    if matching:
                        return matching[-1]
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError(f"{server}: no request {what}; saw {await self.records(server)}") from None

    async def wait_all_ended(self, server: str) -> list[str]:
        """The outcomes of every request `server` has seen, once none is still open."""
        try:
            async with asyncio.timeout(WAIT):
                while True:
                    outcomes = [r["outcome"] for r in await self.records(server)]
                    if None not in outcomes:
                        return outcomes
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError(f"{server}: requests still open: {await self.records(server)}") from None

    async def release(self, server: str) -> None:
        async with self.http.post(server + "/release") as response:
            assert response.status == 200


@pytest_asyncio.fixture
async def live(stack: Stack) -> AsyncIterator[Live]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as http:
        for server in (stack.p, stack.d):
            async with http.post(server + "/reset") as response:
                assert response.status == 200
        yield Live(stack, http)


def held(record: dict[str, Any]) -> bool:
    return bool(record["held"])


def cancelled(record: dict[str, Any]) -> bool:
    return bool(record["outcome"] == "cancelled")


def events(*texts: str) -> str:
    lines = [f"data: {json.dumps(sse_data(text))}\n\n" for text in texts]
    return "".join(lines) + "data: [DONE]\n\n"


def sse_data(text: str) -> dict[str, Any]:
    return {"id": "cmpl-fake", "object": "text_completion", "choices": [{"index": 0, "text": text}]}


def expected_params(transfer_id: str, mode: str = "push") -> dict[str, Any]:
    return {
        "transfer_id": transfer_id,
        "epoch": 1,
        "mode": mode,
        "prefill": {"engine": "prefill-0", "address": "tcp://127.0.0.1:5700"},
        "decode": {"engine": "decode-0", "address": "tcp://127.0.0.1:5800"},
    }


# ---------------------------------------------------------------- with processes


@pytest.mark.asyncio
async def test_health(live: Live) -> None:
    async with live.http.get(live.stack.router + "/health") as response:
        assert response.status == 200
        assert await response.json() == {"status": "ok"}


@pytest.mark.asyncio
async def test_decode_is_sent_while_prefill_runs_with_the_same_transfer(live: Live) -> None:
    stack = live.stack
    body = {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 50,
        "min_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "fake": {"P": {"hold": True}, "D": {"chunks": 4}},
    }
    call = asyncio.create_task(live.http.post(stack.router + "/v1/completions", json=body))
    try:
        await live.wait_record(stack.p, "held", held)
        d_request = await live.wait_record(stack.d, "at all", lambda r: True)
        (p_request,) = await live.records(stack.p)
        assert p_request["held"] and p_request["ended"] is None  # D's request came while P's was open
        await live.release(stack.p)
        async with asyncio.timeout(WAIT):
            async with await call as response:
                assert response.status == 200
                assert response.content_type == "text/event-stream"
                assert await response.text() == events("tok0", "tok1", "tok2", "tok3")
    finally:
        call.cancel()
    (p_request,) = await live.records(stack.p)
    assert d_request["arrived"] < p_request["ended"]

    params = d_request["body"]["kv_transfer_params"]["kvflow"]
    transfer_id = params["transfer_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", transfer_id)
    assert params == expected_params(transfer_id)
    request_id = p_request["headers"]["x-request-id"]
    assert d_request["headers"]["x-request-id"] == request_id and re.fullmatch(r"kvflow-[0-9a-f]{32}", request_id)
    assert transfer_id not in request_id  # a capability: never in a header vLLM logs

    prefill = dict(body, max_tokens=1, stream=False, min_tokens=1)  # P's token is not EOS where one engine's is not
    del prefill["stream_options"]
    prefill["kv_transfer_params"] = {"do_remote_decode": True, "kvflow": expected_params(transfer_id)}
    assert p_request["body"] == prefill
    decode = dict(body, kv_transfer_params={"do_remote_prefill": True, "kvflow": expected_params(transfer_id)})
    assert d_request["body"] == decode


@pytest.mark.asyncio
async def test_events_reach_the_client_as_decode_sends_them(live: Live) -> None:
    stack = live.stack
    body = {"prompt": "hi", "stream": True, "fake": {"D": {"chunks": 3, "hold_after": 1}}}
    async with asyncio.timeout(WAIT):
        async with live.http.post(stack.router + "/v1/completions", json=body) as response:
            assert response.status == 200
            first = await response.content.readuntil(b"\n\n")
            assert first.decode() == f"data: {json.dumps(sse_data('tok0'))}\n\n"
            await live.wait_record(stack.d, "holding its answer", held)  # the rest is not sent yet
            await live.release(stack.d)
            rest = (await response.read()).decode()
    assert first.decode() + rest == events("tok0", "tok1", "tok2")


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_whole_answer_passes_through(live: Live, path: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9, "max_tokens": 9}
    async with live.http.post(live.stack.router + path, json=body) as response:
        assert response.status == 200
        answer = await response.json()
    assert answer["choices"][0]["text"] == "D-answer"
    (p_request,) = await live.records(live.stack.p)
    (d_request,) = await live.records(live.stack.d)
    assert p_request["path"] == d_request["path"] == path
    assert p_request["body"]["max_completion_tokens"] == p_request["body"]["max_tokens"] == 1
    assert d_request["body"]["max_completion_tokens"] == d_request["body"]["max_tokens"] == 9


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("failing", "status", "stream"), [("prefill", 500, True), ("decode", 503, False)], ids=["prefill", "decode"]
)
async def test_a_failed_leg_cancels_the_other(live: Live, failing: str, status: int, stream: bool) -> None:
    stack = live.stack
    failed, other = (stack.p, stack.d) if failing == "prefill" else (stack.d, stack.p)
    fake: dict[str, dict[str, Any]] = {"P": {"hold": True}, "D": {"hold": True}}
    fake["P" if failing == "prefill" else "D"]["status"] = status
    body: dict[str, Any] = {"prompt": "x", "fake": fake}
    if stream:
        body["stream"] = True
    call = asyncio.create_task(live.http.post(stack.router + "/v1/completions", json=body))
    try:
        await live.wait_record(stack.p, "held", held)
        await live.wait_record(stack.d, "held", held)
        await live.release(failed)
        async with asyncio.timeout(WAIT):
            async with await call as response:
                assert response.status == 502
                error = (await response.json())["error"]
    finally:
        call.cancel()
    assert error["leg"] == failing
    assert f"{failing} leg failed" in error["message"] and f"HTTP {status}" in error["message"]
    await live.wait_record(other, "cancelled", cancelled)


@pytest.mark.asyncio
async def test_a_client_going_away_cancels_both_legs(live: Live) -> None:
    stack = live.stack
    body = {"prompt": "x", "stream": True, "fake": {"P": {"hold": True}, "D": {"hold": True}}}
    call = asyncio.create_task(live.http.post(stack.router + "/v1/completions", json=body))
    try:
        await live.wait_record(stack.p, "held", held)
        await live.wait_record(stack.d, "held", held)
    finally:
        call.cancel()  # closes the client's connection
        await asyncio.wait({call})
    await live.wait_record(stack.p, "cancelled", cancelled)
    await live.wait_record(stack.d, "cancelled", cancelled)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "a JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
)
async def test_bad_input_is_refused_and_not_dispatched(live: Live, data: bytes, message: str) -> None:
    url = live.stack.router + "/v1/completions"
    async with live.http.post(url, data=data, headers={"Content-Type": "application/json"}) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert message in error["message"]
    async with live.http.post(url, json={"prompt": "after"}) as response:  # the legs of this one only
        assert response.status == 200
    for server in (live.stack.p, live.stack.d):
        assert [r["body"]["prompt"] for r in await live.records(server)] == ["after"]


@pytest.mark.asyncio
async def test_a_prefill_answer_larger_than_the_router_holds_fails_the_leg(live: Live) -> None:
    body = {"prompt": "x", "fake": {"P": {"bloat": legs.MAX_PREFILL_ANSWER + 1000}}}
    async with live.http.post(live.stack.router + "/v1/completions", json=body) as response:
        assert response.status == 502
        error = (await response.json())["error"]
    assert error["leg"] == "prefill" and f"more than {legs.MAX_PREFILL_ANSWER} bytes" in error["message"]


@pytest.mark.asyncio
async def test_a_bare_500_from_d_is_answered_with_where_its_cause_is_named(live: Live) -> None:
    """vLLM answers a request that failed (a failed KV load: P died, the transfer timed out)
    with a bare "Internal server error", the cause in D's log only: the router's 502 says so,
    with the request id that log line carries."""
    body = {"prompt": "x", "fake": {"D": {"status": 500}}}
    async with live.http.post(live.stack.router + "/v1/completions", json=body) as response:
        assert response.status == 502
        error = (await response.json())["error"]
    assert error["leg"] == "decode" and "answered HTTP 500" in error["message"]
    (record,) = [r for r in await live.records(live.stack.d) if r["body"]["prompt"] == "x"]
    assert f"its log names the cause, under request id {record['headers']['x-request-id']}" in error["message"]


@pytest.mark.asyncio
async def test_prefill_without_an_answer_in_time(live: Live) -> None:
    stack = live.stack
    process, url = start_router(stack.p, stack.d, "--timeout", "1")
    try:
        body = {"prompt": "x", "fake": {"P": {"hold": True}, "D": {"hold": True}}}
        async with live.http.post(url + "/v1/completions", json=body) as response:
            assert response.status == 502
            error = (await response.json())["error"]
        assert error["leg"] == "prefill" and "within 1 s" in error["message"]
        # D's request was cancelled, or never reached D when the deadline came first
        assert set(await live.wait_all_ended(stack.d)) <= {"cancelled"}
    finally:
        stop_clean(process)


@pytest.mark.asyncio
async def test_prefill_unreachable(live: Live) -> None:
    with socket.socket() as probe:  # a port nothing listens on (closed again before use)
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    process, url = start_router(closed, live.stack.d)
    try:
        body = {"prompt": "x", "fake": {"D": {"hold": True}}}
        async with live.http.post(url + "/v1/completions", json=body) as response:
            # its health check found it unreachable at start-up: no prefill backend is left
            assert response.status == 503
            error = (await response.json())["error"]
        assert error["leg"] == "prefill" and "no healthy prefill backend" in error["message"]
        assert closed in error["message"]
        assert await live.records(live.stack.d) == []  # nothing was dispatched
    finally:
        stop_clean(process)


# ---------------------------------------------------------------- the pure parts


P_BACKEND = router.Backend("http://p:8100", "prefill-0", "tcp://127.0.0.1:5700")
D_BACKEND = router.Backend("http://d:8200", "decode-0", "tcp://127.0.0.1:5800")


def kvflow_params(transfer_id: str, mode: str = "push") -> dict[str, Any]:
    return legs.kvflow_params(Mode(mode), P_BACKEND, D_BACKEND, transfer_id)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_kvflow_params_are_what_the_connector_parses(mode: str) -> None:
    params = kvflow_params("abc", mode)
    assert params == expected_params("abc", mode)
    parsed = TransferParams.parse({"kvflow": params})
    assert parsed is not None and parsed.to_params() == params


def test_prefill_body_asks_one_token_without_streaming() -> None:
    body = {"prompt": "p", "max_tokens": 7, "min_tokens": 3, "stream": True, "stream_options": {}, "n": 1}
    params = kvflow_params("t")
    out = legs.prefill_body(body, params)
    assert out == {
        "prompt": "p",
        "max_tokens": 1,
        "min_tokens": 1,  # P may not end on EOS where one engine may not
        "stream": False,
        "n": 1,
        "kv_transfer_params": {"do_remote_decode": True, "kvflow": params},
    }
    assert body["max_tokens"] == 7 and "stream_options" in body  # the client's body is left alone
    assert "min_tokens" not in legs.prefill_body({"min_tokens": 0}, params)
    assert "max_completion_tokens" not in out
    assert legs.prefill_body({"max_completion_tokens": 5}, params)["max_completion_tokens"] == 1


def test_decode_body_is_the_client_body_with_params() -> None:
    params = kvflow_params("t")
    body = {"prompt": "p", "stream": True, "kv_transfer_params": {"other": 1}}
    assert legs.decode_body(body, params) == {
        "prompt": "p",
        "stream": True,
        "kv_transfer_params": {"do_remote_prefill": True, "kvflow": params},
    }


def test_leg_headers() -> None:
    assert legs.leg_headers("t", None) == {"X-Request-Id": "kvflow-t"}
    assert legs.leg_headers("t", "Bearer k") == {"X-Request-Id": "kvflow-t", "Authorization": "Bearer k"}


def test_command_line() -> None:
    args = router.parse_args([])
    assert (args.host, args.port, args.mode, args.timeout) == ("127.0.0.1", 8000, "push", 600.0)
    assert (args.prefill, args.prefill_engine, args.prefill_kvflow) == (
        ["http://127.0.0.1:8100"],
        ["prefill-0"],
        ["tcp://127.0.0.1:5700"],
    )
    assert (args.decode, args.decode_engine, args.decode_kvflow) == (
        ["http://127.0.0.1:8200"],
        ["decode-0"],
        ["tcp://127.0.0.1:5800"],
    )
    two = ["--prefill", "http://a:1", "--prefill", "http://b:2"]
    two += ["--prefill-engine", "pa", "--prefill-engine", "pb"]
    two += [
        "--prefill-kvflow",
        "tcp://10.0.0.1:5700",
        "--prefill-kvflow",
        "tcp://10.0.0.2:5700",
        "--mode",
        "sequential",
    ]
    built = router.config_from(router.parse_args(two))
    assert built.prefill == (
        router.Backend("http://a:1", "pa", "tcp://10.0.0.1:5700"),
        router.Backend("http://b:2", "pb", "tcp://10.0.0.2:5700"),
    )
    assert built.decode == (router.Backend("http://127.0.0.1:8200", "decode-0", "tcp://127.0.0.1:5800"),)
    assert built.sequential and built.mode is Mode.PULL
    for bad in (
        ["--prefill-kvflow", "127.0.0.1:5700"],
        ["--prefill-kvflow", "tcp://prefill.example:5700"],  # a name: resolved on ZeroMQ's I/O thread
        ["--decode", "localhost:8200"],
        ["--mode", "x"],
        ["--timeout", "0"],
        ["--health-timeout", "0"],
        ["--prefill", "http://a:1", "--prefill", "http://b:2"],  # engines and addresses missing
        ["--decode-engine", "d0", "--decode-engine", "d1"],  # more engines than URLs
    ):
        with pytest.raises(SystemExit):
            router.parse_args(bad)


# ---------------------------------------------------------------- the launch scripts


def run_script(tmp_path: Path, script: str, env: dict[str, str], *args: str) -> tuple[int, str, list[str]]:
    """Run a launch script with stand-ins for `vllm` and the router's Python that record their
    arguments; returns (exit status, stderr, the arguments the stand-in got)."""
    recorded = tmp_path / "args"
    for name in ("vllm", "python-stub"):
        stub = tmp_path / name
        stub.write_text(
            f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {recorded}\nenv | grep "^VLLM_" > {recorded}.env || true\n'
        )
        stub.chmod(0o755)
    clean = {key: value for key, value in os.environ.items() if not key.startswith("KVFLOW_SECRET")}
    full_env = clean | {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(tmp_path / "python-stub")}
    done = subprocess.run(
        ["bash", str(SCRIPTS / script), *args],
        env=full_env | env,
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=False,
    )
    got = recorded.read_text().splitlines() if recorded.exists() else []
    return done.returncode, done.stderr, got


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize(
    ("script", "role", "engine", "http", "kvflow"),
    [
        ("serve_prefill.sh", "kv_producer", "prefill-0", "8100", 5700),
        ("serve_decode.sh", "kv_consumer", "decode-0", "8200", 5800),
    ],
)
def test_serve_scripts(tmp_path: Path, script: str, role: str, engine: str, http: str, kvflow: int) -> None:
    status, stderr, args = run_script(tmp_path, script, {"KVFLOW_SECRET": "s" * 32}, "--tensor-parallel-size", "2")
    assert status == 0, stderr
    # vLLM's OpenAI server by module: `vllm serve` does not start the CPU build (no `vllm` distribution)
    assert args[:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "Qwen/Qwen2.5-0.5B-Instruct"]
    # what vLLM's CPU build needs (a GPU build ignores it)
    exported = dict(line.split("=", 1) for line in (tmp_path / "args.env").read_text().splitlines())
    assert exported["VLLM_CPU_KVCACHE_SPACE"] == "1" and exported["VLLM_HOST_IP"] == "127.0.0.1"
    assert option(args, "--port") == http and option(args, "--host") == "127.0.0.1"
    # D keeps vLLM's default prefix caching (it receives only the blocks after a local hit)
    assert ("--no-enable-prefix-caching" in args) == (role == "kv_producer") and "--block-size" not in args
    assert args[-2:] == ["--tensor-parallel-size", "2"]
    config = json.loads(option(args, "--kv-transfer-config"))
    expected = {
        "kv_connector": "KVFlowConnector",
        "kv_connector_module_path": "kvflow.integrations.vllm",
        "kv_role": role,
        "engine_id": engine,
        "kv_connector_extra_config": {"host": "127.0.0.1", "port": kvflow},
    }
    if role == "kv_consumer":
        expected["kv_load_failure_policy"] = "fail"
    assert config == expected

    env = {"KVFLOW_SECRET_FILE": "/dev/null", "KVFLOW_HOST": "10.0.0.2", "KVFLOW_PORT": "6000", "MODEL": "m"}
    status, stderr, args = run_script(tmp_path, script, env)
    assert status == 0, stderr
    assert option(args, "--model") == "m"
    assert json.loads(option(args, "--kv-transfer-config"))["kv_connector_extra_config"] == {
        "host": "10.0.0.2",
        "port": 6000,
    }
    status, stderr, args = run_script(tmp_path, script, env | {"ENGINE_CPUS": "0,3"})
    assert status == 0, stderr
    assert json.loads(option(args, "--kv-transfer-config"))["kv_connector_extra_config"]["engine_cpus"] == [0, 3]
    status, stderr, _ = run_script(tmp_path, script, env | {"ENGINE_CPUS": "0,x"})
    assert status == 2 and "ENGINE_CPUS must be CPU numbers" in stderr


@pytest.mark.parametrize("script", ["serve_prefill.sh", "serve_decode.sh"])
def test_serve_scripts_refuse_to_start_without_a_secret(tmp_path: Path, script: str) -> None:
    status, stderr, args = run_script(tmp_path, script, {})
    assert status != 0 and "KVFLOW_SECRET" in stderr and args == []
    status, stderr, args = run_script(tmp_path, script, {"KVFLOW_SECRET": "s" * 32, "KVFLOW_SECRET_FILE": "/x"})
    assert status != 0 and "not both" in stderr and args == []


def test_run_router_script(tmp_path: Path) -> None:
    status, stderr, args = run_script(tmp_path, "run_router.sh", {"MODE": "pull"}, "--max-body", "1024")
    assert status == 0, stderr
    assert args[:2] == ["-m", ROUTER_MODULE]
    parsed = router.parse_args(args[2:])
    assert (parsed.port, parsed.mode, parsed.max_body) == (8000, "pull", 1024)
    assert (parsed.prefill, parsed.decode) == (["http://127.0.0.1:8100"], ["http://127.0.0.1:8200"])
