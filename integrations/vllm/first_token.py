"""D continues from the first token P sampled: the token's way from P's scheduler to D's sampler.

Why: with the first token straight from prefill, a router streams P's first token to the client
and D's stream after it.  If D drew the first token again itself, logits that differ in their
last bit (another batch, another kernel) could make it draw another one, and D's stream would
contradict what the client already has.  So P sends its token to D and D's sampler is held to
it; D draws nothing of its own for that position.

The way: P's scheduler sees the token when the request finishes (`SchedulerBook.finished`) and
orders its workers to send it (a ``first`` order); each P rank sends it to the D ranks it feeds
(`RankAgent.tell_first_token`), over the control plane (`kvflow.protocol.messages.FirstToken`).
D's rank asks for the token when it registers the request's blocks and holds the request's
``finished_recving`` until the token is there (`FirstTokenWaits`, bounded by the transfer's
timeout and `FIRST_TOKEN_WAIT`), puts it in this process's table (`FORCED`), and vLLM's sampler
takes it from there through `FirstTokenProcessor` (`kvflow.integrations.vllm.logits`), which D
is started with (``--logits-processors``).  A token that does not come in time leaves D to draw
its own, which the router checks against P's.

Asked for per request (``first_token`` in the kvflow entry, `TransferParams`).  Not for a model
whose P leaves the prompt's last token to D (Mamba state, `SchedulerBook.replay`): P's token is
then not the request's first.  No vLLM import here.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvflow.protocol.messages import TransferKey

__all__ = (
    "FIRST_TOKEN_WAIT",
    "FORCED",
    "PROCESSOR",
    "FirstTokenWaits",
    "ForcedTokens",
    "forced_token",
    "forced_transfer",
)

log = logging.getLogger("kvflow.vllm")

# seconds past the transfer's own timeout that D waits for a request's first token (P sends it
# one step after its prefill ends, around when its KV lands); P waits as long for D to associate
FIRST_TOKEN_WAIT = 10.0
PROCESSOR = "kvflow.integrations.vllm.logits:FirstTokenProcessor"  # what D's ``--logits-processors`` names
FORCED_KEPT = 4096  # tokens the table keeps for requests the sampler has not taken yet


class ForcedTokens:
    """This process's first tokens by the request's transfer id, from D's worker to vLLM's
    sampler (the same process: a worker runs the model runner it serves).  Bounded: the oldest
    goes first.  Thread-safe."""

    def __init__(self, kept: int = FORCED_KEPT) -> None:
        self.kept = kept
        self._tokens: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, transfer_id: str, token: int) -> None:
        with self._lock:
            self._tokens[transfer_id] = token
            while len(self._tokens) > self.kept:
                self._tokens.popitem(last=False)

    def take(self, transfer_id: str) -> int | None:
        """The token for `transfer_id`, forgotten here (None: none)."""
        with self._lock:
            return self._tokens.pop(transfer_id, None)

    def drop(self, transfer_id: str) -> None:
        """The token for `transfer_id` is not wanted any more (`take`, the token let go)."""
        self.take(transfer_id)

    def __len__(self) -> int:
        return len(self._tokens)


FORCED = ForcedTokens()


def forced_transfer(extra_args: Mapping[str, Any] | None) -> str | None:
    """The transfer id of a request whose first token comes from P, read from its sampling
    params' ``extra_args`` (vLLM puts the request's ``kv_transfer_params`` there); None for any
    other request, whatever its ``extra_args`` hold.  Never raises."""
    params = (extra_args or {}).get("kv_transfer_params")
    entry = params.get("kvflow") if isinstance(params, Mapping) else None
    if not isinstance(entry, Mapping) or entry.get("first_token") is not True:
        return None
    transfer_id = entry.get("transfer_id")
    return transfer_id if isinstance(transfer_id, str) else None


def forced_token(extra_args: Mapping[str, Any] | None, forced: ForcedTokens = FORCED) -> int | None:
    """P's first token for the request whose sampling params' ``extra_args`` these are, taken
    from `forced` (the sampler holds it from now on); None when the request did not ask for one
    or D's rank has none for it.  Never raises."""
    transfer_id = forced_transfer(extra_args)
    return forced.take(transfer_id) if transfer_id is not None else None


# asks the rank's engine for P rank `peer`'s first token of a pair transfer: a future of the
# token, or of None when none came in time
Ask = Callable[[str, TransferKey], "concurrent.futures.Future[Any]"]


@dataclass(slots=True)
class _Wait:
    transfer_id: str
    peer: str  # the P rank that sends it
    answer: concurrent.futures.Future[Any]


class FirstTokenWaits:
    """D's rank: the requests whose first token it waits for, asked for when their blocks are
    registered, so that a token that came with (or before) the KV costs the request no step."""

    def __init__(self, forced: ForcedTokens = FORCED) -> None:
        self.forced = forced
        self._waits: dict[str, _Wait] = {}
        self._landed: set[str] = set()  # requests whose KV landed, held for their token
        self.missed = 0  # requests let go without a token (none came in time, or the ask failed)

    def expect(self, request_id: str, transfer_id: str, peer: str, key: TransferKey, ask: Ask) -> None:
        """The request's first token comes from P rank `peer`, for pair transfer `key`: asked for now."""
        self._waits[request_id] = _Wait(transfer_id, peer, ask(peer, key))

    def answered(self) -> bool:
        """Whether a request whose KV landed has its token (or its wait ended).  Never raises."""
        return any(self._waits[r].answer.done() for r in self._landed)

    def hold(self, received: set[str], finished: Iterable[str]) -> set[str]:
        """Of `received` (requests whose KV landed this step) and those held before, the ones
        to report now: those with their token (put in the table for the sampler), those whose
        wait ended without one, those nobody waits for, and those vLLM says finished
        (`finished`: nothing left to sample).  The others are held until their token comes."""
        out = {r for r in received if r not in self._waits}
        self._landed |= received & self._waits.keys()
        for request_id in finished:
            if request_id in self._landed:
                out.add(request_id)
            self.forget(request_id)
        for request_id in list(self._landed):
            wait = self._waits[request_id]
            if not wait.answer.done():
                continue
            del self._waits[request_id]
            self._landed.discard(request_id)
            out.add(request_id)
            token = None if wait.answer.cancelled() or wait.answer.exception() else wait.answer.result()
            if isinstance(token, int):
                self.forced.put(wait.transfer_id, token)
            else:
                self.missed += 1
                log.warning("%s: no first token from %s in time: D draws its own", request_id, wait.peer)
        return out

    def forget(self, request_id: str) -> None:
        """The request's load failed, or it ended: nothing to wait for."""
        self._landed.discard(request_id)
        wait = self._waits.pop(request_id, None)
        if wait is not None:
            self.forced.drop(wait.transfer_id)
