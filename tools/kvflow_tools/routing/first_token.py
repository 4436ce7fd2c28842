"""The first token straight from prefill: P's answer goes to the client at once, D's stream after it.

Why: P has sampled the first token when its prefill ends.  Sent to the client then, the time to
the first token is P's prefill plus one hop, whatever the transfer and D's queue add.

Why the client still gets what one engine gives: D continues from P's token. Both legs ask
kvflow for it (``first_token`` in their kvflow entry): P's connector sends D its token and D's
sampler is held to it (`kvflow.integrations.vllm.first_token`). Where that cannot happen (a D
started without kvflow's logits processor, a token that did not come in time) D draws the first
token again itself, from the same prompt, the same KV and the same seed (a request without a
seed gets one from the router, the same on both legs). Either way the router holds D to it: the
text and the per-token entries (logprobs, token ids) of D's stream that P's answer already gave
are checked against it and dropped; a D that drew something else (logits that differ in their
last bit) ends the answer with `Diverged` rather than with a stream that contradicts itself.

What P's answer may give (`head`): nothing where P's connector says its token is not the
request's first (`FIRST_TOKEN_ANSWER`: a Mamba model's P prefills all but the prompt's last
token); otherwise one choice (n 1, no best_of, no echo, one prompt, no prompt logprobs, no
tools: `ineligible`), text without an unfinished character, less the characters
one engine holds back while a stop string may still match.  When P's first token ends the
answer (a stop token, a stop string, EOS, or one token asked for), P's answer is the whole
answer and D's request is cancelled.  Anything else gets D's stream alone, as without this mode.

Pure: dicts and bytes in, dicts and bytes out; the router (relay.py) does the I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvflow.integrations.vllm.params import FIRST_TOKEN_ANSWER
from kvflow_tools.errors import Diverged

__all__ = ("DecodeTail", "Head", "head", "ineligible", "with_seed")

MAX_PENDING_EVENT = 1 << 20  # bytes of one unfinished SSE event of D's the router holds while it checks
_PER_TOKEN = ("token_ids",)  # a choice's lists with one entry per token, besides its logprobs
_COMPLETION_LOGPROBS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def ineligible(body: Mapping[str, Any]) -> str | None:
    """Why P's answer cannot stand for the first token of this request (it then takes D's
    stream alone), or None."""
    if body.get("n") not in (None, 1):
        return "n > 1"
    if body.get("best_of") not in (None, 1):
        return "best_of > 1"
    if body.get("echo"):
        return "echo"
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if body.get("tools"):
        return "tools"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > 1:
        return "several prompts"
    return None


def with_seed(body: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """The request with `seed` unless it has its own: both legs then draw the same tokens."""
    out = dict(body)
    if out.get("seed") is None:
        out["seed"] = seed
    return out


def _held_back(body: Mapping[str, Any]) -> int:
    """How many characters one engine holds back from its stream while a stop string may still
    match (vLLM's detokenizer: the longest stop string's length less one)."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else [s for s in stop or () if isinstance(s, str)]
    if not stops or body.get("include_stop_str_in_output"):
        return 0
    return max(len(s) for s in stops) - 1


def _asked_for_one(body: Mapping[str, Any]) -> bool:
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return isinstance(limit, int) and limit == 1


@dataclass(frozen=True)
class Head:
    """What P's answer gives the client before D's stream: its SSE `events`, the `text` and the
    per-token `entries` (0 or 1) they carry, and whether they end the answer (`final`)."""

    events: bytes
    text: str
    entries: int
    final: bool
    token_id: int | None  # P's token, where the answer carries token ids
    logprob_token: str | None  # its logprobs' token string, where the answer carries logprobs


