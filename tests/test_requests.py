"""The engine's requests as typed values (`kvflow.protocol.requests`), and the one door they cross.

Every request survives its wire form, through msgpack as the engine process's ring packs it,
unchanged; a wire form that is not one (a field missing, unexpected or of the wrong type, a
type no request has, not a map) is refused with `MalformedRequest` naming what is wrong, by the
engine's agent, a vLLM rank's agent and an engine process alike, and nothing changes.  The
agents take the three requests through `submit` only: their old method names are gone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st

from kvflow.errors import MalformedRequest, UsageError
from kvflow.integrations.vllm.params import PeerRef
from kvflow.integrations.vllm.rank_agent import RankAgent, Reach
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.requests import REQUESTS, Abort, Expect, KvReady, Request, request_from_wire
from kvflow.protocol.state import Mode, Role
from kvflow.runtime.engine_agent import EngineAgent
from kvflow.runtime.frames import decode_record, encode_record
from kvflow.runtime.process import EngineProcess
from kvflow.transports.loopback import LoopbackFabric
from kvflow_tools.testing import EnginePair, same_kv
from tests.test_engine_process import answered, cache, engine
from tests.waiting import eventually

text = st.text(st.characters(codec="utf-8"), max_size=12)  # what msgpack carries (no lone surrogate)
number = st.integers(0, 2**63 - 1)
keys = st.builds(TransferKey, text, number)
blocks = st.lists(st.integers(0, 2**32), max_size=8)
layers = st.none() | st.tuples(st.integers(0, 64), st.integers(0, 64))
timeouts = st.none() | st.floats(0.001, 1e6, allow_nan=False)
requests: st.SearchStrategy[Request] = st.one_of(
    st.builds(Expect, keys, text, blocks, st.sampled_from(Mode), number, number, text, layers, timeouts),
    st.builds(KvReady, keys, blocks, st.booleans(), number, layers, st.sampled_from(Mode), st.none() | text, timeouts),
    st.builds(Abort, keys, st.sampled_from(Role), text, st.none() | text, st.sampled_from(Mode)),
)


@given(requests)
def test_every_request_survives_its_wire_form_through_msgpack(request: Request) -> None:
    wire = decode_record(encode_record(request.to_wire()))
    assert request_from_wire(wire) == request
    assert type(request_from_wire(request.to_wire())) is type(request)


@given(requests, st.data())
def test_a_wire_form_missing_a_field_or_with_one_more_is_refused_by_name(request: Request, data: st.DataObject) -> None:
    wire = request.to_wire()
    dropped = data.draw(st.sampled_from([field.name for field in dataclasses.fields(request)]))
    with pytest.raises(MalformedRequest, match=f"no field '{dropped}'"):
        request_from_wire({name: value for name, value in wire.items() if name != dropped})
    with pytest.raises(MalformedRequest, match="'spare' it does not take"):
        request_from_wire({**wire, "spare": 1})


BAD_FIELDS = [
    (Expect(TransferKey("t", 1), "P", [1]), "key", ["t", True], "key's epoch is not an int"),
    (Expect(TransferKey("t", 1), "P", [1]), "block_ids", [1, "2"], r"block_ids\[1\] is not an int"),
    (Expect(TransferKey("t", 1), "P", [1]), "block_ids", "1, 2", "block_ids is not a list of ints"),
    (Expect(TransferKey("t", 1), "P", [1]), "mode", "sideways", "mode is not one of"),
    (Expect(TransferKey("t", 1), "P", [1]), "layers", [0, 1, 2], "layers is not null or a"),
    (KvReady(TransferKey("t", 1), [1]), "final", 1, "final is not a bool"),
    (KvReady(TransferKey("t", 1), [1]), "timeout", "5", "timeout is not null or a number"),
    (KvReady(TransferKey("t", 1), [1]), "peer", 7, "peer is not a string"),
    (Abort(TransferKey("t", 1), Role.DECODE), "role", "router", "role is not one of"),
]


@pytest.mark.parametrize(("request_", "field", "value", "why"), BAD_FIELDS)
def test_a_field_of_the_wrong_type_is_refused_by_name(request_: Request, field: str, value: Any, why: str) -> None:
    with pytest.raises(MalformedRequest, match=why):
        request_from_wire({**request_.to_wire(), field: value})


@pytest.mark.parametrize(
    ("wire", "why"),
    [
        ({"request": "shutdown_everything"}, "type is not one of"),
        ({"key": ["t", 1]}, "type is not one of"),
        (["expect", "t", 1], "is not a map"),
        (None, "is not a map"),
    ],
)
def test_a_wire_form_of_no_request_type_is_refused(wire: Any, why: str) -> None:
    with pytest.raises(MalformedRequest, match=why):
        request_from_wire(wire)
    assert sorted(REQUESTS) == ["abort", "expect", "kv_ready"]


def test_a_rank_to_reach_survives_its_wire_form_and_a_broken_one_is_refused() -> None:
    reach = Reach(PeerRef("prefill", "tcp://10.0.0.1:5555", 2), 2, 1)
    assert Reach.from_wire(decode_record(encode_record(reach.to_wire()))) == reach
    assert reach.name == "prefill-tp1"
    for broken in (None, [["prefill", "a", 2], 2], [["prefill", "a", 2], True, 1], [["prefill", 1, 2], 2, 1]):
        with pytest.raises(MalformedRequest, match="a rank to reach"):
            Reach.from_wire(broken)


# ---------------------------------------------------------------- the door: agents and an engine process


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[EnginePair]:
    engines = await EnginePair(LoopbackFabric()).start()
    yield engines
    await engines.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("agent_class", [EngineAgent, RankAgent])
async def test_a_transfer_goes_through_the_agents_door_and_a_malformed_request_changes_nothing(
    pair: EnginePair, agent_class: type[EngineAgent]
) -> None:
    d, p = agent_class(pair.d), agent_class(pair.p)
    expect = Expect(TransferKey("door", 1), "P", [4, 5]).to_wire()
    broken: list[Any] = [
        {"request": "shutdown_everything"},
        {**expect, "block_ids": None},
        {name: value for name, value in expect.items() if name != "peer"},
    ]
    for wire in broken:
        with pytest.raises(MalformedRequest):
            await d.submit(wire)
    if isinstance(d, RankAgent):  # a request whose rank to reach is not one is refused whole
        with pytest.raises(MalformedRequest, match="a rank to reach"):
            await d.submit(expect, ["decode", 0])
    assert pair.d.core.machines() == [] and pair.d.core.ledger.held_blocks == 0 and not pair.d.crashed
    for gone in ("expect", "kv_ready", "abort", "expect_blocks", "ready_pull", "abort_pair"):
        assert gone not in d.COMMANDS
    pair.p_kv.fill([1, 2], seed=3)
    await d.submit(expect)
    await p.submit(KvReady(TransferKey("door", 1), [1, 2]).to_wire())
    await eventually(lambda: bool(pair.d.finished and pair.p.finished), "both sides finish")
    assert pair.d.finished[0].ok and pair.p.finished[0].ok
    assert same_kv(pair.p_kv, [1, 2], pair.d_kv, [4, 5])


@pytest.fixture(scope="module")
def process() -> Iterator[EngineProcess]:
    alone = engine("decode-0", cache())
    yield alone
    alone.close()


def test_an_engine_process_refuses_a_request_of_no_known_type_and_the_old_command_names(
    process: EngineProcess,
) -> None:
    unknown = process.call("submit", {"request": "shutdown_everything"})
    broken = process.call("submit", {"request": "expect", "key": ["t", 1]})
    named = process.call("expect", "t", 1, "prefill-0", [1], "push")
    answered(process, unknown, broken, named)
    refusals = [
        (unknown, MalformedRequest, "'shutdown_everything'"),
        (broken, MalformedRequest, "no field 'block_ids'"),
        (named, UsageError, "no command 'expect'"),
    ]
    for future, error, why in refusals:
        with pytest.raises(error, match=why):
            future.result()
    stats = process.call("stats")
    answered(process, stats)
    assert (stats.result()["live_transfers"], stats.result()["held_blocks"], stats.result()["crashed"]) == (0, 0, 0)
