"""Unit tests of the vLLM connector's pure decisions: request params, scheduler book and settings.

Why without vLLM's Scheduler: `SchedulerBook` and `Settings` are plain code, so every event order
vLLM may produce (including malformed requests) can be driven here in milliseconds, and a wrong
decision shows up as a named field or a broken invariant rather than a stuck engine.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvflow.control import wire
from kvflow.errors import ConfigError
from kvflow.integrations.vllm.mapping import Blocks, Order, Orders, SchedulerBook
from kvflow.integrations.vllm.params import MAX_REQUEST_TRANSFER_ID, MAX_TP, PeerRef, TransferParams
from kvflow.integrations.vllm.ranks import pair_transfer_id
from kvflow.layout.groups import KVGroup
from kvflow.protocol.messages import (
    MAX_EPOCH,
    MAX_TRANSFER_ID,
    Heartbeat,
    Ready,
    Registration,
    TransferKey,
    address_problem,
)
from kvflow.protocol.state import Mode
from tests.vllm_params import (
    BLOCK_SIZE,
    MISSING,
    d_params,
    entry,
    is_valid,
    must_parse,
    needed,
    p_params,
)

# ==================================================================== TransferParams.parse


@pytest.mark.parametrize(
    "params",
    [None, {}, {"do_remote_prefill": True}, {"do_remote_decode": True, "other": 1}, {"kvflow": None}],
)
def test_params_without_a_kvflow_entry_parse_to_none(params: dict[str, Any] | None) -> None:
    assert TransferParams.parse(params) is None


def test_parse_reads_every_field() -> None:
    parsed = TransferParams.parse({"kvflow": entry("abc", mode="pull")})
    assert parsed == TransferParams(
        "abc", 3, Mode.PULL, PeerRef("prefill", "tcp://10.0.0.1:5700"), PeerRef("decode", "tcp://10.0.0.2:5800")
    )


def test_parse_defaults_epoch_mode_and_addresses() -> None:
    raw = {"transfer_id": "t", "prefill": {"engine": "p"}, "decode": {"engine": "d"}}
    parsed = TransferParams.parse({"kvflow": raw})
    assert parsed == TransferParams("t", 1, Mode.PUSH, PeerRef("p", ""), PeerRef("d", ""))


engine_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,11}", fullmatch=True)
transfer_ids = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=MAX_REQUEST_TRANSFER_ID)
ips = st.ip_addresses().map(lambda ip: f"[{ip}]" if ip.version == 6 else str(ip))
addresses = st.just("") | st.builds("tcp://{}:{}".format, ips, st.integers(1, 65535))
valid_entries = st.fixed_dictionaries(
    {
        "transfer_id": transfer_ids,
        "epoch": st.integers(0, MAX_EPOCH),
        "mode": st.sampled_from(["push", "pull"]),
        "prefill": st.fixed_dictionaries({"engine": engine_ids, "address": addresses}),
        "decode": st.fixed_dictionaries({"engine": engine_ids, "address": addresses}),
    }
)
# What any HTTP client may put there: values near and past every bound the wire has.
hostile_values: st.SearchStrategy[Any] = (
    st.text(max_size=300)
    | st.text(st.sampled_from("a\ud800\x00 :/@[]."), max_size=20)
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([2**63 - 1, 2**63, 2**64, 2**64 - 1, -1, 0, 1.5, True, None, [], {}])
)
FIELDS = ("transfer_id", "epoch", "mode", "prefill.engine", "prefill.address", "prefill.tp_size", "decode.engine")
near_bounds = st.sampled_from(
    [2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -1]
    + ["x" * n for n in (MAX_REQUEST_TRANSFER_ID, MAX_REQUEST_TRANSFER_ID + 1, MAX_TRANSFER_ID, MAX_TRANSFER_ID + 1)]
)


def with_one_hostile(raw: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    out = {**raw, "prefill": dict(raw["prefill"]), "decode": dict(raw["decode"])}
    if "." in field:
        side, key = field.split(".")
        out[side][key] = value
    else:
        out[field] = value
    return out


# A well-formed entry with one field replaced by what a hostile client might send there.
hostile_entries = st.builds(with_one_hostile, valid_entries, st.sampled_from(FIELDS), hostile_values | near_bounds)


@settings(max_examples=500)
@given(raw=hostile_entries)
def test_whatever_the_parser_accepts_the_wire_carries(raw: dict[str, Any]) -> None:
    # Any HTTP client of vLLM's server sets kv_transfer_params: what the connector accepts must
    # encode (and decode to itself) in every message that will name it, the pairs' ids included.
    try:
        parsed = TransferParams.parse({"kvflow": raw})
    except ConfigError:
        return
    assert parsed is not None
    pair_id = pair_transfer_id(parsed.transfer_id, MAX_TP, MAX_TP, MAX_TP - 1, MAX_TP - 2)  # the longest suffix
    keys = (TransferKey(parsed.transfer_id, parsed.epoch), TransferKey(pair_id, parsed.epoch))
    for peer in (parsed.prefill, parsed.decode):
        if peer is not None and peer.address:
            assert address_problem(peer.address) is None
    for key in keys:
        for message in (Registration(key, (0, 1), 0, 30.0, 0), Heartbeat((key,)), Ready(key, (2,))):
            envelope = wire.Envelope(parsed.prefill.engine, 1, "d", 1, message, 1)
            assert wire.decode(wire.encode(envelope)) == envelope


@given(raw=valid_entries)
def test_valid_params_round_trip_through_to_params(raw: dict[str, Any]) -> None:
    parsed = TransferParams.parse({"kvflow": raw, "do_remote_prefill": True})
    assert parsed is not None
    assert parsed.to_params() == raw
    assert TransferParams.parse({"kvflow": parsed.to_params()}) == parsed


@pytest.mark.parametrize(
    ("kv", "field"),
    [
        ("not a mapping", "kvflow must be a mapping"),
        (["transfer_id", "t"], "kvflow must be a mapping"),
        (entry(transfer_id=MISSING), "kvflow.transfer_id"),
        (entry(""), "kvflow.transfer_id"),
        (entry(transfer_id=7), "kvflow.transfer_id"),
        (entry(transfer_id=None), "kvflow.transfer_id"),
        (entry(epoch=-1), "kvflow.epoch"),
        (entry(epoch="1"), "kvflow.epoch"),
        (entry(epoch=1.0), "kvflow.epoch"),
        (entry(epoch=True), "kvflow.epoch"),
        (entry(epoch=None), "kvflow.epoch"),
        (entry(epoch=2**63), "kvflow.epoch"),  # msgpack carries it, the heartbeat's packed uint64 too,
        (entry(epoch=2**64), "kvflow.epoch"),  # but not the int64 of a registration; past 64 bits nothing
        (entry("x" * (MAX_REQUEST_TRANSFER_ID + 1)), "kvflow.transfer_id"),  # no room for a rank pair's suffix
        (entry("a\ud800b"), "kvflow.transfer_id"),  # JSON's "\ud800": no UTF-8 for it
        (entry(prefill={"engine": "p\x00"}), "kvflow.prefill.engine"),
        (entry(prefill={"engine": "p", "address": "tcp://prefill.example:5700"}), "kvflow.prefill.address"),
        (entry(prefill={"engine": "p", "address": "tcp://127.0.0.1;10.0.0.1:5700"}), "kvflow.prefill.address"),
        (entry(decode={"engine": "d", "address": "tcp://256.0.0.1:5800"}), "kvflow.decode.address"),
        (entry(mode="PUSH"), "kvflow.mode"),
        (entry(mode=""), "kvflow.mode"),
        (entry(mode=None), "kvflow.mode"),
        (entry(mode=["push"]), "kvflow.mode"),
        (entry(prefill=MISSING), "kvflow.prefill.engine"),
        (entry(prefill="prefill"), "kvflow.prefill.engine"),
        (entry(prefill={"address": "tcp://a:1"}), "kvflow.prefill.engine"),
        (entry(prefill={"engine": ""}), "kvflow.prefill.engine"),
        (entry(prefill={"engine": 3}), "kvflow.prefill.engine"),
        (entry(prefill={"engine": "p", "address": 5700}), "kvflow.prefill.address"),
        (entry(decode=MISSING), "kvflow.decode.engine"),
        (entry(decode=["decode"]), "kvflow.decode.engine"),
        (entry(decode={"engine": None}), "kvflow.decode.engine"),
        (entry(decode={"engine": "d", "address": None}), "kvflow.decode.address"),
        (entry(decode={"engine": "d", "address": ["tcp://a:1"]}), "kvflow.decode.address"),
        (entry(decode={"engine": "d", "address": "10.0.0.2:5800"}), "kvflow.decode.address"),
        (entry(decode={"engine": "d", "address": "ipc:///tmp/kvflow"}), "kvflow.decode.address"),
        (entry(decode={"engine": "d", "address": "tcp://h:0"}), "kvflow.decode.address"),
        (entry(decode={"engine": "d", "address": "tcp://h:65536"}), "kvflow.decode.address"),
        (entry(decode={"engine": "d", "address": "tcp://h:\u00b2"}), "kvflow.decode.address"),  # superscript two
        (entry(prefill={"engine": "p", "address": "tcp://h:\u0663"}), "kvflow.prefill.address"),  # Arabic three
        (entry(prefill={"engine": "p", "address": "tcp://h :1"}), "kvflow.prefill.address"),
    ],
)
def test_malformed_params_raise_config_error_naming_the_field(kv: Any, field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"kv_transfer_params.{field}")):
        TransferParams.parse(d_params(kv))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
entry_keys = st.sampled_from(["transfer_id", "epoch", "mode", "prefill", "decode", "engine", "address"])


@given(
    base=valid_entries,
    changes=st.dictionaries(entry_keys, json_values, max_size=3),
    dropped=st.sets(entry_keys, max_size=2),
)
def test_parse_of_any_json_entry_returns_params_or_raises_config_error(
    base: dict[str, Any], changes: dict[str, Any], dropped: set[str]
) -> None:
    raw = {k: v for k, v in {**base, **changes}.items() if k not in dropped}
    try:
        parsed = TransferParams.parse({"kvflow": raw})
    except ConfigError:
        return
    assert parsed is not None
    assert parsed.transfer_id == raw["transfer_id"] and parsed.mode is Mode(raw.get("mode", "push"))


@given(kv=json_values)
def test_a_non_entry_kvflow_value_is_refused_or_none(kv: Any) -> None:
    if kv is None:
        assert TransferParams.parse({"kvflow": kv}) is None
    else:
        with pytest.raises(ConfigError):
            TransferParams.parse({"kvflow": kv})


# ==================================================================== Orders


def test_orders_are_truthy_only_with_an_order() -> None:
    params = must_parse({"kvflow": entry()})
    assert not Orders()
    assert Orders(expect=[Order("r", params)])
    assert Orders(ready=[Order("r", params)])
    assert Orders(abort=[Order("r", params, reason="x")])


# ==================================================================== SchedulerBook: decode side


@pytest.mark.parametrize("block_size", [0, -4])
def test_book_refuses_a_non_positive_block_size(block_size: int) -> None:
    with pytest.raises(ConfigError, match="block_size"):
        SchedulerBook(block_size)


def expect_one(orders: Orders, kind: str) -> Order:
    lists = {"expect": orders.expect, "ready": orders.ready, "abort": orders.abort}
    assert len(lists[kind]) == 1, orders
    assert all(not v for k, v in lists.items() if k != kind), orders
    return lists[kind][0]


def waiting_decode(book: SchedulerBook, rid: str = "d1", prompt_len: int = 10) -> dict[str, Any]:
    """A D request whose expect order went out: it waits for its KV."""
    params = d_params(entry())
    assert book.matched_tokens(rid, params, prompt_len, 0) == (prompt_len, True)
    book.allocated(rid, params, prompt_len, [[7, 8, 9, 10, 11]], prompt_len)
    order = expect_one(book.take_orders(), "expect")
    assert order.request_id == rid and order.blocks == (Blocks(0, (7, 8, 9, 10, 11)[: needed(prompt_len)]),)
    return params


def test_decode_request_lifecycle_when_the_kv_lands() -> None:
    book = SchedulerBook(BLOCK_SIZE)
    params = d_params(entry())
    assert book.matched_tokens("d1", params, 10, 2) == (8, True)
    assert book.matched_tokens("d1", params, 10, 2) == (8, True)  # side-effect free
    assert book.tracked() == 0 and not book.pending_work() and not book.take_orders()

    book.allocated("d1", params, 10, [[5, 6, 7, 8]], 8)
    assert book.tracked() == 1 and book.pending_work()
    order = expect_one(book.take_orders(), "expect")
    assert order == Order("d1", must_parse(params), (Blocks(0, (5, 6, 7)),))  # ceil(10 / 4) blocks
    assert book.pending_work(), "the expect order is out: the KV has not arrived yet"

    book.allocated("d1", params, 10, [[5, 6, 7, 8]], 8)  # vLLM calls it again: nothing new
    assert not book.take_orders() and book.tracked() == 1
    assert book.matched_tokens("d1", params, 10, 2) == (0, False)  # its one load was ordered

    book.output(set(), {"d1"}, set())
    assert book.tracked() == 1 and not book.pending_work()
    assert book.finished("d1", aborted=False) == (False, None)
    assert book.tracked() == 0 and not book.pending_work() and not book.take_orders()


@pytest.mark.parametrize(
    ("params", "prompt_len", "computed"),
    [
        ({"kvflow": entry()}, 10, 0),  # no do_remote_prefill
        ({"do_remote_prefill": False, "kvflow": entry()}, 10, 0),
        ({"do_remote_prefill": True}, 10, 0),  # no kvflow entry
        (d_params(entry()), 10, 10),  # every token computed already
        (d_params(entry()), 8, 9),
    ],
)
def test_decode_requests_with_nothing_to_load_match_no_tokens(
    params: dict[str, Any], prompt_len: int, computed: int
) -> None:
    book = SchedulerBook(BLOCK_SIZE)
    assert book.matched_tokens("d1", params, prompt_len, computed) == (0, False)
    book.allocated("d1", params, prompt_len, [[1, 2, 3]], 0)
    orders = book.take_orders()
    assert book.tracked() == 0 and not book.pending_work()
    if params.get("do_remote_prefill") and "kvflow" in params:  # D computes it all: P is told it needs nothing
        assert expect_one(orders, "expect").block_count == 0
    else:
        assert not orders


def test_allocation_without_external_tokens_or_flag_loads_nothing() -> None:
    """Without the flag nothing is ordered; without external tokens (vLLM loads nothing: D
    computes the request) only an empty registration tells P to release, and nothing is tracked."""
    book = SchedulerBook(BLOCK_SIZE)
    book.allocated("d1", d_params(entry()), 10, [[1, 2, 3]], 0)
    book.allocated("d2", {"kvflow": entry()}, 10, [[1, 2, 3]], 10)
    order = expect_one(book.take_orders(), "expect")
    assert (order.request_id, order.block_count) == ("d1", 0)
    assert book.tracked() == 0 and not book.pending_work()


@pytest.mark.parametrize(
    ("aborted", "reason"), [(True, "decode request aborted"), (False, "decode request ended before its KV arrived")]
)
def test_decode_request_ended_while_waiting_is_aborted_and_freed_late(aborted: bool, reason: str) -> None:
    book = SchedulerBook(BLOCK_SIZE)
    params = waiting_decode(book)
    assert book.finished("d1", aborted=aborted) == (True, None)  # delay_free: kvflow may still write
    assert book.pending_work() and book.tracked() == 1
    order = expect_one(book.take_orders(), "abort")
    assert order.request_id == "d1" and order.params == must_parse(params) and order.reason == reason
    assert book.pending_work(), "its blocks are held until the workers release them"
    book.output({"d1"}, set(), set())
    assert book.tracked() == 0 and not book.pending_work() and not book.take_orders()


@pytest.mark.parametrize("aborted", [True, False])
def test_decode_request_ended_before_allocation_tells_prefill_and_holds_nothing(aborted: bool) -> None:
    book = SchedulerBook(BLOCK_SIZE)
    kv = entry("t9")
    book.new_request("d9", d_params(kv), 40)  # queued on D: no block yet
    # D's heartbeats list it from now on, so that P holds KV it made ready meanwhile
    orders = book.take_orders()
    assert orders.promise == [Order("d9", must_parse({"kvflow": kv}))] and not (orders.expect or orders.abort)
    assert book.tracked() == 1 and not book.pending_work()
    assert book.finished("d9", aborted=aborted) == (False, None)  # nothing of it is held
    order = expect_one(book.take_orders(), "abort")
    assert order.params == must_parse({"kvflow": kv}) and not order.allocated and not order.producer
    assert book.tracked() == 0 and not book.pending_work()


def test_a_request_that_ends_in_the_step_it_arrived_promises_nothing() -> None:
    book = SchedulerBook(BLOCK_SIZE)
    for rid, params in (("d", d_params(entry("t1"))), ("p", p_params(entry("t2")))):
        book.new_request(rid, params, 40)
        book.finished(rid, aborted=True)
    orders = book.take_orders()
    assert not orders.promise and [o.request_id for o in orders.abort] == ["d", "p"]


def test_decode_request_allocated_after_new_request_registers_once() -> None:
    book = SchedulerBook(BLOCK_SIZE)
    kv = entry("t10")
    book.new_request("d10", d_params(kv), 40)
    book.allocated("d10", d_params(kv), 40, [[1, 2, 3]], 40)
    assert expect_one(book.take_orders(), "expect").blocks == (Blocks(0, (1, 2, 3)),)
    book.allocated("d10", d_params(kv), 40, [[1, 2, 3]], 40)  # vLLM calls it again after the load
    assert not book.take_orders()
    assert book.finished("d10", aborted=True) == (True, None)  # allocated: freed once released
    assert expect_one(book.take_orders(), "abort").allocated


def test_decode_request_ended_while_waiting_is_untracked_by_a_failed_release() -> None:
    book = SchedulerBook(BLOCK_SIZE)
    waiting_decode(book)
    book.finished("d1", aborted=True)
    book.take_orders()
    book.output(set(), {"d1"}, {"d1"})  # the registration never started: reported as a failed load
    assert book.tracked() == 0 and not book.pending_work()


def test_decode_request_ended_while_its_kv_lands_is_untracked_by_finished_recving() -> None:
    """vLLM frees a finished request's blocks on finished_recving: the book must let go too."""
    book = SchedulerBook(BLOCK_SIZE)
    waiting_decode(book)
    assert book.finished("d1", aborted=True) == (True, None)
    book.take_orders()
    book.output(set(), {"d1"}, set())  # the KV landed before the worker saw the abort
    assert book.tracked() == 0 and not book.pending_work()


