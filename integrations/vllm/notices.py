"""What a worker rank tells its peer's ranks outside a transfer's own bytes.

Why apart from the worker: these are the messages that carry no KV (D needs nothing after a
full prefix hit; P holds a queued request for D; D's request ended before it had blocks), each
sent to every rank of the other side this rank pairs with, found through that side's rank 0
(`ranks.reach_rank`).  None of them waits: a failure is logged, and the peer then falls back on
its own deadline.
"""

from __future__ import annotations

import concurrent.futures
import logging
from functools import partial
from typing import Any

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.mapping import Order, PeerRef
from kvflow.integrations.vllm.ranks import pair_keys, reach_rank, tp_sizes
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Role
from kvflow.runtime.engine import Engine
from kvflow.runtime.threaded import EngineThread

__all__ = ("PeerNotices",)

log = logging.getLogger("kvflow.vllm")


class PeerNotices:
    """Mixed into `WorkerSide`: the rank's identity, and its engine thread."""

    engine_id: str
    rank: int
    tp_size: int
    total_heads: int

    def _thread(self) -> EngineThread:
        raise NotImplementedError

    def _tell_nothing_wanted(self, order: Order) -> list[concurrent.futures.Future[Any]]:
        """An empty registration to every P rank feeding this one: P releases its blocks
        without a WRITE.  vLLM runs the request without waiting for a load, so nothing is
        reported to it; should P not be reached, P frees its blocks at its own deadline."""

        def expect(e: Engine, peer: str, key: TransferKey) -> Any:
            return e.expect(
                key.transfer_id,
                key.epoch,
                peer=peer,
                block_ids=(),
                expected_batches=0,
                first_position=order.first_position,
            )

        return self._tell_sources(order, f"cannot tell P that {order.request_id} needs no KV", logging.ERROR, expect)

    def _promise(self, order: Order) -> None:
        """P: the request is queued here; heartbeats to the decode ranks it feeds say so until
        it ends.  (A sequential router's request has no decode engine yet: nothing to promise.)

        No connection is opened for it: D connects when it registers, and heartbeats go to
        associated peers only.  (Opening one here, while D opens its own, made the two
        handshakes cross and a registration arriving in between be dropped.)"""
        params, decode = order.params, order.params.decode
        if decode is None:
            return
        try:
            pairs = pair_keys(params, Role.PREFILL, self.rank, self.tp_size, self.total_heads)
        except ConfigError as exc:  # its ready order fails the same way, and is reported then
            log.error("%s: cannot promise %s: %s", self.engine_id, order.request_id, exc)
            return
        for target, key in pairs:
            peer = f"{decode.engine}-tp{target}"  # rank r of an engine is named <engine>-tp<r>

            def promise(e: Engine, k: TransferKey = key, peer: str = peer) -> Any:
                return e.promise(k.transfer_id, k.epoch, peer=peer)

            self._thread().call(promise).add_done_callback(
                partial(self._logged, what=f"cannot promise {order.request_id}")
            )

    def _abort_unallocated(self, order: Order) -> None:
        """D: the request ended before it had blocks, so nothing was registered: tell the P
        ranks feeding this one, which may hold its KV (or compute it later), so that they free
        it at once (on failure P frees at its own deadline)."""
        params = order.params

        def abort(e: Engine, peer: str, key: TransferKey) -> Any:
            return e.abort(key.transfer_id, key.epoch, Role.DECODE, order.reason, peer=peer, mode=params.mode)

        self._tell_sources(order, f"could not tell P that {order.request_id} ended", logging.WARNING, abort)

    def _tell_sources(self, order: Order, what: str, level: int, fn: Any) -> list[concurrent.futures.Future[Any]]:
        """D: run `fn(engine, P rank's engine id, pair key)` for every P rank feeding this one,
        each once associated with it; params naming no such ranks are logged as errors, a failed
        call at `level`."""
        params = order.params
        try:
            pairs = pair_keys(params, Role.DECODE, self.rank, self.tp_size, self.total_heads)
            p_tp = tp_sizes(params, Role.DECODE, self.tp_size)[0]
        except ConfigError as exc:
            log.error("%s: %s: %s", self.engine_id, what, exc)
            return []
        futures = []
        for source, key in pairs:

            def call(e: Engine, peer: str, k: TransferKey = key) -> Any:
                return fn(e, peer, k)

            future = self._call_rank(params.prefill, p_tp, source, call, Role.DECODE)
            future.add_done_callback(partial(self._logged, what=what, level=level))
            futures.append(future)
        return futures

    def _logged(self, future: concurrent.futures.Future[Any], what: str, level: int = logging.WARNING) -> None:
        if future.exception() is not None:
            log.log(level, "%s: %s: %s", self.engine_id, what, future.exception())

    def _call_rank(self, peer: PeerRef, tp_size: int, rank: int, fn: Any, role: Role) -> concurrent.futures.Future[Any]:
        """Run `fn(engine, peer rank's engine id)` once associated with rank `rank` of `peer`
        (see `ranks.reach_rank`)."""

        async def run(e: Engine) -> Any:
            return await fn(e, await reach_rank(e, peer, tp_size, rank, role))

        return self._thread().call(run)
