"""Hostile ``kv_transfer_params``: what any HTTP client of vLLM's server may put in a request.

Why: vLLM hands a request's ``kv_transfer_params`` to the connector as the client wrote them,
and a router may pass them on.  Values like these once crashed an engine for good (an epoch of
2**64), tore down an association (an id of 1 MiB), stalled every peer (a host name), filled
the ZeroMQ context (made-up peers) or raised in the scheduler (params that are not a mapping).
`hostile_params` mutates a genuine set of params a few fields at a time, with those values and
random ones, so that the tests and ``kvflow soak --fuzz`` can feed them through the
connector and the router while a genuine transfer runs.  Deterministic for a given `random.Random`.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from typing import Any

__all__ = ("HOSTILE_VALUES", "hostile_params", "single_field_variants")

HOSTILE_VALUES: tuple[object, ...] = (
    2**64,
    2**63,
    2**63 - 1,
    -1,
    0,
    1.5,
    float("nan"),
    float("inf"),
    True,
    None,
    "",
    "x" * 246,
    "x" * 257,
    "x" * (1 << 20),
    "a\x00b",
    "\ud800",
    "push\n",
    [],
    {},
    [1] * 1000,
    {"a": {"b": {"c": {}}}},
    "tcp://example.com:5700",
    "tcp://127.0.0.1;10.0.0.1:5700",
    "tcp://8.8.8.8:5700",
    "tcp://127.0.0.1:99999",
    "tcp://127.0.0.1:9",
    "tcp://[::1]:9",
    "ipc:///dev/log",
    "inproc://x",
    "prefill",
    "decode",
    "rogue",
    "p" * 129,
    "../../etc",
    10**6,
    1025,
)
FIELDS: tuple[tuple[str, ...], ...] = (
    ("kvflow",),
    ("kvflow", "transfer_id"),
    ("kvflow", "epoch"),
    ("kvflow", "mode"),
    ("kvflow", "prefill"),
    ("kvflow", "prefill", "engine"),
    ("kvflow", "prefill", "address"),
    ("kvflow", "prefill", "tp_size"),
    ("kvflow", "decode"),
    ("kvflow", "decode", "engine"),
    ("kvflow", "decode", "address"),
    ("kvflow", "decode", "tp_size"),
    ("do_remote_prefill",),
    ("do_remote_decode",),
)
NOT_A_MAPPING: tuple[object, ...] = ("kvflow", 5, [], ["kvflow"], True, 2**64)


def _value(rng: random.Random) -> object:
    if rng.random() < 0.8:  # a copy: a later mutation must not change the table, or nest a value in itself
        return copy.deepcopy(rng.choice(HOSTILE_VALUES))
    kind = rng.randrange(3)
    if kind == 0:
        return rng.randrange(-(2**70), 2**70)
    if kind == 1:
        return "".join(chr(rng.randrange(0x110000)) for _ in range(rng.randrange(1, 40))).replace("\x00", "\x01")
    return rng.random() * 10 ** rng.randrange(-5, 25)


def _mutate(params: dict[str, Any], path: tuple[str, ...], rng: random.Random) -> None:
    here: Any = params
    for part in path[:-1]:
        if not isinstance(here, dict):
            return
        here = here.setdefault(part, {})
    if not isinstance(here, dict):
        return
    if rng.random() < 0.15:
        here.pop(path[-1], None)
    else:
        here[path[-1]] = _value(rng)


def hostile_params(genuine: Mapping[str, Any], rng: random.Random, *, mappings_only: bool = False) -> object:
    """A hostile variant of `genuine` (a request's ``kv_transfer_params``): now and then no
    mapping at all (not with `mappings_only`: vLLM's OpenAI server admits only a JSON object
    there, and vLLM's own scheduler raises on anything else), otherwise `genuine` with one to
    three fields replaced, dropped or added.  `genuine` itself is not changed."""
    if not mappings_only and rng.random() < 0.08:
        return copy.deepcopy(rng.choice(NOT_A_MAPPING))
    params = copy.deepcopy(dict(genuine))
    for _ in range(1 if rng.random() < 0.6 else rng.randrange(2, 4)):
        _mutate(params, rng.choice(FIELDS), rng)
    return params


def single_field_variants(genuine: Mapping[str, Any], fields: tuple[tuple[str, ...], ...] = FIELDS) -> list[object]:
    """Every variant of `genuine` with one of `fields` set to one of `HOSTILE_VALUES`: the
    values that broke engines before, each where it enters, the rest of the params genuine."""
    variants: list[object] = []
    for path in fields:
        for value in HOSTILE_VALUES:
            params = copy.deepcopy(dict(genuine))
            here: Any = params
            for part in path[:-1]:
                here = here.setdefault(part, {})
            here[path[-1]] = value
            variants.append(params)
    return variants
