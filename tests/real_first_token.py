"""The first token from P's answer between real vLLM OpenAI servers: what one engine gives.

The scenarios `tests/test_vllm_real_pd.py` runs on its deployment (two P, one D and a plain
engine without a connector as the reference) through a router of route ``push+first``, which
runs with ``--first-token prefill``.  Each request goes to the router and to the reference; the
client's stream through the router must say what the reference says: greedy and seeded tokens,
usage, the first token's logprobs, stop strings and stop tokens that end the answer on its first
token (D's request then cancelled and D left idle), unstreamed answers, a chat streamed and not;
n > 1 is refused (a transfer fills one request on D).  The tiny model's tokenizer spells token id N as the word
``<N>``, so the text names the tokens.  Prompts are drawn from salts 100 and up, which the other
tests of that deployment leave alone (D's prefix cache holds what they sent).

That the first token came from P is read from the router's log ("first token from P" per
answer, "answered by P alone" where P's token ended it); its timing is `kvflow bench serve`'s.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import urllib.request
import uuid
from collections.abc import Mapping
from typing import Any

import pytest

from kvflow.integrations.vllm.params import PeerRef, TransferParams
from kvflow.protocol.state import Mode
from kvflow_tools.routing.legs import decode_body, prefill_body
from kvflow_tools.serve.launcher import Deployment
from tests.test_first_token import datas, text_of
from tests.vllm_real import MODEL, Answer, idle, post, prompts, settles

ROUTE = "push+first"
SALT = 100  # the first salt of these prompts
SETTLE = 60.0


def stream(url: str, body: Mapping[str, Any], timeout: float = 120.0) -> list[Any]:
    """The data of each event of a streamed answer."""
    request = urllib.request.Request(
        url, json.dumps(dict(body) | {"stream": True}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        assert answer.status == 200 and answer.headers.get_content_type() == "text/event-stream"
        return datas(answer.read())


def router(pd: Deployment) -> str:
    """The URL of the deployment's router that sends the first token from P (started once)."""
    return pd.add_router(ROUTE)


def both(pd: Deployment, body: Mapping[str, Any], path: str = "/v1/completions") -> tuple[list[Any], list[Any]]:
    """`body` streamed to `path` through the router and by the reference engine."""
    return stream(router(pd) + path, body), stream(pd.server("reference").url + path, body)


def both_whole(pd: Deployment, body: Mapping[str, Any], path: str = "/v1/completions") -> tuple[Answer, Answer]:
    """`body` sent unstreamed to `path` through the router and to the reference engine."""
    return post(router(pd) + path, body), post(pd.server("reference").url + path, body)


def request(salt: int, length: int = 100, **more: Any) -> dict[str, Any]:
    (prompt,) = prompts(SALT + salt, [length])
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0} | more


def choice_events(events: list[Any]) -> list[dict[str, Any]]:
    return [e["choices"][0] for e in events if isinstance(e, dict) and e.get("choices")]


def router_log(pd: Deployment) -> str:
    return "".join(path.read_text(errors="replace") for path in pd.run_dir.glob("router-*.log"))


def greedy_streamed(pd: Deployment) -> None:
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


def seeded_sampling(pd: Deployment) -> None:
    body = request(10, temperature=1.0, top_p=0.9, seed=1234)
    ours, reference = both(pd, body)
    assert text_of(ours) == text_of(reference) and len(text_of(ours).split()) == 8


def unseeded_sampling(pd: Deployment) -> None:
    """The router seeds both legs alike: without that, D draws its own first token and the
    router ends the answer with an error (a vocabulary of 1,024 at temperature 2).  Tokens are
    counted by id: a drawn token may decode to no word of its own.  EOS is ignored: at temperature
    2 it is drawn now and then (seen once: the answer ended after 4 tokens)."""
    for seed in range(3):
        more: dict[str, Any] = {"stream_options": {"include_usage": True}, "return_token_ids": True, "ignore_eos": True}
        body = request(20 + seed, temperature=2.0, **more)
        ours = stream(router(pd) + "/v1/completions", body)
        assert "error" not in json.dumps(ours), ours
        ids = [t for c in choice_events(ours) for t in c.get("token_ids") or ()]
        assert len(ids) == 8 and ours[-2]["usage"]["completion_tokens"] == 8, ours
        assert choice_events(ours)[-1]["finish_reason"] == "length"