def test_failed_load_untracks_the_request_and_it_is_recomputed_locally() -> None:
    book = SchedulerBook(BLOCK_SIZE)
    params = waiting_decode(book)
    book.output(set(), {"d1"}, {"d1"})
    assert book.tracked() == 0 and not book.pending_work()
    assert book.matched_tokens("d1", params, 10, 0) == (0, False), "a second remote load was offered"
    book.allocated("d1", params, 10, [[1, 2, 3]], 0)
    assert not book.take_orders()
    assert book.finished("d1", aborted=False) == (False, None)
    assert not book.take_orders() and not book.pending_work()
    # the id is free again: a new request under it loads remotely
    assert book.matched_tokens("d1", params, 10, 0) == (10, True)


def test_reports_for_unknown_or_other_side_requests_change_nothing() -> None:
    book = SchedulerBook(BLOCK_SIZE)
    book.new_request("p1", p_params(entry("tp")), 8)
    waiting_decode(book, "d1")
    book.output({"x", "d1", "p1"}, {"x", "p1"}, {"x", "p1"})  # d1 is not late-freed; p1 produces
    assert book.tracked() == 2 and book.pending_work()
    book.output(set(), {"d1"}, set())
    assert book.tracked() == 2 and not book.pending_work()


# ==================================================================== SchedulerBook: prefill side


