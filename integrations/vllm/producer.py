"""P's side of a worker rank: a ready order's KV handed to the rank's engine as the forward saves it.

Why apart from the worker: this is the path every prefill step takes, and the one with the most
rules.  A push chunk goes out in parts, one WRITE each, in the order the forward completes them
(`settings.push_units`): each stretch of the forward's layers, and within it each KV cache
group's layers, with that group's blocks; a part is posted once all its layers are saved, after
the parts before it, waiting for the device (never the model runner's thread) to have written
the KV.  Each (D rank, KV cache group) pair is a transfer of its own (`ranks.transfer_parts`),
opened when its first blocks are handed over: a sliding-window group hands over only the block
positions it keeps, which may start in a later chunk than the request's first.  Pull hands each
group's blocks over once the prompt is complete.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvflow.errors import ConfigError, KVFlowError
from kvflow.integrations.vllm.device import Device, Gate
from kvflow.integrations.vllm.links import EngineLink, send_request
from kvflow.integrations.vllm.mapping import Order, Orders
from kvflow.integrations.vllm.rank_agent import Reach
from kvflow.integrations.vllm.ranks import PairBook, rank_name, tp_sizes
from kvflow.integrations.vllm.settings import Settings, push_units
from kvflow.layout.groups import KVGroup
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.requests import KvReady
from kvflow.protocol.state import Mode, Role
from kvflow.runtime.frames import error_from_record

__all__ = ("ProducerSide", "StepMemo")


@dataclass(slots=True)
class StepMemo:
    """What P's hooks work out once per request in one step (a new one for each step)."""

    saved: set[int] = field(default_factory=set)  # kvflow layers the forward has saved
    units: dict[str, list[tuple[int, tuple[int, int]]]] = field(default_factory=dict)  # request -> its push parts
    parts: dict[str, list[tuple[int, int, TransferKey]] | ConfigError] = field(default_factory=dict)  # its pairs
    named: set[TransferKey] = field(default_factory=set)  # push transfers whose chunk blocks a record named
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