def d_continues_from_ps_token(pd: Deployment) -> None:
    """D's sampler is held to the token P sent (``first_token`` in the kvflow entry), not to
    its own draw: the legs sent to P and D straight, as the router sends them, but with two
    seeds at temperature 2, so that D drawing for itself would draw another first token (a
    vocabulary of 1,024).  D's first token is P's every time, and its answer has all 8 tokens."""
    prefill, decode = pd.server("prefill-0"), pd.server("decode-0")
    for salt in range(3):
        params = TransferParams(
            uuid.uuid4().hex, 1, Mode.PUSH, PeerRef(prefill.name, prefill.kvflow), PeerRef(decode.name, decode.kvflow)
        )
        entry = dataclasses.replace(params, first_token=True).to_params()
        body = request(60 + salt, temperature=2.0, return_token_ids=True, ignore_eos=True)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            on_d = pool.submit(post, decode.url + "/v1/completions", decode_body(body | {"seed": 2 + salt}, entry))
            on_p = pool.submit(post, prefill.url + "/v1/completions", prefill_body(body | {"seed": 1}, entry))
            p_tokens, d_tokens = on_p.result().tokens, on_d.result().tokens
        assert len(p_tokens) == 1 and len(d_tokens) == 8, (p_tokens, d_tokens)
        assert d_tokens[0] == p_tokens[0], (p_tokens, d_tokens)


def first_logprobs(pd: Deployment) -> None:
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


def ended_by_the_first_token(pd: Deployment, how: str) -> None:
    """`how`: "stop string" or "stop token"."""
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


def several_samples_refused(pd: Deployment) -> None:
    """A transfer fills one request's blocks, and vLLM makes each sample a request of its own
    on D: before the refusal, the second sample failed on D (a KV load failure, HTTP 500)."""
    answer = post(router(pd) + "/v1/completions", request(50, n=2, temperature=1.0, seed=7))
    assert answer.status == 400 and "one request per sample" in answer.body["error"]["message"]


def unstreamed(pd: Deployment, max_tokens: int) -> None:
    body = request(60 + max_tokens, max_tokens=max_tokens)
    ours, reference = both_whole(pd, body)
    assert ours.status == reference.status == 200
    assert ours.body["choices"][0]["text"] == reference.body["choices"][0]["text"]
    assert ours.body["usage"] == reference.body["usage"]
    assert ours.body.get("kv_transfer_params") == reference.body.get("kv_transfer_params")
    assert settles(lambda: idle(pd.server("decode-0")), SETTLE)


def chat(pd: Deployment) -> None:
    """A chat (the tiny model's template joins the contents), streamed and not: what the client
    reads through the router is the reference's, and the streamed one's first token came from P."""
    (prompt,) = prompts(SALT + 70, [100])
    words = " ".join(f"<{token}>" for token in prompt)
    body = {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 8, "temperature": 0}
    path = "/v1/chat/completions"
    before = router_log(pd).count("first token from P")
    streamed = body | {"stream_options": {"include_usage": True}}
    ours, reference = both(pd, streamed, path)
    assert "error" not in json.dumps(ours), ours

    def deltas(events: list[Any], key: str) -> list[Any]:
        return [c["delta"][key] for c in choice_events(events) if c["delta"].get(key) is not None]

    assert "".join(deltas(ours, "content")) == "".join(deltas(reference, "content"))
    assert len("".join(deltas(ours, "content")).split()) == 8
    assert deltas(ours, "role") == deltas(reference, "role") == ["assistant"]
    assert choice_events(ours)[-1]["finish_reason"] == choice_events(reference)[-1]["finish_reason"] == "length"
    assert ours[-2]["usage"] == reference[-2]["usage"] and ours[-1] == "[DONE]"
    assert router_log(pd).count("first token from P") == before + 1
    ours_whole, reference_whole = both_whole(pd, body, path)
    assert ours_whole.status == reference_whole.status == 200
    assert ours_whole.body["choices"][0]["message"] == reference_whole.body["choices"][0]["message"]
    assert ours_whole.body["usage"] == reference_whole.body["usage"]
