"""P's side of a worker rank: a ready order's KV handed to the rank's engine as the forward saves it.

Why apart from the worker: this is the path every prefill step takes, and the one with the most
rules.  A push chunk goes out in parts, one WRITE each, in the order the forward completes them
(`settings.push_units`): each stretch of the forward's layers, and within it each KV cache
group's layers, with that group's blocks; a part is posted once all its layers are saved, after
the parts before it, waiting for the device (never the model runner's thread) to have written
the KV.  Each (D rank, KV cache group) pair is a transfer of its own (`ranks.transfer_parts`),
opened when its first blocks are handed over: a sliding-window group hands over only the block
positions it keeps, which may start in a later chunk than the request's first.  Pull hands each
group's blocks over once the prompt is complete.  The worker owns one `ProducerSide` and hands it
what it needs (its rank's link, its request book, how a request splits into part transfers).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvflow.errors import ConfigError, KVFlowError
from kvflow.integrations.vllm.device import Device, Gate
from kvflow.integrations.vllm.links import EngineLink, send_request
from kvflow.integrations.vllm.mapping import Order, Orders
from kvflow.integrations.vllm.notices import Parts
from kvflow.integrations.vllm.rank_agent import Reach
from kvflow.integrations.vllm.ranks import rank_name, tp_sizes
from kvflow.integrations.vllm.request_book import RequestBook
from kvflow.integrations.vllm.settings import Settings, push_units
from kvflow.layout.groups import KVGroup
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.requests import KvReady
from kvflow.protocol.state import Mode, Role
from kvflow.runtime.frames import error_from_record

__all__ = ("Forward", "ProducerSide", "StepMemo")


@dataclass(slots=True)
class StepMemo:
    """What P's hooks work out once per request in one step (a new one for each step)."""

    saved: set[int] = field(default_factory=set)  # kvflow layers the forward has saved
    units: dict[str, list[tuple[int, tuple[int, int]]]] = field(default_factory=dict)  # request -> its push parts
    parts: dict[str, list[tuple[int, int, TransferKey]] | ConfigError] = field(default_factory=dict)  # its pairs
    named: set[TransferKey] = field(default_factory=set)  # push transfers whose chunk blocks a record named
    sent: dict[str, int] = field(default_factory=dict)  # push request -> parts of its chunk handed over
    held: list[tuple[Gate | None, list[tuple[Order, int]]]] = field(default_factory=list)  # "step" posting


@dataclass(frozen=True, slots=True)
class _Part:
    """One push part handed to the engine: its `RankAgent.post_group` arguments (but the gate)."""

    wire: list[Any]
    request_id: str
    key: TransferKey
    opened: bool  # the transfer's first part: its failure leaves kvflow holding nothing


def _log_if_failed(future: concurrent.futures.Future[Any]) -> None:
    """A done callback: the engine refused the next parts of transfers under way (each one then
    fails at its deadline, and its blocks come back with its release).  Never raises."""
    if future.exception() is not None:
        log.warning("cannot post the next parts of transfers under way: %s", future.exception())


def _settle_parts(settled: dict[int, concurrent.futures.Future[Any]], future: concurrent.futures.Future[Any]) -> None:
    """The answer to a ``post_groups`` order onto each first part's own future: the errors it
    names by index, or the order's own error for all."""
    error = future.exception()
    failures: dict[int, BaseException] = {}
    if error is None:
        try:
            for index, record in future.result() or []:
                failures[int(index)] = error_from_record(record)
        except (TypeError, ValueError) as exc:  # an answer that is not one: every part's start failed
            error = KVFlowError(f"the engine's answer to the push parts is not a list of failures: {exc}")
    for index, part_future in settled.items():
        failure = error if error is not None else failures.get(index)
        if failure is None:
            part_future.set_result(None)
        else:
            part_future.set_exception(failure)


log = logging.getLogger("kvflow.vllm")


@dataclass(frozen=True, slots=True)
class Forward:
    """The model's forward as P's hooks see it, known once the KV caches are registered."""

    kv_groups: tuple[KVGroup, ...] = (KVGroup((0, 1)),)  # the model's KV cache groups
    run_order: tuple[int, ...] = (0,)  # kvflow layers in the forward's order
    page_bytes: int = 0  # one block of one layer
    layer_of: Mapping[str, int] = field(default_factory=dict)  # vLLM layer name -> kvflow layer


