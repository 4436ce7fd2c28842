"""Whom an engine may dial and associate with: the allow-list, where a peer is named.

A request's ``kv_transfer_params`` (any HTTP client's) name the P that D dials, and a Hello (any
secret holder's) names the address an engine answers at.  Before the allow-list, one request
made D dial whatever host it named, and a Hello made P answer wherever its sender liked.
"""

from __future__ import annotations

import os
import resource
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.control.zeromq import ZmqControl
from kvflow.errors import ConfigError, PeerNotAllowed, PeerProtocolError
from kvflow.integrations.vllm.mapping import SchedulerBook
from kvflow.integrations.vllm.settings import Settings
from kvflow.layout import fingerprint
from kvflow.protocol.admission import PeerAllowList
from kvflow.protocol.association import Associations
from kvflow.protocol.messages import Hello
from kvflow.protocol.peer_actions import AddRoute, HandshakeSettled, Refused, SendHello
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow_tools.testing import SMALL_SPEC, KVBuffers
from tests import handshakes
from tests.hostile import CONFIG, SECRET, Zmq, hello, signed
from tests.waiting import eventually

PUBLIC = "tcp://8.8.8.8:5700"


def params(prefill: str = "prefill-0", address: str = "tcp://10.0.0.1:5700") -> dict[str, object]:
    kvflow = {"transfer_id": "t1", "epoch": 1, "mode": "push"}
    kvflow |= {"prefill": {"engine": prefill, "address": address}, "decode": {"engine": "decode-0", "address": ""}}
    return {"do_remote_prefill": True, "kvflow": kvflow}


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("tcp://127.0.0.1:5700", True),
        ("tcp://10.232.0.1:5700", True),
        ("tcp://192.168.1.9:1", True),
        ("tcp://[::1]:5700", True),
        ("tcp://[fd00::1]:5700", True),
        ("ipc:///tmp/x", True),
        ("", True),
        (PUBLIC, False),
        ("tcp://192.0.2.1:5700", False),
        ("tcp://[2001:db8::1]:5700", False),
        ("tcp://example.com:5700", False),
    ],
)
def test_the_default_permits_loopback_link_local_and_private_networks_only(address: str, allowed: bool) -> None:
    problem = PeerAllowList().problem("any-engine", address)
    assert (problem is None) is allowed
    if not allowed:
        assert problem is not None and address.removeprefix("tcp://")[:6] in problem  # names the address


def test_engine_ids_are_matched_by_pattern_and_networks_narrow_the_addresses() -> None:
    allowed = PeerAllowList(("prefill-*", "decode-0"), ("10.1.0.0/16",))
    assert allowed.problem("prefill-3", "tcp://10.1.2.3:5700") is None
    assert allowed.problem("decode-0", "") is None
    assert "not among the allowed peers" in (allowed.problem("decode-1", "") or "")
    assert "outside the allowed networks" in (allowed.problem("prefill-3", "tcp://10.2.0.1:5700") or "")


@pytest.mark.parametrize(
    ("engines", "networks", "named"),
    [
        ((), ("10.0.0.0/8",), "allowed_peers"),
        (("*",), (), "allowed_networks"),
        (("*",), ("10.0.0.1/8",), "10.0.0.1/8"),  # host bits set: a typo, not a network
        (("*",), ("ten",), "ten"),
        (("x" * 129,), ("10.0.0.0/8",), "1 to 128"),
    ],
)
def test_a_malformed_allow_list_is_refused_naming_the_entry(
    engines: tuple[str, ...], networks: tuple[str, ...], named: str
) -> None:
    with pytest.raises(ConfigError, match=named.replace("*", r"\*")):
        PeerAllowList(engines, networks)


@given(st.text(max_size=40), st.text(max_size=60))
def test_any_peer_and_address_get_an_answer_never_an_exception(engine: str, address: str) -> None:
    PeerAllowList(("p*",), ("10.0.0.0/8",)).problem(engine, address)


# ---------------------------------------------------------------- the pure associations


