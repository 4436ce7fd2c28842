"""What every peer shares, split so that many names cannot keep one more peer out.

Per-peer quotas bound one name; these tests are about several.  Before, four names at their
quota filled the registrations P keeps for everyone (a genuine D's registration was refused)
and the early-message pool (the oldest message, a genuine early ready, was pushed out first),
and what was kept was counted in messages: ready messages of many blocks added gigabytes.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.layout import fingerprint
from kvflow.protocol.actions import Action, SendMessage
from kvflow.protocol.association import EARLY_BLOCKS_KEPT, Associations
from kvflow.protocol.core import CoreConfig, TransferCore
from kvflow.protocol.messages import Message, Notice, Ready, Registration, TransferKey
from kvflow.protocol.peer_actions import AddTransportPeer, UnknownSender
from kvflow.protocol.requests import Expect
from kvflow.protocol.state import Mode, Outcome, Role, State
from kvflow_tools.testing import SMALL_SPEC
from tests.handshakes import hello

POOL = CoreConfig(fence_timeout=2.0, retention=30.0, max_unstarted=16, max_peer_transfers=4, max_peer_early=4)


def messages(actions: list[Action]) -> list[tuple[str, Message]]:
    return [(a.peer, a.message) for a in actions if isinstance(a, SendMessage)]


def register(p: TransferCore, peer: str, tid: str, blocks: int = 1) -> list[tuple[str, Message]]:
    return messages(p.receive(peer, Registration(TransferKey(tid, 1), tuple(range(blocks)), 1, 30.0), 0.0))


def test_names_at_their_quota_cannot_keep_a_lighter_peer_out_of_the_registrations() -> None:
    p = TransferCore("P", 2, POOL)
    for name in ("G0", "G1", "G2", "G3"):  # four names at their quota: every registration P keeps
        for i in range(POOL.max_peer_transfers):
            assert register(p, name, f"{name}-{i}") == []
    answers = register(p, "D", "genuine")
    # D is in; the newest registration of a heaviest name went, told why, as at its time-to-live
    assert [peer for peer, m in answers if isinstance(m, Notice)] == ["G0"]
    (notice,) = [m for _, m in answers if isinstance(m, Notice)]
    assert notice.key == TransferKey("G0-3", 1) and "pushed out" in notice.reason
    assert p.machine(TransferKey("genuine", 1), Role.PREFILL).state is State.REGISTERED
    assert p.machine(TransferKey("G0-3", 1), Role.PREFILL).outcome is Outcome.EXPIRED
    assert p.stats.pushed_out == 1
    # the heaviest holder itself is refused rather than pushing out others
    refused = register(p, "G1", "G1-more")
    assert refused and isinstance(refused[0][1], Notice) and "max_peer_transfers" in refused[0][1].reason


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=120))
def test_whatever_names_registered_before_a_peer_holding_the_least_gets_in(names: list[int]) -> None:
    p = TransferCore("P", 2, POOL)
    for n, name in enumerate(names):
        register(p, f"g{name}", f"g{name}-{n}")
    assert p.store.load("x").unstarted <= POOL.max_unstarted
    held = p.store.openers()
    if held and max(held.values()) > 1:  # someone holds more than the one D asks for
        assert not [m for peer, m in register(p, "D", "genuine") if peer == "D"]
        assert p.machine(TransferKey("genuine", 1), Role.PREFILL).state is State.REGISTERED


def test_blocks_registered_by_all_peers_are_bounded_in_total() -> None:
    p = TransferCore("P", 2, CoreConfig(max_peer_blocks=60, max_registered_blocks=100))
    assert register(p, "G0", "a", blocks=60) == []
    ((_, notice), _) = register(p, "G1", "b", blocks=60)
    assert isinstance(notice, Notice) and "max_registered_blocks" in notice.reason
    assert register(p, "G1", "c", blocks=40) == [] and p.store.load("G1").registered == 100


def test_names_filling_the_early_pool_do_not_push_out_a_genuine_early_ready() -> None:
    d = TransferCore("D", 2, POOL)
    key = TransferKey("r", 1)
    d.receive("P", Ready(key, (7,)), 0.0)  # P is ready before D allocates
    for name in ("G0", "G1", "G2", "G3", "G4"):
        for i in range(POOL.max_peer_early):
            d.receive(name, Notice(TransferKey(f"{name}-{i}", 1), Outcome.ABORTED, "spam"), 0.1)
    assert d.store.early.totals()[0] == POOL.max_unstarted  # full, the newcomers pushed out others
    assert d.store.early.count_from("P") == (1, 1)
    assert d.stats.pushed_out == d.store.early.pushed_out > 0  # counted where the engine's stats show it
    actions = d.expect(Expect(key, peer="P", mode=Mode.PULL, block_ids=[1]), now=0.2, deadline=10.0)
    assert any(getattr(a, "remote_blocks", None) == (7,) for a in actions)  # P's ready was kept


def test_early_messages_are_bounded_in_block_ids_not_only_in_messages() -> None:
    config = CoreConfig(max_early_blocks=1000)
    d = TransferCore("D", 2, config)
    for i in range(200):  # ready messages of 300 blocks each, for transfers D never heard of
        d.receive("G", Ready(TransferKey(f"g{i}", 1), tuple(range(300))), 0.0)
    assert d.store.early.totals()[1] <= config.max_early_blocks
    d.receive("P", Ready(TransferKey("r", 1), tuple(range(100))), 0.1)  # a lighter peer still gets in
    assert d.store.early.count_from("P") == (1, 100) and d.store.early.totals()[1] <= config.max_early_blocks


def test_what_a_peer_sends_before_its_association_is_in_place_is_bounded_in_block_ids() -> None:
    assoc = Associations("D", fingerprint(SMALL_SPEC), 30.0, 5.0)
    (add,) = assoc.receive("P", 1, hello("P"), 0.0)
    assert isinstance(add, AddTransportPeer)  # the transport is adding P
    big = tuple(range(131_072))
    kept = [assoc.receive("P", 1, Ready(TransferKey(f"t{i}", 1), big), 0.0) for i in range(8)]
    assert sum(1 for actions in kept if actions == []) == EARLY_BLOCKS_KEPT // len(big)
    assert all(actions == [UnknownSender("P")] for actions in kept if actions)
