"""P's first token on its way to D's sampler, piece by piece without vLLM.

The scheduler's book orders it sent once P's request finishes (only where the request asked,
never for an aborted one, never where P's prompt was shortened for Mamba state); the params
carry the ask; an engine sends it to an associated peer and keeps what peers send until its
host takes it (bounded, per sender); D's rank holds a request whose KV landed until its token
is there (asked for when it registered its blocks), or its wait ended, and puts the token
where the sampler takes it.  Real vLLM servers
check the whole way (`tests/real_first_token.py`, `d_continues_from_ps_token`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import pytest

from kvflow.errors import ConfigError, EngineClosed, PeerUnknown, UsageError
from kvflow.integrations.vllm.first_token import FirstTokenWaits, ForcedTokens, forced_transfer
from kvflow.integrations.vllm.mapping import Order, SchedulerBook
from kvflow.integrations.vllm.params import FIRST_TOKEN_ANSWER, TransferParams
from kvflow.layout.groups import KVGroup
from kvflow.protocol.messages import TransferKey
from kvflow.runtime.first_tokens import FirstTokens
from kvflow.transports.loopback import LinkModel, LoopbackFabric
from kvflow_tools.testing import EnginePair
from tests.vllm_params import BLOCK_SIZE, entry, must_parse, p_params

KEY = TransferKey("t", 1)

# ------------------------------------------------------------------ the ask, in the params


def test_the_params_carry_the_ask_as_a_bool_and_refuse_anything_else() -> None:
    asked = must_parse({"kvflow": entry(first_token=True)})
    assert asked.first_token and asked.to_params()["first_token"] is True
    assert TransferParams.parse({"kvflow": asked.to_params()}) == asked
    plain = must_parse({"kvflow": entry()})
    assert not plain.first_token and "first_token" not in plain.to_params()
    for bad in (1, "true", None, [True]):
        with pytest.raises(ConfigError, match="first_token must be true or false"):
            TransferParams.parse({"kvflow": entry(first_token=bad)})


# ------------------------------------------------------------------ P's scheduler


def finished_p(book: SchedulerBook, kv: dict[str, Any], token: int | None, aborted: bool = False) -> list[Order]:
    book.new_request("p1", p_params(kv), 8)
    book.scheduled("p1", 0, 8, [[3, 4]])
    book.take_orders()
    book.finished("p1", aborted, token)
    return book.take_orders().first


def test_p_orders_its_first_token_sent_once_its_request_finishes_where_the_request_asked() -> None:
    book = SchedulerBook(BLOCK_SIZE)
    book.new_request("p1", p_params(entry("tp", first_token=True)), 8)
    book.scheduled("p1", 0, 8, [[3, 4]])
    book.take_orders()
    book.finished("p1", aborted=False, first_token=77)
    book.output({"p1"}, set(), set())  # its KV went out too: nothing else is outstanding
    assert book.tracked() == 0 and book.pending_work()  # the engine steps again for the order
    orders = book.take_orders()
    assert [(o.request_id, o.token, o.producer) for o in orders.first] == [("p1", 77, True)]
    assert orders and not orders.expect + orders.ready + orders.abort + orders.promise
    assert not book.take_orders() and not book.pending_work()  # once


@pytest.mark.parametrize(
    ("kv", "token", "aborted", "groups"),
    [
        (entry("tp"), 77, False, ()),  # not asked
        (entry("tp", first_token=True), None, False, ()),  # no token sampled
        (entry("tp", first_token=True), 77, True, ()),  # aborted
        (entry("tp", first_token=True), 77, False, (KVGroup((0, 1)), KVGroup((1, 2), state=True))),  # Mamba
    ],
)
def test_no_first_token_goes_out_unasked_unsampled_aborted_or_from_a_shortened_prompt(
    kv: dict[str, Any], token: int | None, aborted: bool, groups: tuple[KVGroup, ...]
) -> None:
    book = SchedulerBook(BLOCK_SIZE, groups=groups)
    assert finished_p(book, kv, token, aborted) == []


def test_ps_answer_says_its_token_is_not_the_first_where_p_prefilled_all_but_the_last_token() -> None:
    mamba = (KVGroup((0, 1), state=True, scratch=1), KVGroup((1, 2)))  # as vLLM groups a Mamba hybrid
    for groups, tables, says in (((), [[3, 4]], None), (mamba, [[50, 51], [1, 2, 3]], False)):
        book = SchedulerBook(BLOCK_SIZE, groups=groups)
        book.new_request("p1", p_params(entry("tp", first_token=True)), 9)  # (Mamba: its 10th left to D)
        book.take_orders()
        book.scheduled("p1", 0, 9, tables)
        assert book.take_orders().ready
        _, answer = book.finished("p1", aborted=False, first_token=77)
        assert answer is not None and answer.get(FIRST_TOKEN_ANSWER) is says


# ------------------------------------------------------------------ an engine's tokens


@pytest.mark.asyncio
async def test_tokens_wait_for_their_taker_or_their_taker_for_them_per_sender() -> None:
    tokens = FirstTokens(kept=2)
    tokens.arrived("P", KEY, 5)
    assert await tokens.take("P", KEY, 0.0) == 5
    assert await tokens.take("P", KEY, 0.01) is None  # taken: asked again, waited for again
    waiting = asyncio.ensure_future(tokens.take("P", KEY, 5.0))
    await asyncio.sleep(0)
    with pytest.raises(UsageError, match="waited for already"):
        await tokens.take("P", KEY, 1.0)
    tokens.arrived("Q", KEY, 6)  # another sender's word is not P's
    assert not waiting.done()
    tokens.arrived("P", KEY, 7)
    assert await waiting == 7
    assert len(tokens) == 1  # Q's, kept
    for n in range(3):
        tokens.arrived("P", TransferKey(f"u{n}", 1), n)
    assert len(tokens) == 2 and tokens.dropped == 2  # bounded: the oldest went first
    assert await tokens.take("Q", KEY, 0.0) is None


@pytest.mark.asyncio
async def test_a_taker_still_waiting_when_the_engine_closes_hears_it() -> None:
    tokens = FirstTokens()
    waiting = asyncio.ensure_future(tokens.take("P", KEY, 5.0))
    await asyncio.sleep(0)
    tokens.closed()
    with pytest.raises(EngineClosed):
        await waiting


@pytest.mark.asyncio
async def test_an_engine_sends_its_peer_a_first_token_and_the_peer_keeps_it_for_its_host() -> None:
    pair = await EnginePair(LoopbackFabric(LinkModel(latency=1e-4))).start()
    try:
        pair.p.send_first_token("D", KEY, 1023)
        assert await pair.d.outcomes.tokens.take("P", KEY, 5.0) == 1023
        assert await pair.d.outcomes.tokens.take("P", KEY, 0.05) is None
        with pytest.raises(PeerUnknown, match="not associated"):
            pair.p.send_first_token("nobody", KEY, 1)
    finally:
        await pair.close()


# ------------------------------------------------------------------ D's rank


def answered(token: int | None) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(token)
    return future


def test_d_asks_at_registration_and_holds_a_landed_request_until_its_token_is_there() -> None:
    forced = ForcedTokens()
    waits = FirstTokenWaits(forced)
    pending: concurrent.futures.Future[Any] = concurrent.futures.Future()
    asked: list[tuple[str, TransferKey]] = []

    def ask(peer: str, key: TransferKey) -> concurrent.futures.Future[Any]:
        asked.append((peer, key))
        return pending

    waits.expect("r1", "t", "P_0", KEY, ask)
    assert asked == [("P_0", KEY)]  # at registration, not when the KV lands
    assert waits.hold({"r1", "r2"}, ()) == {"r2"}  # r2 waits for no token
    assert not waits.answered()
    assert waits.hold(set(), ()) == set()
    pending.set_result(42)
    assert waits.answered()
    assert waits.hold(set(), ()) == {"r1"}
    assert forced.take("t") == 42 and forced.take("t") is None
    assert waits.hold(set(), ()) == set() and len(asked) == 1


def test_a_token_there_before_the_kv_lands_costs_the_request_no_step() -> None:
    forced = ForcedTokens()
    waits = FirstTokenWaits(forced)
    waits.expect("r1", "t", "P_0", KEY, lambda peer, key: answered(42))
    assert not waits.answered()  # its KV has not landed: nothing to report yet
    assert waits.hold(set(), ()) == set()
    assert waits.hold({"r1"}, ()) == {"r1"} and forced.take("t") == 42


def test_d_lets_a_request_go_without_a_token_when_its_wait_ends_fails_or_vllm_ends_it() -> None:
    forced = ForcedTokens()
    waits = FirstTokenWaits(forced)
    failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
    failed.set_exception(EngineClosed("gone"))
    answers = {"late": answered(None), "failed": failed, "ended": concurrent.futures.Future(), "load failed": failed}

    def ask(peer: str, key: TransferKey) -> concurrent.futures.Future[Any]:
        return answers[key.transfer_id]

    for rid in answers:
        waits.expect(rid, rid, "P_0", TransferKey(rid, 1), ask)
    out = waits.hold({"late", "failed", "ended"}, ())
    assert out == {"late", "failed"} and waits.missed == 2 and len(forced) == 0
    assert waits.hold(set(), {"ended"}) == {"ended"}  # vLLM ended it: nothing left to sample
    waits.forget("load failed")  # its load failed: nothing to wait for
    assert waits.hold({"load failed"}, ()) == {"load failed"}
    waits.expect("held", "held", "P_0", TransferKey("held", 1), lambda peer, key: concurrent.futures.Future())
    assert waits.hold({"held"}, ()) == set()
    waits.forget("held")  # forgotten while held: neither reported nor waited for any more
    assert waits.hold(set(), ()) == set() and not waits.answered()
    assert len(forced) == 0 and waits.missed == 2


def test_the_sampler_reads_the_ask_from_the_requests_extra_args_and_nothing_else() -> None:
    asked = {"kv_transfer_params": {"do_remote_prefill": True, "kvflow": entry("tx", first_token=True)}}
    assert forced_transfer(asked) == "tx"
    for other in (
        None,
        {},
        {"kv_transfer_params": None},
        {"kv_transfer_params": {"kvflow": entry("tx")}},
        {"kv_transfer_params": {"kvflow": entry("tx", first_token="yes")}},
        {"kv_transfer_params": {"kvflow": entry(7, first_token=True)}},
        {"kv_transfer_params": {"kvflow": "tx"}},
    ):
        assert forced_transfer(other) is None
