"""Which requests kvflow serves: a request's ``kv_transfer_params`` accepted, assigned or refused.

Why a module of its own: before the scheduler's book (`kvflow.integrations.vllm.mapping`) moves
a request along its stages, one policy decides whether kvflow serves it at all, and with which
transfer.  Params are malformed, name both roles, name a peer this engine may not transfer with,
or ask for a remote prefill without a kvflow entry; whichever it is, the request is refused the
same way: logged once with its id and why, counted, and computed locally, never a crash of the
scheduler.  Kept apart, that policy (and the log and counts it keeps) is one piece, and the book
asks it only whether a request is served and with what params.

Sequential routers (vLLM's toy proxy, llm-d's routing sidecar, Dynamo) set no ``kvflow`` entry:
they send P ``do_remote_decode`` (``remote_*`` None, ``max_tokens`` 1), so P assigns the
transfer itself (`RequestIntake.assign`: an unguessable transfer id, the capability to read the
KV), counted in ``counters["assigned"]``.  A decode request whose ``do_remote_prefill`` kvflow
cannot serve (malformed, another connector's params) is counted in ``counters["unservable"]``.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.params import PeerRef, TransferParams
from kvflow.protocol.admission import PeerAllowList
from kvflow.protocol.state import Mode

log = logging.getLogger("kvflow.vllm")

__all__ = ("BookCounts", "RequestIntake", "roles_problem")


@dataclass(slots=True)
class BookCounts:
    """What the scheduler-side book counts, cumulative, each count a field (`SchedulerBook.counters`
    reads them by name, for vLLM's metrics)."""

    unservable: int = 0  # do_remote_prefill / do_remote_decode requests computed locally instead
    assigned: int = 0  # transfers assigned for a sequential router's request


class RequestIntake:
    """The scheduler side's screen of requests' params, one per vLLM engine (scheduler process).

    `producer` and `allowed` are `SchedulerBook`'s (see there); `refused` maps a request id to
    why its kvflow params were refused, until the request finishes."""

    def __init__(self, producer: PeerRef | None = None, allowed: PeerAllowList | None = None) -> None:
        self.producer = producer
        self.allowed = allowed or PeerAllowList()
        self.refused: dict[str, str] = {}  # request id -> why its kvflow params were refused
        self.counts = BookCounts()

    @property
    def counters(self) -> dict[str, int]:
        """The counts by name (`BookCounts`), a copy.  Never raises."""
        return asdict(self.counts)

    def assign(self, request_id: str) -> TransferParams | None:
        """A sequential router's request: a fresh pull transfer any one decode engine may claim."""
        if self.producer is None:
            self.unservable(
                request_id,
                "do_remote_decode without a kvflow entry needs this engine's control address in the "
                "returned params, unknown with port 0 (set kv_connector_extra_config.port)",
                "no KV is kept for a decode engine",
            )
            return None
        self.counts.assigned += 1
        return TransferParams(secrets.token_urlsafe(18), 1, Mode.PULL, self.producer, None)

    def parse(
        self, request_id: str, params: Mapping[str, Any] | None, receiving: bool = False
    ) -> TransferParams | None:
        """The request's kvflow params; malformed ones, and a remote prefill without a kvflow
        entry (`receiving`), are refused (logged once per request and counted) and the request
        runs as if it had none: computed locally, never a crash of the scheduler."""
        parsed, problem = self.accepted(params, receiving)
        if problem is not None:
            self.unservable(request_id, problem, "it is computed locally")
        return parsed

    def accepted(
        self, params: Mapping[str, Any] | None, receiving: bool = False
    ) -> tuple[TransferParams | None, str | None]:
        """`parse` without its log and count: the params, or why they are refused."""
        try:
            parsed = TransferParams.parse(params)
        except ConfigError as exc:
            return None, str(exc)
        if parsed is None and receiving:
            keys = sorted(str(key) for key in (params or {}))[:12]
            why = (
                f"kv_transfer_params ask for a remote prefill but hold no kvflow entry (keys {keys}: "
                "another connector's params, or a router that dropped P's answer)"
            )
            return None, why
        peer = None if parsed is None else parsed.prefill if receiving else parsed.decode
        problem = None if peer is None else self.allowed.problem(peer.engine, peer.address)
        if problem is not None:
            return None, f"kv_transfer_params name a peer this engine may not transfer with: {problem}"
        return parsed, None

    def mapping(self, request_id: str, params: object) -> Mapping[str, Any]:
        """vLLM's ``kv_transfer_params`` as a mapping: None is none, and so is anything that is
        not a mapping (vLLM's offline API passes on what it is given), refused and logged."""
        if params is not None and not isinstance(params, Mapping):
            self.unservable(request_id, f"kv_transfer_params is a {type(params).__name__}, not a mapping", "ignored")
            return {}
        params = params or {}
        why = roles_problem(params)
        if why is not None:
            self.unservable(request_id, why, "it is computed locally")
            return {}
        return params

    def unservable(self, request_id: str, why: str, consequence: str) -> None:
        """Log (once per request) and count a request kvflow cannot serve."""
        if request_id not in self.refused:
            self.refused[request_id] = why
            self.counts.unservable += 1
            log.error("request %s: kvflow cannot serve its kv_transfer_params: %s; %s", request_id, why, consequence)


def roles_problem(params: Mapping[str, Any]) -> str | None:
    """Why the params' role flags are refused, or None: a request is P's (remote decode) or D's
    (remote prefill), never both, and vLLM reads the flags as truths, so anything but a boolean
    is refused as a whole."""
    flags = [params.get(flag) for flag in ("do_remote_prefill", "do_remote_decode")]
    if any(flag not in (None, True, False) for flag in flags) or all(flags):
        return f"do_remote_prefill {flags[0]!r:.40} and do_remote_decode {flags[1]!r:.40} are not one role"
    return None