def _event(data: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _one(value: Any) -> Any:
    """The single entry of a per-token list of P's one token; None when there is none."""
    if isinstance(value, list) and len(value) == 1:
        return value[0]
    return None


def head(answer: Any, body: Mapping[str, Any], chat: bool) -> Head | None:
    """The first token's events from P's (non-streamed, one-token) `answer` to `body`, a
    streamed request; None when the answer cannot stand for the first token (the client then
    gets D's stream alone)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list) or len(answer["choices"]) != 1:
        return None
    params = answer.get("kv_transfer_params")
    if isinstance(params, dict) and params.get(FIRST_TOKEN_ANSWER) is False:
        return None  # P's connector says its token is not the request's first (Mamba state)
    choice = answer["choices"][0]
    if not isinstance(choice, dict):
        return None
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length"):
        return None
    final = finish == "stop" or _asked_for_one(body)
    if chat:
        message = choice.get("message")
        if not isinstance(message, dict) or any(v for k, v in message.items() if k not in ("role", "content")):
            return None  # a tool call or reasoning: only D's stream says how one engine streams it
        text = message.get("content") or ""
    else:
        text = choice.get("text")
    if not isinstance(text, str) or "\ufffd" in text:
        return None  # an unfinished character: one engine sends it with the next token
    hold = 0 if final else _held_back(body)
    sent = text[: len(text) - hold] if hold else text
    logprobs = choice.get("logprobs")
    token_id = _one(choice.get("token_ids"))
    logprob_token = _logprob_token(logprobs, chat)
    if (logprobs is not None and logprob_token is None) or (choice.get("token_ids") is not None and token_id is None):
        return None  # per-token entries of other than one token
    entries = 1 if logprobs is not None or token_id is not None else 0
    if not final and not sent and not entries:
        return None  # nothing to send early
    base = {key: answer.get(key) for key in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk" if chat else "text_completion"
    # a streamed answer's usage leaves out what is unset, as vLLM's does
    given = answer.get("usage")
    usage = {k: v for k, v in given.items() if v is not None} if isinstance(given, dict) else None
    continuous = usage if _continuous_usage(body) else None
    events = bytearray()
    if chat:
        role: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        first = base | {"choices": [role | {"finish_reason": None}]}
        if answer.get("prompt_token_ids") is not None:
            first["prompt_token_ids"] = answer["prompt_token_ids"]
        if continuous is not None:
            first["usage"] = continuous | {"completion_tokens": 0, "total_tokens": continuous.get("prompt_tokens")}
        events += _event(first)
        part: dict[str, Any] = {"index": 0, "delta": {"content": sent}, "logprobs": logprobs}
    else:
        part = {"index": 0, "text": sent, "logprobs": logprobs}
        if choice.get("prompt_token_ids") is not None:
            part["prompt_token_ids"] = choice["prompt_token_ids"]
    if choice.get("token_ids") is not None:
        part["token_ids"] = choice["token_ids"]
    part["finish_reason"] = finish if final else None
    part["stop_reason"] = choice.get("stop_reason") if final else None
    events += _event(base | {"choices": [part]} | ({"usage": continuous} if continuous is not None else {}))
    if final:
        if _include_usage(body) and usage is not None:
            events += _event(base | {"choices": [], "usage": usage})
        events += b"data: [DONE]\n\n"
    return Head(bytes(events), sent, entries, final, token_id, logprob_token)


def _stream_options(body: Mapping[str, Any]) -> Mapping[str, Any]:
    options = body.get("stream_options")
    return options if isinstance(options, dict) else {}


def _include_usage(body: Mapping[str, Any]) -> bool:
    return bool(_stream_options(body).get("include_usage"))


def _continuous_usage(body: Mapping[str, Any]) -> bool:
    options = _stream_options(body)
    return bool(options.get("include_usage")) and bool(options.get("continuous_usage_stats"))


def _logprob_token(logprobs: Any, chat: bool) -> str | None:
    """The token string of P's one token in its `logprobs` (a chat's or a completion's)."""
    if not isinstance(logprobs, dict):
        return None
    if chat:
        entry = _one(logprobs.get("content"))
        return entry.get("token") if isinstance(entry, dict) else None
    token = _one(logprobs.get("tokens"))
    return token if isinstance(token, str) else None


class DecodeTail:
    """D's SSE stream less what the head gave: `feed` D's bytes as they come and forward what it
    returns.  Until D's stream has passed P's token, each event is parsed, checked against the
    head and cut; after that, bytes pass untouched.

    :raises Diverged: from `feed`, when D's stream contradicts the head, is not the SSE it
        should be, or ends before it passed P's token.
    """

    def __init__(self, first: Head, chat: bool) -> None:
        self._text = first.text  # the head's text that D's stream has still to give
        self._entries = first.entries
        self._token_id = first.token_id
        self._logprob_token = first.logprob_token
        self._role = chat  # D's role delta: the head sent one
        self._chat = chat
        self._pending = bytearray()
        self.passed = False  # D's stream is past P's token: the rest is forwarded as it comes

    def feed(self, data: bytes) -> bytes:
        """What of `data` (D's next bytes) to send the client.  :raises Diverged."""
        if self.passed:
            return data
        self._pending += data
        out = bytearray()
        while (end := self._pending.find(b"\n\n")) >= 0:
            event = bytes(self._pending[: end + 2])
            del self._pending[: end + 2]
            out += self._cut(event)
            if self._past():
                break
        if not self._past() and len(self._pending) > MAX_PENDING_EVENT:
            raise Diverged(f"D's stream sent an event of more than {MAX_PENDING_EVENT} bytes")
        if self._past():
            out += self._pending
            self._pending.clear()
        return bytes(out)

    def _past(self) -> bool:
        return self.passed

    def _cut(self, event: bytes) -> bytes:
        line = event.strip()
        if not line.startswith(b"data:"):
            return event  # a comment, or an empty event
        payload = line[5:].strip()
        if payload == b"[DONE]":
            raise Diverged("D's stream ended before it gave the first token")
        try:
            data = json.loads(payload)
        except (ValueError, RecursionError):
            raise Diverged(f"D's stream sent an event that is not JSON: {payload[:200]!r}") from None
        if not isinstance(data, dict):
            raise Diverged(f"D's stream sent an event that is not a JSON object: {payload[:200]!r}")
        if "error" in data:
            self.passed = True  # D's error reaches the client as D sent it
            return event
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices:
            return event  # a usage event
        choice = choices[0]
        if not isinstance(choice, dict) or len(choices) != 1:
            raise Diverged("D's stream sent an event with other than one choice")
        data.pop("prompt_token_ids", None)  # the head sent them
        choice.pop("prompt_token_ids", None)
        self._cut_text(choice)
        self._cut_entries(choice)
        self.passed = not self._text and not self._entries and not self._role
        if self._empty(choice) and data.get("usage") is None:
            return b""
        return _event(data)

    def _cut_text(self, choice: dict[str, Any]) -> None:
        if self._chat:
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                return
            if self._role:
                delta.pop("role", None)
                self._role = False
            holder, key = delta, "content"
        else:
            holder, key = choice, "text"
        text = holder.get(key)
        if not isinstance(text, str) or not self._text:
            return
        n = min(len(text), len(self._text))
        if text[:n] != self._text[:n]:
            raise Diverged(f"D's text begins {text[:n]!r} where the first token sent {self._text[:n]!r}")
        holder[key] = text[n:]
        self._text = self._text[n:]

    def _cut_entries(self, choice: dict[str, Any]) -> None:
        if not self._entries:
            return
        cut = 0
        ids = choice.get("token_ids")
        if isinstance(ids, list) and ids:
            if self._token_id is not None and ids[0] != self._token_id:
                raise Diverged(f"D's first token is id {ids[0]} where the first token sent was id {self._token_id}")
            choice["token_ids"] = ids[1:]
            cut = 1
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            lists = ("content",) if self._chat else _COMPLETION_LOGPROBS
            for name in lists:
                values = logprobs.get(name)
                if isinstance(values, list) and values:
                    self._check_logprob_token(values[0], name)
                    logprobs[name] = values[1:]
                    cut = 1
        self._entries -= cut

    def _check_logprob_token(self, first: Any, name: str) -> None:
        if name == "content" and isinstance(first, dict):
            token = first.get("token")
        elif name == "tokens":
            token = first
        else:
            return
        if self._logprob_token is not None and token != self._logprob_token:
            raise Diverged(f"D's first token is {token!r} where the first token sent was {self._logprob_token!r}")

    def _empty(self, choice: dict[str, Any]) -> bool:
        """Nothing left in the choice for the client: no text, no per-token entry, no finish."""
        if choice.get("finish_reason") is not None:
            return False
        if self._chat:
            delta = choice.get("delta")
            if isinstance(delta, dict) and any(v for v in delta.values()):
                return False
        elif choice.get("text"):
            return False
        for name in _PER_TOKEN:
            if choice.get(name):
                return False
        logprobs = choice.get("logprobs")
        return not (isinstance(logprobs, dict) and any(v for v in logprobs.values()))