@dataclass(slots=True, eq=False)
class ProducerSide:
    """What P's hooks hand a rank's engine: owned by the rank's `WorkerSide`, which gives it
    the link to the engine, the request book and how a request splits into part transfers."""

    engine_id: str
    tp_size: int
    settings: Settings
    book: RequestBook
    link: Callable[[], EngineLink]  # the rank's link to its engine (:raises UsageError: not registered yet)
    parts: Parts  # a request's part transfers on this rank (:raises ConfigError: see `ranks.transfer_parts`)
    device: Device  # where the forward runs (its gates)
    forward: Forward
    step: StepMemo = field(default_factory=StepMemo)  # what this step's hooks worked out
    # the (KV cache group, layers) parts a push chunk goes out in, by how many stretches of
    # the forward (see `_units`); at most ``push_layer_groups`` stretches
    _unit_sets: dict[int, list[tuple[int, tuple[int, int]]]] = field(default_factory=dict, init=False)

    def completed_by(self, orders: Orders, layer_name: str) -> list[tuple[Order, int]]:
        """Mark a layer saved: the push orders whose next parts it completes, each with how
        many of its parts are complete now (most layers complete none: nothing else happens).
        Never raises."""
        layer = self.forward.layer_of.get(layer_name)
        if layer is None:
            return []
        self.step.saved.add(layer)
        completed = []
        for order in orders.ready:
            if order.params.mode is not Mode.PUSH:
                continue
            units = self._units(order)
            sent = complete = self.step.sent.get(order.request_id, 0)
            while complete < len(units) and self.step.saved.issuperset(range(*units[complete][1])):
                complete += 1
            if complete > sent:
                completed.append((order, complete))
        return completed

    def post_completed(self, completed: list[tuple[Order, int]]) -> None:
        """The parts a layer completes: handed over now (``push_posting`` "layer"), or kept with
        their device event until the forward has been enqueued (``"step"``: one pass over
        every part of the step, each still waiting for its own event).
        :raises UsageError: the rank's engine is not registered yet."""
        gate = self.device.record()  # one device event for every part this layer completes
        if self.settings.push_posting == "step":
            self.step.held.append((gate, completed))
            return
        self._hand_over(completed, gate)

    def _hand_over(self, completed: list[tuple[Order, int]], gate: Gate | None) -> None:
        parts: list[_Part] = []
        for order, complete in completed:
            self._post_units(order, complete, parts)
        self._send_parts(parts, gate)

    def save(self, orders: Orders) -> None:
        """The step's ready orders, its forward enqueued: the parts "step" posting held, pull
        readiness, and every push part not posted yet.
        :raises UsageError: the rank's engine is not registered yet."""
        if not orders.ready:
            return
        for earlier, completed in self.step.held:  # "step" posting: the parts the layers completed
            self._hand_over(completed, earlier)
        self.step.held.clear()
        gate = self.device.record()
        pushed: list[_Part] = []
        for order in orders.ready:
            if order.reason:  # vLLM's block table lacks a block its rules say it holds
                log.error("%s: the KV of %s is not all there: %s", self.engine_id, order.request_id, order.reason)
            if order.params.mode is Mode.PUSH:
                self._post_units(order, len(self._units(order)), pushed)
                self.step.sent.pop(order.request_id, None)
                continue
            parts = self._sending_parts(order)
            decode = order.params.decode  # None: a sequential router's transfer, for whichever D claims it
            d_tp = tp_sizes(order.params, Role.PREFILL, self.tp_size)[1] if parts and decode is not None else 0
            many = len(self.forward.kv_groups) > 1
            for target, group, key in parts:
                blocks = order.blocks[group]
                if not blocks.ids or not self.book.hand_over(order.request_id, key):
                    continue
                reach = None if decode is None else Reach(decode, d_tp, target)
                layers = self.forward.kv_groups[group].layers if many else None
                peer = None if reach is None else reach.name
                ready = KvReady(key, blocks.ids, first_position=blocks.first, layers=layers, mode=Mode.PULL, peer=peer)
                future = send_request(self.link(), ready, reach, gate)
                self.book.awaiting(order.request_id, future, key)
        self._send_parts(pushed, gate)

    def _sending_parts(self, order: Order) -> list[tuple[int, int, TransferKey]]:
        """P: the part transfers this rank feeds for `order`'s request; none (or params it cannot
        use): kvflow takes no block, and the request is reported sent once vLLM says it finished."""
        request_id = order.request_id
        parts = self.step.parts.get(request_id)
        if parts is None:  # once per request and step, not once per part
            try:
                parts = self.parts(order.params, Role.PREFILL)
            except ConfigError as exc:
                parts = exc
            self.step.parts[request_id] = parts
        if isinstance(parts, ConfigError):
            log.error("%s: could not hand over the KV of %s: %s", self.engine_id, request_id, parts)
            parts = []
        if not parts:
            self.book.nothing_taken(request_id)
        return parts

    def _post_units(self, order: Order, upto: int, parts: list[_Part]) -> None:
        """Parts ``[sent, upto)`` of a push order, in order, for each D rank this rank feeds
        (each part of a group goes to that group's transfer), added to `parts`."""
        first = self.step.sent.get(order.request_id, 0)
        if first >= upto:
            return
        self.step.sent[order.request_id] = upto
        units = self._units(order)
        last = {group: index for index, (group, _) in enumerate(units)}  # each group's last part
        decode = order.params.decode
        for target, group, key in self._sending_parts(order):
            blocks = order.blocks[group]
            if not blocks.ids:  # none of the group's positions in this chunk is kept
                continue
            for unit in range(first, upto):
                if units[unit][0] != group:
                    continue
                opened = self.book.hand_over(order.request_id, key)
                named = key in self.step.named  # the chunk's blocks go with its first group only
                self.step.named.add(key)
                wire = [
                    key.transfer_id,
                    key.epoch,
                    None if named else list(blocks.ids),
                    unit,
                    list(units[unit][1]),
                    order.final and unit == last[group],
                    blocks.first,
                    opened,
                    # the KV goes to the D rank the params name, never to whichever engine
                    # registered the transfer id first
                    None if decode is None else rank_name(decode.engine, target),
                ]
                parts.append(_Part(wire, order.request_id, key, opened))

    def _send_parts(self, parts: list[_Part], gate: Gate | None) -> None:
        """One order for the parts a hook completed of transfers the engine took already, sent
        whatever the engine process owes (refused, they would strand those transfers), and one
        for the transfers that start here, which an engine process owing too many answers may
        refuse (`links.EngineLink.command`); each transfer's first part settles a future of its
        own (see `results`)."""
        starting = {part.key for part in parts if part.opened}
        going_on = [part.wire for part in parts if part.key not in starting]
        if going_on:
            self.link().command("post_groups", gate, going_on, always=True).add_done_callback(_log_if_failed)
        parts = [part for part in parts if part.key in starting]
        if not parts:
            return
        future = self.link().command("post_groups", gate, [part.wire for part in parts])
        firsts = {index: part for index, part in enumerate(parts) if part.opened}
        settled = {index: concurrent.futures.Future[Any]() for index in firsts}
        for index, part in firsts.items():
            self.book.awaiting(part.request_id, settled[index], part.key)
        future.add_done_callback(partial(_settle_parts, settled))

    def _units(self, order: Order) -> list[tuple[int, tuple[int, int]]]:
        """The parts a push order's blocks go out in: the forward cut into as many stretches as
        ``push_layer_groups`` allows with at least ``push_group_bytes`` in each (one stretch for
        a small chunk: every WRITE costs the engine the same work whatever its size, and a
        small one gains nothing from starting before the forward ends).  Once per request and step."""
        units = self.step.units.get(order.request_id)
        if units is not None:
            return units
        count = self.settings.push_layer_groups
        if self.settings.push_group_bytes:
            moved = sum(
                len(part.ids) * group.count for part, group in zip(order.blocks, self.forward.kv_groups, strict=False)
            )
            count = max(1, min(count, -(-moved * self.forward.page_bytes // self.settings.push_group_bytes)))
        units = self._unit_sets.get(count)
        if units is None:
            units = self._unit_sets[count] = push_units(self.forward.run_order, self.forward.kv_groups, count)
        self.step.units[order.request_id] = units
        return units
