"""The first token from P's answer (tools/kvflow_tools/routing/first_token.py): what P's answer may
say to the client, and D's stream checked against it and cut.

Pure tests here; the router sending it through real processes is in
tests/test_router_first_token.py, and real vLLM servers in tests/real_first_token.py (run by
tests/test_vllm_real_pd.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow_tools.errors import Diverged
from kvflow_tools.routing.first_token import DecodeTail, Head, head, ineligible, with_seed

BASE = {"id": "cmpl-kvflow-1", "created": 1, "model": "m"}


def p_answer(text: str, finish: str = "length", **choice: Any) -> dict[str, Any]:
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    entry = {"index": 0, "text": text, "finish_reason": finish, "stop_reason": None, **choice}
    return BASE | {"object": "text_completion", "choices": [entry], "usage": usage}


def chat_answer(content: str, finish: str = "length", **message: Any) -> dict[str, Any]:
    entry = {"index": 0, "message": {"role": "assistant", "content": content, **message}, "finish_reason": finish}
    return BASE | {"object": "chat.completion", "choices": [entry], "usage": {"prompt_tokens": 5}}


def sse(*datas: Any) -> bytes:
    return b"".join(b"data: " + json.dumps(d).encode() + b"\n\n" for d in datas) + b"data: [DONE]\n\n"


def chunk(text: str, finish: str | None = None, **more: Any) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": finish, **more}
    return BASE | {"object": "text_completion", "choices": [choice]}


def delta(finish: str | None = None, **fields: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": fields, "finish_reason": finish}
    return BASE | {"object": "chat.completion.chunk", "choices": [choice]}


def datas(stream: bytes) -> list[Any]:
    """The data of each event of an SSE stream ("[DONE]" as the string)."""
    out = []
    for event in stream.split(b"\n\n"):
        if event.startswith(b"data: "):
            payload = event[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def text_of(events: list[Any], chat: bool = False) -> str:
    parts = []
    for data in events:
        if isinstance(data, dict) and data.get("choices"):
            choice = data["choices"][0]
            parts.append((choice["delta"].get("content") or "") if chat else choice["text"])
    return "".join(parts)


def streamed(first: Head, d_stream: bytes, chat: bool = False) -> list[Any]:
    tail = DecodeTail(first, chat)
    return datas(first.events + tail.feed(d_stream))


# ---------------------------------------------------------------- which requests


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"n": 2}, "n > 1"),
        ({"best_of": 3}, "best_of > 1"),
        ({"echo": True}, "echo"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"prompt": ["a", "b"]}, "several prompts"),
        ({"prompt": [[1, 2], [3]]}, "several prompts"),
        ({"prompt": [1, 2, 3], "n": 1}, None),
        ({"prompt": ["a"]}, None),
        ({"messages": [], "tools": []}, None),
    ],
)
def test_which_requests_p_can_answer_first(body: dict[str, Any], why: str | None) -> None:
    assert ineligible(body) == why


def test_a_seed_is_added_only_where_the_client_gave_none() -> None:
    assert with_seed({"prompt": "p"}, 7) == {"prompt": "p", "seed": 7}
    assert with_seed({"seed": 3}, 7) == {"seed": 3}
    assert with_seed({"seed": None}, 7) == {"seed": 7}


# ---------------------------------------------------------------- what P's answer says


def test_a_completions_first_token_then_ds_stream_less_it() -> None:
    first = head(p_answer(" Hello"), {"stream": True}, chat=False)
    assert first is not None and not first.final and first.text == " Hello"
    got = streamed(first, sse(chunk(" Hello"), chunk(" world"), chunk("!", "length")))
    assert [d["choices"][0]["text"] for d in got[:-1]] == [" Hello", " world", "!"]
    assert got[0]["choices"][0]["finish_reason"] is None and got[-2]["choices"][0]["finish_reason"] == "length"
    assert got[-1] == "[DONE]"


def test_a_chat_first_token_sends_the_role_then_the_content_and_d_s_role_is_dropped() -> None:
    first = head(chat_answer("Hi"), {"stream": True}, chat=True)
    assert first is not None
    d = sse(delta(role="assistant", content=""), delta(content="Hi"), delta(content=" there"), delta("stop"))
    got = streamed(first, d, chat=True)
    deltas = [g["choices"][0]["delta"] for g in got if isinstance(g, dict)]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hi"}, {"content": " there"}, {}]
    assert got[-2]["choices"][0]["finish_reason"] == "stop"


def test_stop_strings_hold_back_what_one_engine_holds_back() -> None:
    body = {"stream": True, "stop": ["xyz", "ab"]}
    first = head(p_answer("12ab"), body, chat=False)
    assert first is not None and first.text == "12"  # the longest stop less one: 2 characters held
    # D, as one engine, finds the stop string "ab" spanning its first and second tokens
    got = streamed(first, sse(chunk("12"), chunk("", "stop")))
    assert text_of(got) == "12" and got[-2]["choices"][0]["finish_reason"] == "stop"
    assert head(p_answer("12ab"), body | {"include_stop_str_in_output": True}, chat=False).text == "12ab"  # type: ignore[union-attr]
    assert head(p_answer("12ab"), {"stream": True, "stop": "a"}, chat=False).text == "12ab"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("finish", "body"), [("stop", {}), ("length", {"max_tokens": 1}), ("length", {"max_completion_tokens": 1})]
)
def test_a_first_token_that_ends_the_answer_is_the_whole_answer(finish: str, body: dict[str, Any]) -> None:
    body = body | {"stream": True, "stream_options": {"include_usage": True}, "stop": ["abc"]}
    first = head(p_answer("Hab", finish, stop_reason=7 if finish == "stop" else None), body, chat=False)
    assert first is not None and first.final
    got = datas(first.events)
    assert got[0]["choices"][0] | {} == {
        "index": 0,
        "text": "Hab",  # nothing held back: P has finished
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": 7 if finish == "stop" else None,
    }
    assert got[1]["choices"] == [] and got[1]["usage"]["completion_tokens"] == 1
    assert got[2] == "[DONE]"


@pytest.mark.parametrize(
    "answer",
    [
        p_answer("\ufffd"),  # half a character
        p_answer("x", "abort"),
        chat_answer("", tool_calls=[{"id": "t"}]),
        chat_answer("", reasoning_content="hm"),
        p_answer("", logprobs=None),  # nothing to send before D
        p_answer("a", token_ids=[1, 2]),
        {"choices": []},
        {"choices": [p_answer("a")["choices"][0], p_answer("b")["choices"][0]]},
        "not a dict",
        p_answer("a") | {"kv_transfer_params": {"kvflow_first_token": False}},  # P's connector: not the first
    ],
)
def test_answers_that_cannot_stand_for_the_first_token(answer: Any) -> None:
    chat = isinstance(answer, dict) and "message" in str(answer)
    assert head(answer, {"stream": True}, chat=chat) is None


@pytest.mark.parametrize("params", [None, {}, {"kvflow_prefill_finished": True}, {"kvflow_first_token": True}])
def test_an_answer_whose_connector_does_not_deny_it_stands_for_the_first_token(params: Any) -> None:
    assert head(p_answer("a") | {"kv_transfer_params": params}, {"stream": True}, chat=False) is not None


def test_logprobs_and_token_ids_of_the_first_token_come_from_p_and_ds_are_cut() -> None:
    logprobs = {"tokens": ["A"], "token_logprobs": [-0.5], "top_logprobs": [{"A": -0.5}], "text_offset": [0]}
    first = head(p_answer("A", logprobs=logprobs, token_ids=[11]), {"stream": True}, chat=False)
    assert first is not None and first.entries == 1
    merged = {"tokens": ["A", "B"], "token_logprobs": [-0.4, -1.0], "top_logprobs": [{}, {}], "text_offset": [0, 1]}
    # D's first two tokens in one event, as vLLM's output collector merges them when the API server lags
    got = streamed(first, sse(chunk("AB", logprobs=merged, token_ids=[11, 12]), chunk("C", token_ids=[13])))
    assert got[0]["choices"][0]["logprobs"] == logprobs and got[0]["choices"][0]["token_ids"] == [11]
    cut = got[1]["choices"][0]
    assert cut["text"] == "B" and cut["token_ids"] == [12]
    assert cut["logprobs"] == {"tokens": ["B"], "token_logprobs": [-1.0], "top_logprobs": [{}], "text_offset": [1]}
    assert got[2]["choices"][0]["token_ids"] == [13]


def test_continuous_usage_is_ps_on_the_first_token() -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    body = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    first = head(chat_answer("x") | {"usage": usage}, body, chat=True)
    assert first is not None
    role, content = datas(first.events)
    assert role["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    assert content["usage"] == usage


# ---------------------------------------------------------------- D held to it


@pytest.mark.parametrize(
    ("stream", "why"),
    [
        (sse(chunk("Hullo")), "text begins"),
        (sse(chunk("H", token_ids=[99])), "id 99"),
        (sse(), "ended before"),
        (b"data: {not json\n\n", "not JSON"),
        (b"data: [1]\n\n", "not a JSON object"),
    ],
)
def test_a_d_stream_that_contradicts_the_first_token_is_refused(stream: bytes, why: str) -> None:
    first = head(p_answer("Hello", token_ids=[7]), {"stream": True}, chat=False)
    assert first is not None
    with pytest.raises(Diverged, match=why):
        DecodeTail(first, chat=False).feed(stream)


def test_a_d_error_passes_to_the_client_as_d_sent_it() -> None:
    first = head(p_answer("Hello"), {"stream": True}, chat=False)
    assert first is not None
    error = b'data: {"error": {"message": "boom"}}\n\n'
    tail = DecodeTail(first, chat=False)
    assert tail.feed(error + b"data: [DONE]\n\n") == error + b"data: [DONE]\n\n" and tail.passed


def test_an_endless_event_is_refused() -> None:
    first = head(p_answer("Hello"), {"stream": True}, chat=False)
    assert first is not None
    with pytest.raises(Diverged, match="more than"):
        DecodeTail(first, chat=False).feed(b"data: " + b"x" * (1 << 21))


@given(st.lists(st.integers(min_value=0, max_value=400), max_size=12), st.booleans())
def test_however_d_s_bytes_are_split_the_client_gets_the_same_stream(cuts: list[int], chat: bool) -> None:
    if chat:
        first = head(chat_answer("Hel"), {"stream": True, "stop": ["lo!"]}, chat=True)
        d = sse(delta(role="assistant", content=""), delta(content=""), delta(content="Hel"), delta(content="lo"))
    else:
        first = head(p_answer("Hel"), {"stream": True, "stop": ["lo!"]}, chat=False)
        d = sse(chunk(""), chunk("Hel"), chunk("lo"), chunk(" w", "length"))
    assert first is not None and first.text == "H"
    whole = DecodeTail(first, chat).feed(d)
    tail = DecodeTail(first, chat)
    pieces, at = [], 0
    for cut in sorted({min(c, len(d)) for c in cuts}):
        pieces.append(tail.feed(d[at:cut]))
        at = cut
    pieces.append(tail.feed(d[at:]))
    assert b"".join(pieces) == whole
    events = datas(first.events + whole)
    assert text_of(events, chat) == text_of(datas(d), chat)  # the client reads D's text, once
