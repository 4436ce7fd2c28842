"""A request's ``kv_transfer_params`` as kvflow reads them: where the transfer goes, and who.

Why apart from the scheduler's book: the router writes these and the connector reads them, and
any HTTP client of vLLM's server can set them, so their bounds live in one place.

The router sets, in each request's ``kv_transfer_params``, a ``kvflow`` entry:

    {"transfer_id": str, "epoch": int, "mode": "push" | "pull",
     "prefill": {"engine": str, "address": "tcp://IP:port", "tp_size": int},
     "decode":  {"engine": str, "address": "tcp://IP:port", "tp_size": int},
     "first_token": bool}

(the address is the engine's tensor-parallel rank 0; ``tp_size``, optional, is the engine's
tensor parallelism: see `kvflow.integrations.vllm.ranks` for why it travels with the request;
``first_token``, optional: the router streams P's first token to the client, so P sends it to D
and D continues from it, `kvflow.integrations.vllm.first_token`)

plus vLLM's own flags: ``do_remote_decode`` on the prefill request, ``do_remote_prefill`` on the
decode request.  Transfers are matched by ``transfer_id``, never by request ids.  In pull mode
``decode`` may be left out: P then holds its KV for whichever decode engine claims the transfer
first (see `kvflow.protocol.messages.Claim`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvflow.errors import ConfigError
from kvflow.layout.groups import MAX_GROUPS
from kvflow.protocol.messages import (
    MAX_TRANSFER_ID,
    address_problem,
    engine_id_problem,
    epoch_problem,
    transfer_id_problem,
)
from kvflow.protocol.state import Mode

__all__ = (
    "FIRST_TOKEN_ANSWER",
    "MAX_REQUEST_TRANSFER_ID",
    "MAX_TP",
    "MODES",
    "SEQUENTIAL_PREFILL_PARAMS",
    "PeerRef",
    "TransferParams",
)

MODES = {mode.value: mode for mode in Mode}  # a mode travels as its value
MAX_TP = 1024  # tensor-parallel ranks a side may announce
# A request's transfer id leaves room for the rank pair's suffix (`ranks.pair_transfer_id`:
# "@p<rank>d<rank>", ranks below MAX_TP) and the KV cache group's ("#g<group>", groups below
# MAX_GROUPS), so that every part's id is one the wire carries.
MAX_REQUEST_TRANSFER_ID = MAX_TRANSFER_ID - len(f"@p{MAX_TP - 1}d{MAX_TP - 1}#g{MAX_GROUPS - 1}")

# In the ``kv_transfer_params`` of P's answer: false when the token P sampled is not the
# request's first (with Mamba state P prefills all but the prompt's last token), so a router
# must not send it to the client as the first token
FIRST_TOKEN_ANSWER = "kvflow_first_token"

# What a sequential router (vLLM's toy proxy, tests/v1/kv_connector/nixl_integration/
# toy_proxy_server.py) sends P, with max_tokens 1, before handing P's answer to D.
SEQUENTIAL_PREFILL_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True, slots=True)
class PeerRef:
    engine: str
    address: str
    tp_size: int = 0  # the engine's tensor parallelism; 0: not said (taken as the local one's)


@dataclass(frozen=True, slots=True)
class TransferParams:
    transfer_id: str
    epoch: int
    mode: Mode
    prefill: PeerRef
    decode: PeerRef | None  # pull: None when P waits for whichever decode engine claims it
    # the router streams P's first token to the client: P sends it to D, and D continues from it
    first_token: bool = False

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None) -> TransferParams | None:
        """The kvflow part of a request's ``kv_transfer_params``, or None when it has none.

        Whatever this accepts, the wire carries (any HTTP client of vLLM's server can set these):
        the transfer id and epoch within the protocol's bounds (the id short enough for
        the rank pair's suffix, `pair_transfer_id`), engine ids as `engine_id_problem` wants them,
        addresses literal IPs (a host name would be resolved by ZeroMQ on its one I/O thread,
        stalling every peer's control traffic while the resolver is slow).

        :raises ConfigError: the entry exists but is malformed (named field).
        """
        raw = (params or {}).get("kvflow")
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ConfigError("kv_transfer_params.kvflow must be a mapping")
        tid, epoch, mode = raw.get("transfer_id"), raw.get("epoch", 1), raw.get("mode", "push")
        for name, problem in (
            ("transfer_id", transfer_id_problem(tid, MAX_REQUEST_TRANSFER_ID)),
            ("epoch", epoch_problem(epoch)),
        ):
            if problem is not None:
                raise ConfigError(f"kv_transfer_params.kvflow.{name}: {problem}")
        if not isinstance(mode, str) or mode not in MODES:
            raise ConfigError(f"kv_transfer_params.kvflow.mode must be one of {tuple(MODES)}")
        decode = None if MODES[mode] is Mode.PULL and raw.get("decode") is None else _peer(raw, "decode")
        first_token = raw.get("first_token", False)
        if type(first_token) is not bool:
            raise ConfigError(f"kv_transfer_params.kvflow.first_token must be true or false, not {first_token!r:.40}")
        return cls(str(tid), int(epoch), MODES[mode], _peer(raw, "prefill"), decode, first_token)

    def to_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "transfer_id": self.transfer_id,
            "epoch": self.epoch,
            "mode": self.mode.value,
            "prefill": _peer_params(self.prefill),
        }
        if self.decode is not None:
            params["decode"] = _peer_params(self.decode)
        if self.first_token:
            params["first_token"] = True
        return params


def _peer_params(peer: PeerRef) -> dict[str, Any]:
    entry: dict[str, Any] = {"engine": peer.engine, "address": peer.address}
    if peer.tp_size:
        entry["tp_size"] = peer.tp_size
    return entry


def _peer(raw: Mapping[str, Any], side: str) -> PeerRef:
    entry = raw.get(side)
    if not isinstance(entry, Mapping):
        raise ConfigError(f"kv_transfer_params.kvflow.{side}.engine must be given, in a mapping")
    problem = engine_id_problem(entry.get("engine"))
    if problem is not None:
        raise ConfigError(f"kv_transfer_params.kvflow.{side}.engine {problem}")
    address = entry.get("address", "")
    why = "must be a string" if not isinstance(address, str) else address_problem(address) if address else None
    if why is not None:
        raise ConfigError(f"kv_transfer_params.kvflow.{side}.address {why}, not {address!r:.80}")
    tp_size = entry.get("tp_size", 0)
    if type(tp_size) is not int or not 0 <= tp_size <= MAX_TP:
        why = f"must be an integer 1..{MAX_TP}, not {tp_size!r:.40}"
        raise ConfigError(f"kv_transfer_params.kvflow.{side}.tp_size {why}")
    return PeerRef(entry["engine"], address, tp_size)