def test_prefill_request_lifecycle() -> None:
    book = SchedulerBook(BLOCK_SIZE)
    kv = entry("tp", mode="pull")
    book.new_request("p1", p_params(kv), 10)
    assert book.tracked() == 1 and not book.pending_work()
    # queued: P's heartbeats will say it holds the request, so that D keeps waiting for it
    orders = book.take_orders()
    assert orders.promise == [Order("p1", must_parse({"kvflow": kv}), producer=True)]
    assert not (orders.expect or orders.ready or orders.abort)

    book.scheduled("p1", 0, 6, [[3, 4]])  # a first chunk: the prefill is not done
    assert not book.take_orders() and not book.pending_work()
    book.scheduled("p1", 6, 4, [[3, 4, 5, 6]])
    assert book.pending_work()
    order = expect_one(book.take_orders(), "ready")
    assert order == Order("p1", must_parse({"kvflow": kv}), (Blocks(0, (3, 4, 5)),), producer=True)
    book.scheduled("p1", 10, 1, [[3, 4, 5, 6]])  # decode steps after it: no second order
    assert not book.take_orders()

    delay, out = book.finished("p1", aborted=False)
    assert delay is True
    assert out == {"kvflow": kv, "kvflow_prefill_finished": True}
    assert book.pending_work() and not book.take_orders()
    book.output({"p1"}, set(), set())
    assert book.tracked() == 0 and not book.pending_work()


