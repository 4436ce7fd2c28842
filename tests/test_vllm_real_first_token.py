"""The first token from P's answer between real vLLM OpenAI servers: what one engine gives.

A 1P1D kvflow deployment of vLLM's CPU build whose router runs with ``--first-token prefill``,
and one plain engine without a connector as the reference.  Each request goes to both; the
client's stream through the router must say what the reference says: greedy and seeded tokens,
usage, the first token's logprobs, stop strings and stop tokens that end the answer on its first
token (D's request then cancelled and D left idle), unstreamed answers; n > 1 is refused (a
transfer fills one request on D).  The tiny model's tokenizer spells token id N as the word
``<N>``, so the text names the tokens.

That the first token came from P is read from the router's log ("first token from P" per
answer, "answered by P alone" where P's token ended it); its timing is `kvflow bench serve`'s.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from kvflow_tools.serve.launcher import Deployment, ServeOptions
from tests.test_first_token import datas, text_of
from tests.vllm_real import BLOCK, MODEL, idle, post, prompts, running, settles

pytestmark = [pytest.mark.timeout(900), pytest.mark.real_engine]
SETTLE = 60.0


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    options = ServeOptions(
        prefill=1,
        decode=1,
        reference=True,
        port=0,
        block_size=BLOCK,
        max_model_len=2048,
        first_token=True,
        run_dir=tmp_path_factory.mktemp("real-first-token"),
    )
    yield from running(options)


def stream(url: str, body: Mapping[str, Any], timeout: float = 120.0) -> list[Any]:
    """The data of each event of a streamed answer."""
    request = urllib.request.Request(
        url, json.dumps(dict(body) | {"stream": True}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        assert answer.status == 200 and answer.headers.get_content_type() == "text/event-stream"
        return datas(answer.read())


def both(pd: Deployment, body: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
    """`body` streamed through the router and by the reference engine."""
    path = "/v1/completions"
    return stream(pd.router_url + path, body), stream(pd.server("reference").url + path, body)


def request(salt: int, length: int = 100, **more: Any) -> dict[str, Any]:
    (prompt,) = prompts(salt, [length])
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0} | more


def choice_events(events: list[Any]) -> list[dict[str, Any]]:
    return [e["choices"][0] for e in events if isinstance(e, dict) and e.get("choices")]


def router_log(pd: Deployment) -> str:
    return "".join(path.read_text(errors="replace") for path in pd.run_dir.glob("router-*.log"))


def test_greedy_streamed_tokens_and_usage_are_one_engines_and_the_first_token_came_from_p(pd: Deployment) -> None:
    before = router_log(pd).count("first token from P")
    for seed in range(3):
        body = request(seed, 60 + 70 * seed, stream_options={"include_usage": True}, return_token_ids=True)
        ours, reference = both(pd, body)
        assert "error" not in json.dumps(ours)
        assert text_of(ours) == text_of(reference) and len(text_of(ours).split()) == 8
        ids = [t for c in choice_events(ours) for t in c.get("token_ids") or ()]
        assert ids == [t for c in choice_events(reference) for t in c.get("token_ids") or ()]
        assert ours[-2]["usage"] == reference[-2]["usage"] and ours[-1] == "[DONE]"
        assert choice_events(ours)[0]["prompt_token_ids"] == body["prompt"]
    assert router_log(pd).count("first token from P") == before + 3


def test_seeded_sampling_is_one_engines(pd: Deployment) -> None:
    body = request(10, temperature=1.0, top_p=0.9, seed=1234)
    ours, reference = both(pd, body)
    assert text_of(ours) == text_of(reference) and len(text_of(ours).split()) == 8


def test_unseeded_sampling_draws_on_d_the_first_token_p_sent(pd: Deployment) -> None:
    """The router seeds both legs alike: without that, D draws its own first token and the
    router ends the answer with an error (a vocabulary of 1,024 at temperature 2).  Tokens are
    counted by id: a drawn token may decode to no word of its own."""
    for seed in range(3):
        body = request(20 + seed, temperature=2.0, stream_options={"include_usage": True}, return_token_ids=True)
        ours = stream(pd.router_url + "/v1/completions", body)
        assert "error" not in json.dumps(ours), ours
        ids = [t for c in choice_events(ours) for t in c.get("token_ids") or ()]
        assert len(ids) == 8 and ours[-2]["usage"]["completion_tokens"] == 8, ours
        assert choice_events(ours)[-1]["finish_reason"] == "length"


def test_the_first_tokens_logprobs_are_one_engines(pd: Deployment) -> None:
    ours, reference = both(pd, request(30, logprobs=3))
    got = [c["logprobs"] for c in choice_events(ours) if c.get("logprobs")]
    want = [c["logprobs"] for c in choice_events(reference) if c.get("logprobs")]
    assert [t for lp in got for t in lp["tokens"]] == [t for lp in want for t in lp["tokens"]]
    first, reference_first = got[0], want[0]
    assert first["token_logprobs"][0] == pytest.approx(reference_first["token_logprobs"][0], abs=1e-4)
    assert first["top_logprobs"][0].keys() == reference_first["top_logprobs"][0].keys()


def first_word(pd: Deployment, body: Mapping[str, Any]) -> str:
    (word, *_) = text_of(stream(pd.server("reference").url + "/v1/completions", body)).split()
    return word


@pytest.mark.parametrize("how", ["stop string", "stop token"])
def test_a_first_token_that_ends_the_answer_is_ps_and_d_is_left_idle(pd: Deployment, how: str) -> None:
    body = request(40 if how == "stop string" else 41, stream_options={"include_usage": True})
    word = first_word(pd, body)
    if how == "stop string":
        body["stop"] = [word]
    else:
        body["stop_token_ids"] = [int(word.strip("<>"))]
    before = router_log(pd).count("answered by P alone")
    ours, reference = both(pd, body)
    assert text_of(ours) == text_of(reference)
    assert choice_events(ours)[-1]["finish_reason"] == choice_events(reference)[-1]["finish_reason"] == "stop"
    assert choice_events(ours)[-1]["stop_reason"] == choice_events(reference)[-1]["stop_reason"]
    assert ours[-2]["usage"] == reference[-2]["usage"]
    assert router_log(pd).count("answered by P alone") == before + 1
    assert settles(lambda: idle(pd.server("decode-0")), SETTLE)  # D's cancelled request freed its blocks


def test_n_above_one_is_refused_before_p_or_d_does_any_work(pd: Deployment) -> None:
    """A transfer fills one request's blocks, and vLLM makes each sample a request of its own
    on D: before the refusal, the second sample failed on D (a KV load failure, HTTP 500)."""
    answer = post(pd.router_url + "/v1/completions", request(50, n=2, temperature=1.0, seed=7))
    assert answer.status == 400 and "one request per sample" in answer.body["error"]["message"]


@pytest.mark.parametrize("max_tokens", [1, 8])
def test_unstreamed_answers_are_one_engines(pd: Deployment, max_tokens: int) -> None:
    body = request(60 + max_tokens, max_tokens=max_tokens)
    ours, reference = (post(url + "/v1/completions", body) for url in (pd.router_url, pd.server("reference").url))
    assert ours.status == reference.status == 200
    assert ours.body["choices"][0]["text"] == reference.body["choices"][0]["text"]
    assert ours.body["usage"] == reference.body["usage"]
    assert ours.body.get("kv_transfer_params") == reference.body.get("kv_transfer_params")
    assert settles(lambda: idle(pd.server("decode-0")), SETTLE)
