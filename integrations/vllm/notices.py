"""What a worker rank tells its peer's ranks outside a transfer's own bytes.

Why apart from the worker: these are the messages that carry no KV (D needs nothing after a
full prefix hit; one side holds a queued request for the other; D's request ended before it
had blocks), each sent for every part transfer this rank takes in the request (each rank of
the other side it pairs with, each KV cache group), found through that side's rank 0
(`ranks.reach_rank`, run by the rank's agent); and P's first token, which D waits for
(`kvflow.integrations.vllm.first_token`).  None of them waits: a failure is logged, and
the peer then falls back on its own deadline.  The worker holds one `PeerNotices` and hands it
what it needs (its rank's link and how a request's params split into part transfers).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.first_token import FIRST_TOKEN_WAIT
from kvflow.integrations.vllm.links import EngineLink, send_request
from kvflow.integrations.vllm.mapping import Order
from kvflow.integrations.vllm.rank_agent import Reach, peer_wire
from kvflow.integrations.vllm.ranks import rank_name, tp_sizes
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.requests import Abort, Expect
from kvflow.protocol.state import Role

__all__ = ("PeerNotices",)

log = logging.getLogger("kvflow.vllm")


Parts = Callable[[Any, Role], list[tuple[int, int, TransferKey]]]
# what D tells one P rank: its order given on the rank's link, for P's rank and the pair's key
Tell = Callable[[EngineLink, Reach, TransferKey], concurrent.futures.Future[Any]]


class PeerNotices:
    """What one worker rank tells the ranks of its peers without moving KV."""

    def __init__(self, engine_id: str, tp_size: int, link: Callable[[], EngineLink], parts: Parts) -> None:
        """`link`: the rank's link to its engine (:raises UsageError: not registered yet);
        `parts`: a request's part transfers on this rank (:raises ConfigError: see
        `ranks.transfer_parts`)."""
        self.engine_id = engine_id
        self.tp_size = tp_size
        self._link = link
        self._parts = parts

    def nothing_wanted(self, order: Order) -> list[concurrent.futures.Future[Any]]:
        """An empty registration to every P rank feeding this one: P releases its blocks
        without a WRITE.  vLLM runs the request without waiting for a load, so nothing is
        reported to it; should P not be reached, P frees its blocks at its own deadline."""
        first = order.blocks[0].first if order.blocks else 0

        def tell(link: EngineLink, reach: Reach, key: TransferKey) -> concurrent.futures.Future[Any]:
            nothing = Expect(key, reach.name, (), expected_batches=0, first_position=first)
            return send_request(link, nothing, reach, always=True)

        return self._tell_sources(order, f"cannot tell P that {order.request_id} needs no KV", logging.ERROR, tell)

    def promise(self, order: Order) -> None:
        """The request is queued here: heartbeats to the other side's ranks it pairs with say so
        until it ends (P) or its blocks are registered (D).

        P opens no connection for it: D connects when it registers, and heartbeats go to
        associated peers only.  (Opening one from P, while D opens its own, made the two
        handshakes cross and a registration arriving in between be dropped.)  D connects now,
        as it would to register: P may have the KV ready long before D's queue moves.  (A
        sequential router's request has no decode engine yet when P queues it: nothing to
        promise.)"""
        params, decode = order.params, order.params.decode
        if not order.producer:
            what = f"cannot promise {order.request_id} (P frees its KV at its own deadline)"

            def tell(link: EngineLink, reach: Reach, key: TransferKey) -> concurrent.futures.Future[Any]:
                where = (peer_wire(reach.peer), reach.tp_size, reach.rank)
                return link.command("promise_prefill", *where, key.transfer_id, key.epoch, params.mode.value)

            self._tell_sources(order, what, logging.INFO, tell)
            return
        if decode is None:
            return
        try:
            parts = self._parts(params, Role.PREFILL)
        except ConfigError as exc:  # its ready order fails the same way, and is reported then
            log.error("%s: cannot promise %s: %s", self.engine_id, order.request_id, exc)
            return
        for target, _, key in parts:
            peer = rank_name(decode.engine, target)
            # lazy: a promise may wait for the step's next order or its results (no wake-up of its own)
            self._link().command("promise_pair", key.transfer_id, key.epoch, peer, lazy=True).add_done_callback(
                partial(self.log_failure, what=f"cannot promise {order.request_id}")
            )

    def first_token(self, order: Order) -> None:
        """P: the first token it sampled, to each D rank this rank feeds (once per D rank, with
        the pair transfer of its first KV cache group), which holds the request for it
        (`first_token.FirstTokenWaits`).  Should D not be reached, D draws its own."""
        params, decode = order.params, order.params.decode
        if decode is None:
            return
        what = f"cannot send D the first token of {order.request_id}"
        try:
            parts = self._parts(params, Role.PREFILL)
            d_tp = tp_sizes(params, Role.PREFILL, self.tp_size)[1]
        except ConfigError as exc:
            log.error("%s: %s: %s", self.engine_id, what, exc)
            return
        told: set[int] = set()
        for target, _, key in parts:
            if target in told:
                continue
            told.add(target)
            reach = Reach(decode, d_tp, target).to_wire()
            told_by = (reach, key.transfer_id, key.epoch, order.token, FIRST_TOKEN_WAIT)
            future = self._link().command("tell_first_token", *told_by)
            future.add_done_callback(partial(self.log_failure, what=what))

    def abort_unallocated(self, order: Order) -> None:
        """D: the request ended before it had blocks, so nothing was registered: tell the P
        ranks feeding this one, which may hold its KV (or compute it later), so that they free
        it at once (on failure P frees at its own deadline)."""
        mode = order.params.mode

        def tell(link: EngineLink, reach: Reach, key: TransferKey) -> concurrent.futures.Future[Any]:
            ended = Abort(key, Role.DECODE, order.reason, reach.name, mode)
            return send_request(link, ended, reach, always=True)

        self._tell_sources(order, f"could not tell P that {order.request_id} ended", logging.WARNING, tell)

    def _tell_sources(self, order: Order, what: str, level: int, tell: Tell) -> list[concurrent.futures.Future[Any]]:
        """D: `tell` (this rank's link, P's rank to reach, the pair's key) every P rank feeding
        this one; params naming no such ranks are logged as errors, a failed order at `level`."""
        params = order.params
        try:
            parts = self._parts(params, Role.DECODE)
            p_tp = tp_sizes(params, Role.DECODE, self.tp_size)[0]
        except ConfigError as exc:
            log.error("%s: %s: %s", self.engine_id, what, exc)
            return []
        futures = []
        for source, _, key in parts:
            future = tell(self._link(), Reach(params.prefill, p_tp, source), key)
            future.add_done_callback(partial(self.log_failure, what=what, level=level))
            futures.append(future)
        return futures

    def log_failure(self, future: concurrent.futures.Future[Any], what: str, level: int = logging.WARNING) -> None:
        """A done callback: log a command that failed (`what` it was for).  Never raises."""
        if future.exception() is not None:
            log.log(level, "%s: %s: %s", self.engine_id, what, future.exception())