def test_prefill_aborted_after_its_kv_was_ready_aborts_and_frees_late() -> None:
    book = SchedulerBook(BLOCK_SIZE)
    book.new_request("p1", p_params(entry("tp")), 5)
    book.scheduled("p1", 0, 5, [[1, 2]])
    book.take_orders()
    delay, out = book.finished("p1", aborted=True)
    assert delay is True and out is not None and out["kvflow"]["transfer_id"] == "tp"
    order = expect_one(book.take_orders(), "abort")
    assert order.request_id == "p1" and order.reason == "prefill request aborted"
    assert book.pending_work()
    book.output({"p1"}, set(), set())
    assert book.tracked() == 0 and not book.pending_work()


@pytest.mark.parametrize("aborted", [True, False])
def test_prefill_ended_before_its_kv_was_ready_tells_the_peer_and_holds_nothing(aborted: bool) -> None:
    book = SchedulerBook(BLOCK_SIZE)
    book.new_request("p1", p_params(entry("tp")), 10)
    assert book.take_orders().promise  # P promises the request to D at once
    book.scheduled("p1", 0, 3, [[1]])  # a first chunk that fills no block: nothing handed over
    assert not book.take_orders()
    assert book.finished("p1", aborted=aborted) == (False, None)
    assert book.tracked() == 0 and book.pending_work()  # the abort order is still to go out
    order = expect_one(book.take_orders(), "abort")
    assert order.request_id == "p1" and order.reason == "prefill request ended early"
    assert not book.pending_work()
    book.scheduled("p1", 4, 6, [[1, 2, 3]])  # a stray late step finds nothing to order
    assert not book.take_orders()


