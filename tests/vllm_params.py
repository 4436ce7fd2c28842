"""Well-formed and broken ``kv_transfer_params`` for the scheduler-side tests of the vLLM connector.

Helpers, no tests: `entry` builds a ``kvflow`` entry with fields replaced or removed, the rest
wraps it as D's or P's params and parses it."""

from __future__ import annotations

from typing import Any

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.params import TransferParams

BLOCK_SIZE = 4
MISSING: Any = object()  # an `entry` field given this is left out


def entry(transfer_id: Any = "t1", **fields: Any) -> dict[str, Any]:
    """A well-formed ``kvflow`` entry, with `fields` replacing (or, given `MISSING`, removing) keys."""
    base: dict[str, Any] = {
        "transfer_id": transfer_id,
        "epoch": 3,
        "mode": "push",
        "prefill": {"engine": "prefill", "address": "tcp://10.0.0.1:5700"},
        "decode": {"engine": "decode", "address": "tcp://10.0.0.2:5800"},
    }
    for key, value in fields.items():
        if value is MISSING:
            base.pop(key, None)
        else:
            base[key] = value
    return base


def d_params(kv: Any) -> dict[str, Any]:
    return {"do_remote_prefill": True, "kvflow": kv}


def p_params(kv: Any) -> dict[str, Any]:
    return {"do_remote_decode": True, "kvflow": kv}


def must_parse(params: dict[str, Any]) -> TransferParams:
    result = TransferParams.parse(params)
    assert result is not None
    return result


def is_valid(params: dict[str, Any]) -> bool:
    try:
        TransferParams.parse(params)
    except ConfigError:
        return False
    return True


def needed(prompt_len: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-prompt_len // block_size)