def test_a_connect_to_a_peer_not_permitted_settles_at_once_and_dials_nothing() -> None:
    assoc = Associations("D", {}, 30.0, 5.0, allowed=PeerAllowList(("P*",)))
    for peer, address in (("P", PUBLIC), ("Q", "tcp://127.0.0.1:5700")):
        actions = assoc.connect(peer, address)
        assert not [a for a in actions if isinstance(a, AddRoute | SendHello)]
        (settled,) = [a for a in actions if isinstance(a, HandshakeSettled)]
        assert isinstance(settled.error, PeerNotAllowed)


def test_a_hello_from_a_peer_not_permitted_is_refused_without_an_answer() -> None:
    assoc = Associations("P", {}, 30.0, 5.0, allowed=PeerAllowList(("D*",)))
    for sender, address in (("D1", PUBLIC), ("M", "tcp://127.0.0.1:5800")):
        actions = assoc.receive(sender, 1, hello(sender, address), 0.0)
        refused, settled = actions
        assert isinstance(refused, Refused) and isinstance(settled, HandshakeSettled)
        assert isinstance(refused.error, PeerNotAllowed) and handshakes.kept(assoc, "adding") == {}


def test_a_lasting_refusal_abandons_what_waits_for_the_peer_and_a_passing_one_does_not() -> None:
    """Refused for good (not permitted, another layout), the peer's transfers here can never be
    served: they fail at once.  Refused for now (the peer limit, a teardown cooling off), the
    peer's next handshake may well succeed: they wait."""

    def refusal(assoc: Associations, message: Hello) -> Refused:
        (refused,) = [a for a in assoc.receive("D1", 1, message, 0.0) if isinstance(a, Refused)]
        return refused

    ours = fingerprint(SMALL_SPEC)
    assert refusal(Associations("P", ours, 30.0, 5.0, allowed=PeerAllowList(("Q*",))), hello("D1", "")).abandon
    other = replace(hello("D1", ""), fingerprint={**ours, "model": "another"})
    assert refusal(Associations("P", ours, 30.0, 5.0), other).abandon
    assert not refusal(Associations("P", ours, 30.0, 5.0, max_peers=0), hello("D1", "")).abandon
    cooling = Associations("P", ours, 30.0, 5.0, grace=10.0)
    assert cooling.teardowns.torn_down("D1", "test", 0.0, answered=False)  # D1 cools: its removal is under way
    assert not refusal(cooling, hello("D1", "")).abandon


# ---------------------------------------------------------------- an engine over ZeroMQ


@pytest.mark.asyncio
async def test_an_engine_never_dials_an_address_outside_its_networks(zmq_p: Zmq) -> None:
    engine = zmq_p
    control = engine.p.control
    assert isinstance(control, ZmqControl)
    with pytest.raises(PeerNotAllowed, match="8.8.8.8"):
        await engine.p.connect("ghost", PUBLIC, timeout=5)
    engine.fabric.endpoint("M")
    engine.dealer("M").send_multipart(signed("M", "P", hello("M", "tcp://192.0.2.7:5800")))
    await eventually(lambda: engine.p.stats()["peers_refused"] == 1 or bool(engine.p.crashed), "P decides on M")
    assert engine.p.crashed == [] and engine.p.peers() == [] and control.connections == 0


@pytest.mark.asyncio
async def test_an_engine_associates_only_with_the_engines_it_lists() -> None:
    engine = Zmq(EngineConfig(transfer_timeout=10.0, drain_timeout=1.0, allowed_peers=PeerAllowList(("Q",))))
    await engine.p.start()
    try:
        port = engine.sink()
        engine.fabric.endpoint("D")
        engine.dealer("D").send_multipart(signed("D", "P", hello("D", f"tcp://127.0.0.1:{port}")))
        await eventually(lambda: engine.p.stats()["peers_refused"] == 1 or bool(engine.p.crashed), "P decides on D")
        control = engine.p.control
        assert isinstance(control, ZmqControl) and control.connections == 0 and engine.p.peers() == []
    finally:
        await engine.close()


# ---------------------------------------------------------------- the vLLM connector


def test_the_connector_refuses_a_request_naming_a_p_it_may_not_dial() -> None:
    book = SchedulerBook(16, allowed=Settings.from_extra({"allowed_peers": ["prefill-*"]}).allow_list())
    assert book.matched_tokens("ok", params(), 64, 0) == (64, True)
    for request, p in (("public", params(address=PUBLIC)), ("stranger", params(prefill="evil"))):
        assert book.matched_tokens(request, p, 64, 0) == (0, False)  # computed locally
        assert "may not transfer with" in book.refused[request]
    assert book.counters["unservable"] == 2