def test_prefill_sending_reported_before_it_finished_does_not_untrack_it() -> None:
    book = SchedulerBook(BLOCK_SIZE)
    book.new_request("p1", p_params(entry("tp")), 4)
    book.scheduled("p1", 0, 4, [[1]])
    book.take_orders()
    book.output({"p1"}, set(), set())
    assert book.tracked() == 1
    assert book.finished("p1", aborted=False)[0] is True


@pytest.mark.parametrize("params", [{"kvflow": entry()}, {"do_remote_decode": False, "kvflow": entry()}, None])
def test_prefill_without_remote_decode_is_not_tracked(params: dict[str, Any] | None) -> None:
    book = SchedulerBook(BLOCK_SIZE)
    book.new_request("p1", params, 8)
    book.scheduled("p1", 0, 8, [[1, 2]])
    assert book.tracked() == 0 and not book.take_orders()
    assert book.finished("p1", aborted=False) == (False, None)


# ==================================================================== SchedulerBook: refused params


@pytest.mark.parametrize(
    ("kv", "field"),
    [
        ("junk", "kvflow must be a mapping"),
        (entry(epoch=-2), "kvflow.epoch"),
        (entry(mode="sideways"), "kvflow.mode"),
        (entry(decode={"engine": ""}), "kvflow.decode.engine"),
    ],
)
def test_malformed_params_are_refused_once_and_the_request_runs_locally(
    kv: Any, field: str, caplog: pytest.LogCaptureFixture
) -> None:
    book = SchedulerBook(BLOCK_SIZE)
    with caplog.at_level(logging.ERROR, logger="kvflow.vllm"):
        assert book.matched_tokens("d1", d_params(kv), 10, 0) == (0, False)
        assert book.matched_tokens("d1", d_params(kv), 10, 0) == (0, False)
        book.allocated("d1", d_params(kv), 10, [[1, 2, 3]], 10)
        book.new_request("p1", p_params(kv), 10)
        book.scheduled("p1", 0, 10, [[1, 2, 3]])
    assert book.tracked() == 0 and not book.take_orders() and not book.pending_work()
    assert set(book.refused) == {"d1", "p1"}
    assert all(f"kv_transfer_params.{field}" in why for why in book.refused.values())
    records = [r for r in caplog.records if r.name == "kvflow.vllm"]
    assert len(records) == 2, "each refused request is logged exactly once"
    assert {r.levelno for r in records} == {logging.ERROR}
    assert "d1" in records[0].getMessage() and field in records[0].getMessage()

    assert book.finished("d1", aborted=False) == (False, None)
    assert set(book.refused) == {"p1"}
    assert book.finished("p1", aborted=True) == (False, None)
    assert book.refused == {} and not book.take_orders() and not book.pending_work()