class ProducerSide:
    """Mixed into `WorkerSide`: what P's hooks hand the engine (its state lives there)."""

    engine_id: str
    tp_size: int
    settings: Settings
    pairs: PairBook
    device: Device
    kv_groups: tuple[KVGroup, ...]
    layer_of: dict[str, int]
    _run_order: tuple[int, ...]
    _page_bytes: int
    _unit_sets: dict[int, list[tuple[int, tuple[int, int]]]]
    _step: StepMemo
    _groups_sent: dict[str, int]
    _requests: dict[tuple[TransferKey, Role], str]
    _late_frees: set[str]
    _ready_starts: list[tuple[concurrent.futures.Future[Any], str, TransferKey]]

    def _link(self) -> EngineLink:
        raise NotImplementedError

    def _parts(self, params: Any, role: Role) -> list[tuple[int, int, TransferKey]]:
        raise NotImplementedError

    def _completed_by(self, orders: Orders, layer_name: str) -> list[tuple[Order, int]]:
        """Mark a layer saved: the push orders whose next parts it completes, each with how
        many of its parts are complete now (most layers complete none: nothing else happens)."""
        layer = self.layer_of.get(layer_name)
        if layer is None:
            return []
        self._step.saved.add(layer)
        completed = []
        for order in orders.ready:
            if order.params.mode is not Mode.PUSH:
                continue
            units = self._units(order)
            sent = complete = self._groups_sent.get(order.request_id, 0)
            while complete < len(units) and self._step.saved.issuperset(range(*units[complete][1])):
                complete += 1
            if complete > sent:
                completed.append((order, complete))
        return completed

    def _post_completed(self, completed: list[tuple[Order, int]]) -> None:
        """The parts a layer completes: handed over now (``push_posting`` "layer"), or kept with
        their device event until the forward has been enqueued (``"step"``: one pass over
        every part of the step, each still waiting for its own event)."""
        gate = self.device.record()  # one device event for every part this layer completes
        if self.settings.push_posting == "step":
            self._step.held.append((gate, completed))
            return
        self._hand_over(completed, gate)

    def _hand_over(self, completed: list[tuple[Order, int]], gate: Gate | None) -> None:
        parts: list[_Part] = []
        for order, complete in completed:
            self._post_units(order, complete, parts)
        self._send_parts(parts, gate)

    def _save(self, orders: Orders) -> None:
        if not orders.ready:
            return
        for earlier, completed in self._step.held:  # "step" posting: the parts the layers completed
            self._hand_over(completed, earlier)
        self._step.held.clear()
        gate = self.device.record()
        pushed: list[_Part] = []
        for order in orders.ready:
            if order.reason:  # vLLM's block table lacks a block its rules say it holds
                log.error("%s: the KV of %s is not all there: %s", self.engine_id, order.request_id, order.reason)
            if order.params.mode is Mode.PUSH:
                self._post_units(order, len(self._units(order)), pushed)
                self._groups_sent.pop(order.request_id, None)
                continue
            parts = self._sending_parts(order)
            decode = order.params.decode  # None: a sequential router's transfer, for whichever D claims it
            d_tp = tp_sizes(order.params, Role.PREFILL, self.tp_size)[1] if parts and decode is not None else 0
            many = len(self.kv_groups) > 1
            for target, group, key in parts:
                blocks = order.blocks[group]
                if not blocks.ids or not self._opened(order.request_id, key):
                    continue
                reach = None if decode is None else Reach(decode, d_tp, target)
                layers = self.kv_groups[group].layers if many else None
                peer = None if reach is None else reach.name
                ready = KvReady(key, blocks.ids, first_position=blocks.first, layers=layers, mode=Mode.PULL, peer=peer)
                future = send_request(self._link(), ready, reach, gate)
                self._ready_starts.append((future, order.request_id, key))
        self._send_parts(pushed, gate)

    def _sending_parts(self, order: Order) -> list[tuple[int, int, TransferKey]]:
        """P: the part transfers this rank feeds for `order`'s request; none (or params it cannot
        use): kvflow takes no block, and the request is reported sent once vLLM says it finished."""
        request_id = order.request_id
        parts = self._step.parts.get(request_id)
        if parts is None:  # once per request and step, not once per part
            try:
                parts = self._parts(order.params, Role.PREFILL)
            except ConfigError as exc:
                parts = exc
            self._step.parts[request_id] = parts
        if isinstance(parts, ConfigError):
            log.error("%s: could not hand over the KV of %s: %s", self.engine_id, request_id, parts)
            parts = []
        if not parts and not self.pairs.has(request_id, Role.PREFILL):
            self._late_frees.add(request_id)
        return parts

    def _opened(self, request_id: str, key: TransferKey) -> bool:
        """Record that part `key` of the request gets its first blocks now (the request opens
        with its first part: until then kvflow holds nothing of it); False if it had."""
        if not self.pairs.has(request_id, Role.PREFILL):
            self.pairs.open(request_id, Role.PREFILL, [key], ())
        elif not self.pairs.add(request_id, Role.PREFILL, key):
            return False
        self._requests[(key, Role.PREFILL)] = request_id
        return True

    def _post_units(self, order: Order, upto: int, parts: list[_Part]) -> None:
        """Parts ``[sent, upto)`` of a push order, in order, for each D rank this rank feeds
        (each part of a group goes to that group's transfer), added to `parts`."""
        first = self._groups_sent.get(order.request_id, 0)
        if first >= upto:
            return
        self._groups_sent[order.request_id] = upto
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
                opened = self._opened(order.request_id, key)
                named = key in self._step.named  # the chunk's blocks go with its first group only
                self._step.named.add(key)
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
            self._link().command("post_groups", gate, going_on, always=True).add_done_callback(_log_if_failed)
        parts = [part for part in parts if part.key in starting]
        if not parts:
            return
        future = self._link().command("post_groups", gate, [part.wire for part in parts])
        firsts = {index: part for index, part in enumerate(parts) if part.opened}
        settled = {index: concurrent.futures.Future[Any]() for index in firsts}
        for index, part in firsts.items():
            self._ready_starts.append((settled[index], part.request_id, part.key))
        future.add_done_callback(partial(_settle_parts, settled))

    def _units(self, order: Order) -> list[tuple[int, tuple[int, int]]]:
        """The parts a push order's blocks go out in: the forward cut into as many stretches as
        ``push_layer_groups`` allows with at least ``push_group_bytes`` in each (one stretch for
        a small chunk: every WRITE costs the engine the same work whatever its size, and a
        small one gains nothing from starting before the forward ends).  Once per request and step."""
        units = self._step.units.get(order.request_id)
        if units is not None:
            return units
        count = self.settings.push_layer_groups
        if self.settings.push_group_bytes:
            moved = sum(len(part.ids) * group.count for part, group in zip(order.blocks, self.kv_groups, strict=False))
            count = max(1, min(count, -(-moved * self._page_bytes // self.settings.push_group_bytes)))
        units = self._unit_sets.get(count)
        if units is None:
            units = self._unit_sets[count] = push_units(self._run_order, self.kv_groups, count)
        self._step.units[order.request_id] = units
        return units