def test_connector_settings_check_the_allow_list_and_name_the_key() -> None:
    with pytest.raises(ConfigError, match="10.0.0.1/8"):
        Settings.from_extra({"allowed_networks": ["10.0.0.1/8"]})
    with pytest.raises(ConfigError, match="allowed_peers"):
        Settings.from_extra({"allowed_peers": []})
    ranks = Settings.from_extra({"allowed_peers": ["prefill-0"]}).allow_list(ranks=True)
    assert ranks.problem("prefill-0-tp1", "") is None and ranks.problem("prefill-01-tp1", "") is not None


# ---------------------------------------------------------------- descriptors


async def associate(engine: Zmq, name: str) -> None:
    kv = KVBuffers(SMALL_SPEC, 16)
    d = Engine(name, kv.layout, engine.fabric.endpoint(name), ZmqControl(name, secret=SECRET), config=CONFIG)
    await d.start()
    try:
        await d.connect("P", engine.p.control.address, timeout=10)
    finally:
        await d.aclose()


@pytest.mark.asyncio
async def test_a_process_short_of_descriptors_refuses_a_new_peer_and_serves_the_next(
    zmq_p: Zmq, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Real descriptors held, under a limit of 1,024: 40 left, fewer than the Hello reserve (64) and
    # than what the control channel keeps free (96), with no idle connection to close: the new
    # peer's handshake is admitted and its Hello refused, naming the limit.
    engine = zmq_p
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    held: list[int] = []
    with monkeypatch.context() as patched:
        patched.setattr(resource, "getrlimit", lambda which: (1024, hard))
        null = os.open(os.devnull, os.O_RDONLY)
        held = [os.dup(null) for _ in range(1024 - 40 - len(os.listdir("/proc/self/fd")))]
        os.close(null)
        try:
            with pytest.raises(PeerProtocolError, match="file descriptors left"):
                await associate(engine, "D1")
        finally:
            for fd in held:
                os.close(fd)
    assert engine.p.crashed == [] and engine.p.peers() == [] and engine.p.stats()["peers_refused"] == 1
    await associate(engine, "D2")  # with room again, a peer associates
    assert engine.p.stats()["peers_refused"] == 1 and engine.p.crashed == []


# ---------------------------------------------------------------- names a request makes up


def test_an_engine_never_associates_with_itself() -> None:
    assoc = Associations("D", {}, 30.0, 5.0)
    (settled,) = [a for a in assoc.connect("D", "tcp://127.0.0.1:5800") if isinstance(a, HandshakeSettled)]
    assert isinstance(settled.error, PeerNotAllowed) and "this engine" in str(settled.error)


def test_a_connect_naming_another_engine_at_an_associated_peers_address_is_refused() -> None:
    # When routing ids were engine ids, a second connection under ours to that address took the
    # live one's place at the peer's socket (ZeroMQ's handover), dropping what it carried: a request
    # naming a made-up engine at P's address made D tear its association with P down.
    assoc = handshakes.associations()
    address = "tcp://127.0.0.1:5700"
    assoc.connect("P", address)
    handshakes.receive(assoc, "P", 1, handshakes.hello("P", reply=True), 0.0)  # P answers: associated
    assert assoc.peers() == ["P"]
    actions = assoc.connect("rogue", address)
    (settled,) = [a for a in actions if isinstance(a, HandshakeSettled)]
    assert isinstance(settled.error, PeerNotAllowed) and "control address of 'P'" in str(settled.error)
    assert not [a for a in actions if isinstance(a, AddRoute)]
    assert [type(a) for a in assoc.connect("Q", "tcp://127.0.0.1:5701")][0] is AddRoute  # another address


@pytest.mark.parametrize(
    "flags",
    [{"do_remote_prefill": True, "do_remote_decode": True}, {"do_remote_prefill": "tcp://[::1]:9"}],
    ids=["both roles", "not a boolean"],
)
def test_the_connector_refuses_params_that_are_not_one_role(flags: dict[str, object]) -> None:
    book = SchedulerBook(16)
    assert book.matched_tokens("r", {**params(), **flags}, 64, 0) == (0, False)
    assert "not one role" in book.refused["r"]