def test_a_refused_request_does_not_disturb_a_valid_one() -> None:
    book = SchedulerBook(BLOCK_SIZE)
    book.matched_tokens("bad", d_params(entry(transfer_id=5)), 10, 0)
    waiting_decode(book, "good")
    book.output(set(), {"good"}, set())
    assert book.tracked() == 1 and set(book.refused) == {"bad"}
    assert book.finished("good", aborted=False) == (False, None)
    assert set(book.refused) == {"bad"}


def test_with_prefix_caching_d_registers_only_the_blocks_after_its_hit() -> None:
    """vLLM hands `update_state_after_alloc` all of the request's blocks, its local hit's first:
    D registers the rest, from the hit's block position; P's orders are unchanged."""
    book = SchedulerBook(BLOCK_SIZE, prefix_caching=True)
    params = d_params(entry("td"))
    prompt = 3 * BLOCK_SIZE + 2
    assert book.matched_tokens("d1", params, prompt, BLOCK_SIZE) == (prompt - BLOCK_SIZE, True)
    book.allocated("d1", params, prompt, [[1, 2, 3, 4, 5]], prompt - BLOCK_SIZE)
    order = expect_one(book.take_orders(), "expect")
    assert order.blocks == (Blocks(1, (2, 3, 4)),)
    book.allocated("d1", params, prompt, [[1, 2, 3, 4, 5]], 0)  # again, after the load: nothing new
    assert not book.take_orders() and not book.refused
    book.new_request("p1", p_params(entry("tp")), 10)
    book.scheduled("p1", 0, 10, [[4, 5, 6]])
    assert expect_one(book.take_orders(), "ready").blocks == (Blocks(0, (4, 5, 6)),)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_full_hit_loads_nothing_and_tells_p_so_once(mode: str) -> None:
    """Only the prompt's last token is missing (vLLM recomputes it anyway): push loads nothing,
    the request is not tracked (vLLM expects no load result for it), and one empty expect order
    tells P to release; pull loads that last block (P needs D's read to release)."""
    book = SchedulerBook(BLOCK_SIZE, prefix_caching=True)
    params = d_params(entry("td", mode=mode))
    prompt = 2 * BLOCK_SIZE + 1
    if mode == "pull":
        assert book.matched_tokens("d1", params, prompt, 2 * BLOCK_SIZE) == (1, True)
        return
    assert book.matched_tokens("d1", params, prompt, 2 * BLOCK_SIZE) == (0, False)
    book.allocated("d1", params, prompt, [[1, 2, 3]], 0)
    order = expect_one(book.take_orders(), "expect")
    assert order.blocks == (Blocks(3),)
    book.allocated("d1", params, prompt, [[1, 2, 3]], 0)  # scheduled again (preempted): told P already
    assert book.matched_tokens("d1", params, prompt, 0) == (0, False)
    assert not book.take_orders() and book.tracked() == 0 and not book.pending_work()
    assert book.finished("d1", aborted=False) == (False, None)


@given(kv=json_values | valid_entries.map(lambda e: {**e, "epoch": -1}))
def test_the_book_never_raises_on_any_kvflow_payload(kv: Any) -> None:
    book = SchedulerBook(BLOCK_SIZE)
    book.matched_tokens("d1", d_params(kv), 10, 0)
    book.allocated("d1", d_params(kv), 10, [[1, 2, 3]], 10)
    book.new_request("p1", p_params(kv), 10)
    book.scheduled("p1", 0, 10, [[1, 2, 3]])
    # no entry at all is refused too: D cannot pull without one, nor P (port 0) assign one
    assert bool(book.refused) is not (is_valid(d_params(kv)) and kv is not None)
    book.finished("d1", aborted=True)
    book.finished("p1", aborted=True)
    assert book.refused == {}


def test_push_hands_over_each_chunks_full_blocks_and_the_rest_at_the_end() -> None:
    """A 14-token prompt (4 blocks of 4) in chunks of 5: the first chunk fills block 0, the
    second block 1 (block 2 is partly filled: it waits), the final chunk sends blocks 2 and 3."""
    book = SchedulerBook(BLOCK_SIZE)
    kv = entry("tp")
    book.new_request("p1", p_params(kv), 14)
    blocks = [7, 8, 9, 6]
    params = must_parse({"kvflow": kv})
    seen = []
    for computed in (0, 5, 10):
        book.scheduled("p1", computed, min(5, 14 - computed), [blocks[: -(-(computed + 5) // BLOCK_SIZE)]])
        seen.append(expect_one(book.take_orders(), "ready"))
    assert seen == [
        Order("p1", params, (Blocks(0, (7,)),), producer=True, final=False),
        Order("p1", params, (Blocks(1, (8,)),), producer=True, final=False),
        Order("p1", params, (Blocks(2, (9, 6)),), producer=True, final=True),
    ]
    book.scheduled("p1", 14, 1, [blocks])  # decode steps after it: no further order
    assert not book.take_orders()
    assert book.finished("p1", aborted=False)[0] is True


def test_push_chunk_that_completes_no_block_orders_nothing() -> None:
    book = SchedulerBook(BLOCK_SIZE)
    book.new_request("p1", p_params(entry("tp")), 14)
    assert book.take_orders().promise  # P promises the request to D at once
    book.scheduled("p1", 0, 3, [[7]])
    assert not book.take_orders()
    book.scheduled("p1", 3, 3, [[7, 8]])  # block 7 now full
    assert expect_one(book.take_orders(), "ready").blocks == (Blocks(0, (7,)),)


def test_pull_orders_once_when_the_prompt_is_complete() -> None:
    book = SchedulerBook(BLOCK_SIZE)
    book.new_request("p1", p_params(entry("tp", mode="pull")), 14)
    assert book.take_orders().promise  # P promises the request to D at once
    book.scheduled("p1", 0, 8, [[7, 8]])
    assert not book.take_orders()
    book.scheduled("p1", 8, 6, [[7, 8, 9, 6]])
    order = expect_one(book.take_orders(), "ready")
    assert order.blocks == (Blocks(0, (7, 8, 9, 6)),) and order.final


@pytest.mark.parametrize("ended", ["finished", "aborted", "preempted"])
def test_push_cut_short_after_a_chunk_aborts_and_frees_late(ended: str) -> None:
    """The workers hold the first chunk's blocks: the transfer is aborted, and vLLM frees only
    once they report the blocks released.  A preempted request's recomputed chunks go nowhere."""
    book = SchedulerBook(BLOCK_SIZE)
    book.new_request("p1", p_params(entry("tp")), 14)
    book.scheduled("p1", 0, 5, [[7, 8]])
    assert expect_one(book.take_orders(), "ready").final is False
    if ended == "preempted":
        book.preempted("p1")
        assert expect_one(book.take_orders(), "abort").reason == "prefill request preempted: vLLM freed its blocks"
        book.preempted("p1")  # preempted again: nothing more to abort
        book.scheduled("p1", 0, 14, [[3, 4, 5, 6]])  # recomputed from scratch after it
        assert not book.take_orders()
    assert book.finished("p1", aborted=ended == "aborted") == (True, None)
    if ended != "preempted":
        assert expect_one(book.take_orders(), "abort").reason == "prefill request ended mid-prefill"
    assert book.pending_work()
    book.output({"p1"}, set(), set())
    assert book.tracked() == 0 and not book.pending_work()


def test_preempted_before_any_block_was_handed_over_starts_over() -> None:
    book = SchedulerBook(BLOCK_SIZE)
    book.new_request("p1", p_params(entry("tp")), 14)
    assert book.take_orders().promise  # P promises the request to D at once
    book.scheduled("p1", 0, 3, [[7]])
    book.preempted("p1")
    assert not book.take_orders()
    book.scheduled("p1", 0, 14, [[3, 4, 5, 6]])
    assert expect_one(book.take_orders(), "ready").blocks == (Blocks(0, (3, 4, 5, 6)),)


@pytest.mark.parametrize("params", [["do_remote_prefill"], "do_remote_decode", 7, ("kvflow",)])
def test_kv_transfer_params_that_are_not_a_mapping_are_refused_and_the_request_runs_locally(
    params: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # vLLM's offline API hands the connector whatever it was given as kv_transfer_params.
    book = SchedulerBook(BLOCK_SIZE)
    with caplog.at_level(logging.ERROR, "kvflow.vllm"):
        book.new_request("r", params, 10)
        assert book.matched_tokens("r", params, 10, 0) == (0, False)
        book.allocated("r", params, 10, [[0, 1, 2]], 0)
    assert book.counters["unservable"] == 1 and book.tracked() == 0
    assert "not a mapping" in book.refused["r"] and "not a mapping" in caplog.text
    assert book.finished("r", aborted=False) == (False, None)


# ---------------------------------------------------------------- KV cache groups (hybrid manager)

SLIDING = (KVGroup((0, 1), retained=7), KVGroup((1, 2)))  # a window of 8 tokens (blocks of 4), then full


def tables(prompt: int, computed: int, ids: int = 100) -> list[list[int | None]]:
    """Each group's table as vLLM's manager holds it after `computed` tokens: the full group a
    block per position, the sliding group null (None) for the blocks its window left."""
    blocks = -(-prompt // BLOCK_SIZE)
    gone = max(0, computed - 7) // BLOCK_SIZE
    return [[None] * gone + list(range(gone, blocks)), list(range(ids, ids + blocks))]


def test_p_hands_over_a_sliding_window_groups_blocks_only_from_the_first_its_window_keeps() -> None:
    """A 30-token prompt in chunks of 8: the full group's blocks go out chunk by chunk; the
    sliding group's only from position 5, the first block its window keeps once the prompt is
    computed, which vLLM never frees before the request ends.  (Earlier ones it frees between
    chunks and hands to other requests: P must never be able to read them for a WRITE.)"""
    book = SchedulerBook(BLOCK_SIZE, groups=SLIDING)
    book.new_request("p1", p_params(entry("tp")), 30)
    book.take_orders()
    sent: list[tuple[Blocks, ...]] = []
    for computed in range(0, 30, 8):
        book.scheduled("p1", computed, min(8, 30 - computed), tables(30, computed))
        sent += [order.blocks for order in book.take_orders().ready]
    assert min(sliding.first for sliding, _ in sent if sliding.ids) == 5
    assert [block for sliding, _ in sent for block in sliding.ids] == [5, 6, 7]
    assert [block for _, full in sent for block in full.ids] == list(range(100, 108))


def test_d_registers_each_groups_blocks_after_its_hit_and_within_its_window() -> None:
    book = SchedulerBook(BLOCK_SIZE, groups=SLIDING)
    params = d_params(entry("t1"))
    book.allocated("d1", params, 30, tables(30, 30), 30 - 2 * BLOCK_SIZE)  # a hit of 2 blocks
    assert expect_one(book.take_orders(), "expect").blocks == (Blocks(5, (5, 6, 7)), Blocks(2, tuple(range(102, 108))))


def test_a_null_where_vllm_must_hold_a_block_fails_the_load_naming_the_group() -> None:
    book = SchedulerBook(BLOCK_SIZE, groups=SLIDING)
    held = tables(30, 30)
    held[0][6] = None  # vLLM's rule says position 6 is in the window
    book.allocated("d1", d_params(entry("t1")), 30, held, 30)
    order = expect_one(book.take_orders(), "expect")
    assert order.reason == "KV cache group 0 holds no block at position 6" and order.blocks[0] == Blocks(5, (5,))


MAMBA = (KVGroup((0, 1), state=True, scratch=1), KVGroup((1, 2)))  # a Mamba group (one scratch block), full


def test_with_mamba_state_d_loads_all_but_the_prompts_last_token_and_the_state_before_it() -> None:
    book = SchedulerBook(BLOCK_SIZE, groups=MAMBA)
    params = d_params(entry("t1"))
    assert book.replay == 1 and book.matched_tokens("d1", params, 10, 0) == (9, True)
    book.allocated("d1", params, 10, [[50, 51], [1, 2, 3]], 9)  # the state, then a scratch block
    assert expect_one(book.take_orders(), "expect").blocks == (Blocks(0, (50,)), Blocks(0, (1, 2, 3)))


def test_p_hands_the_state_over_with_the_prompts_last_chunk_only() -> None:
    """Every chunk rewrites the state: it goes out once, with the chunk that completes P's
    (shortened) prompt; the attention blocks chunk by chunk."""
    book = SchedulerBook(BLOCK_SIZE, groups=MAMBA)
    book.new_request("p1", p_params(entry("tp")), 9)  # the connector left the 10th token for D
    book.take_orders()
    book.scheduled("p1", 0, 5, [[50, 51], [1, 2]])
    assert expect_one(book.take_orders(), "ready").blocks == (Blocks(0), Blocks(0, (1,)))
    book.scheduled("p1", 5, 4, [[50, 51], [1, 2, 3]])
    order = expect_one(book.take_orders(), "ready")
    assert order.final and order.blocks == (Blocks(0, (50,)), Blocks(1, (2, 3)))
    book.scheduled("p2", 0, 9, [[], [1, 2, 3]])  # untracked: nothing
    assert not book.take_orders()


def test_a_chunk_with_no_block_in_any_groups_window_hands_nothing_over() -> None:
    """Every layer slides: the first chunk's blocks are all before the window (positions 0..1,
    the window keeps from 5), so no order goes out; ended then, the request is not held."""
    book = SchedulerBook(BLOCK_SIZE, groups=(KVGroup((0, 2), retained=7),))
    book.new_request("p1", p_params(entry("tp")), 30)
    book.take_orders()
    book.scheduled("p1", 0, 8, [tables(30, 0)[0]])
    assert not book.take_orders().ready
    assert book.finished("p1", aborted=True) == (False, None)  # nothing to hold: vLLM frees now
    assert expect_one(book.take_orders(), "abort").reason == "prefill request ended early"
