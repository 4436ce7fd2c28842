"""Hypothesis drives a P core and a D core through random interleavings and faults.

Properties (see `core_model`): no op lands in or reads from a block its transfer no longer
holds; every block is released exactly once; every D success holds exactly P's bytes (for the
positions after D's prefix-cache hit, which P never writes); after the faults stop and time
passes, every transfer has ended and both ledgers are empty.  Push transfers are split by
layers, by positions, or both (chunks of positions, each in layer groups, as a chunked prefill
produces them); D registers the batch count or leaves it open to P, and P may leave a gap (a
batch it never produces), which must fail the transfer on both sides, never pass as a
success.  The same machine runs again with per-peer quotas so tight that P refuses many
registrations: refusals must keep every property.  Pull transfers are made ready for a known
D or, as a sequential router has it, for whichever peer claims them first; a stranger's claim
is refused.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvflow.protocol.actions import SendMessage
from kvflow.protocol.core import CoreConfig
from kvflow.protocol.messages import Claim, Notice, TransferKey
from kvflow.protocol.requests import Abort
from kvflow.protocol.state import Mode, Role
from kvflow.protocol.transfers import Load
from tests.core_model import CONFIG, NUM_LAYERS, CorePair, Plan

EXAMPLES = int(os.environ.get("KVFLOW_STATEFUL_EXAMPLES", "300"))
STEPS = 60
TRANSFER_IDS = ("a", "b", "c")


class CoreProtocol(RuleBasedStateMachine):
    config = CONFIG

    @initialize()
    def setup(self) -> None:
        self.pair = CorePair(self.config)
        self.epochs: dict[str, int] = {}
        self.current: dict[str, Plan] = {}
        self.p_extra: dict[TransferKey, int] = {}

    @rule(
        tid=st.sampled_from(TRANSFER_IDS),
        mode=st.sampled_from(Mode),
        nblocks=st.integers(1, 3),
        split=st.sampled_from(["one", "layers", "positions", "chunks"]),
        p_extra=st.sampled_from([0, 0, 0, 1]),
        p_ttl=st.sampled_from([3.0, 30.0]),
        hit=st.sampled_from([0, 0, 1, 2, 3]),
        unclaimed=st.booleans(),
        open_count=st.booleans(),
        gap=st.sampled_from([None, None, None, None, 0, 1, 2]),
    )
    def start(
        self,
        tid: str,
        mode: Mode,
        nblocks: int,
        split: str,
        p_extra: int,
        p_ttl: float,
        hit: int,
        unclaimed: bool,
        open_count: bool,
        gap: int | None,
    ) -> None:
        """The router starts a new attempt (epoch) at a transfer."""
        epoch = self.epochs.get(tid, 0) + 1
        self.epochs[tid] = epoch
        key = TransferKey(tid, epoch)
        full = (0, NUM_LAYERS)
        if mode is Mode.PULL or split == "one":
            batches = [(0, nblocks, full)]
        elif split == "layers":
            batches = [(0, nblocks, (layer, layer + 1)) for layer in range(NUM_LAYERS)]
        elif split == "positions":
            batches = [(i, 1, full) for i in range(nblocks)]
        else:  # chunks of up to two positions, each written one layer at a time
            batches = [
                (first, min(2, nblocks - first), (layer, layer + 1))
                for first in range(0, nblocks, 2)
                for layer in range(NUM_LAYERS)
            ]
        if gap is not None and len(batches) > 1:
            del batches[gap % len(batches)]  # P never produces this batch
        # D's prefix-cache hit: push may hold every position (an empty registration), pull reads one at least
        hit = min(hit, nblocks if mode is Mode.PUSH else nblocks - 1)
        unclaimed = unclaimed and mode is Mode.PULL
        plan = Plan(key, mode, nblocks, batches, p_ttl=p_ttl, hit=hit, unclaimed=unclaimed, open_count=open_count)
        self.current[tid] = plan
        self.pair.plans[key] = plan
        self.p_extra[key] = p_extra

    @precondition(lambda self: any(not p.allocated and not p.withdrawn for p in self.current.values()))
    @rule(data=st.data(), ttl=st.sampled_from([4.0, 20.0]))
    def decode_allocates(self, data: st.DataObject, ttl: float) -> None:
        plan = data.draw(st.sampled_from([p for p in self.current.values() if not p.allocated and not p.withdrawn]))
        self.pair.expect(plan, ttl)

    @precondition(lambda self: any(not p.allocated and not p.withdrawn for p in self.current.values()))
    @rule(data=st.data(), chance=st.integers(0, 3))
    def decode_gives_up_before_allocating(self, data: st.DataObject, chance: int) -> None:
        """D's request ends while queued: D never registers, and tells P."""
        if chance:
            return
        plan = data.draw(st.sampled_from([p for p in self.current.values() if not p.allocated and not p.withdrawn]))
        plan.withdrawn = True
        now = self.pair.net.now
        self.pair.run("D", self.pair.d.abort(Abort(plan.key, Role.DECODE, "gave up", peer="P", mode=plan.mode), now))

    @precondition(lambda self: bool(self.current))
    @rule(data=st.data())
    def prefill_promises(self, data: st.DataObject) -> None:
        """P holds the request (queued or prefilling): its heartbeats say so."""
        plan = data.draw(st.sampled_from(list(self.current.values())))
        self.pair.p.promise(plan.key, "D", self.pair.net.now)

    @rule(lease=st.sampled_from([1.0, 6.0]))
    def heartbeats(self, lease: float) -> None:
        """Both sides beat: D renews P's hold on what it waits for, P renews D's wait on what it promises."""
        pair, now = self.pair, self.pair.net.now
        pair.run("D", pair.d.renew("P", pair.p.heartbeat_keys("D", now), now, lease))
        pair.run("P", pair.p.renew("D", pair.d.heartbeat_keys("P", now), now, lease))

    @precondition(lambda self: any(p.sent < len(p.batches) for p in self.current.values()))
    @rule(data=st.data())
    def prefill_produces(self, data: st.DataObject) -> None:
        plan = data.draw(st.sampled_from([p for p in self.current.values() if p.sent < len(p.batches)]))
        self.pair.kv_ready(plan, self.p_extra[plan.key])

    @precondition(lambda self: bool(self.pair.net.to_p))
    @rule()
    def deliver_to_prefill(self) -> None:
        self.pair.deliver("P")

    @precondition(lambda self: bool(self.pair.net.to_d))
    @rule()
    def deliver_to_decode(self) -> None:
        self.pair.deliver("D")

    @precondition(lambda self: bool(self.pair.net.to_p or self.pair.net.to_d))
    @rule()
    def control_messages_flush(self) -> None:
        """Every queued control message arrives, data-plane ops still in flight."""
        while self.pair.net.to_p or self.pair.net.to_d:
            self.pair.deliver("P" if self.pair.net.to_p else "D")

    @precondition(lambda self: bool(self.pair.net.ops))
    @rule(
        index=st.integers(0, 7),
        fail=st.sampled_from([False, False, False, True]),
        complete=st.sampled_from([True, True, False]),
    )
    def op_lands(self, index: int, fail: bool, complete: bool) -> None:
        self.pair.land(index, fail=fail, complete=complete)

    @precondition(lambda self: any(not op.landed for op in self.pair.net.ops))
    @rule(index=st.integers(0, 7))
    def peer_answers_before_completion(self, index: int) -> None:
        """Shared memory: a WRITE's bytes and notification land, D answers, and P hears that
        answer before its own loop sees the WRITE complete."""
        self.pair.answer_before_completion(index)

    @precondition(lambda self: bool(self.pair.net.notifications))
    @rule(index=st.integers(0, 7), duplicate=st.booleans())
    def notification_arrives(self, index: int, duplicate: bool) -> None:
        self.pair.notify(index, duplicate=duplicate)

    @precondition(lambda self: bool(self.pair.net.notifications))
    @rule(index=st.integers(0, 7))
    def notification_dropped(self, index: int) -> None:
        notes = self.pair.net.notifications
        notes.pop(index % len(notes))

    @precondition(lambda self: bool(self.current))
    @rule(data=st.data(), side=st.sampled_from(["P", "D"]), chance=st.integers(0, 3))
    def abort(self, data: st.DataObject, side: str, chance: int) -> None:
        if chance:
            return  # faults are rarer than progress, so that transfers also get to succeed
        plan = data.draw(st.sampled_from(list(self.current.values())))
        core = self.pair.p if side == "P" else self.pair.d
        role = Role.PREFILL if side == "P" else Role.DECODE
        if (plan.key, role) in {(m.key, m.role) for m in core.machines()}:
            self.pair.run(side, core.abort(Abort(plan.key, role, "test abort"), self.pair.net.now))

    @precondition(lambda self: bool(self.pair.net.ops))
    @rule(index=st.integers(0, 7), side=st.sampled_from(["P", "D"]))
    def abort_while_op_in_flight(self, index: int, side: str) -> None:
        """The most dangerous moment to give up: an op of the transfer may still land."""
        key = self.pair.net.ops[index % len(self.pair.net.ops)].action.key
        core = self.pair.p if side == "P" else self.pair.d
        role = Role.PREFILL if side == "P" else Role.DECODE
        if (key, role) in {(m.key, m.role) for m in core.machines()}:
            self.pair.run(side, core.abort(Abort(key, role, "test abort in flight"), self.pair.net.now))

    @precondition(lambda self: any(m.mode is Mode.PULL for m in self.pair.p.machines()))
    @rule(data=st.data())
    def stranger_claims(self, data: st.DataObject) -> None:
        """Another engine claims a pull transfer P already has a peer for: it is refused, and
        the transfer goes on as if nothing had come."""
        pulls = [m for m in self.pair.p.machines() if m.mode is Mode.PULL and m.peer == "D"]
        if not pulls:
            return
        m = data.draw(st.sampled_from(pulls))
        before = (m.state, m.peer, m.deadline, self.pair.p.ledger.held_blocks)
        actions = self.pair.p.receive("X", Claim(m.key), self.pair.net.now)
        if [(a.peer, type(a.message)) for a in actions if isinstance(a, SendMessage)] != [("X", Notice)]:
            raise self.pair.violation(f"a second claimant of {m.key} was not refused: {actions}")
        if len(actions) != 1 or (m.state, m.peer, m.deadline, self.pair.p.ledger.held_blocks) != before:
            raise self.pair.violation(f"a refused claim of {m.key} changed the transfer: {actions}")

    @rule(dt=st.sampled_from([0.1, 0.5, 2.0, 5.0]))
    def time_passes(self, dt: float) -> None:
        self.pair.advance(dt)

    @rule()
    def consumer_takes_delivery(self) -> None:
        self.pair.consume()

    @precondition(lambda self: bool(self.current))
    @rule(chance=st.integers(0, 7))
    def link_fails(self, chance: int) -> None:
        if chance == 0:
            self.pair.link_down()

    @invariant()
    def ledgers_match_model(self) -> None:
        pair = self.pair
        for block, key in pair.d_owner.items():
            if pair.d.ledger.holder_of(block) != (key, Role.DECODE):
                raise pair.violation(f"D ledger disagrees on block {block}: {pair.d.ledger.holder_of(block)}")
        for name, core, peer in (("P", pair.p, "D"), ("D", pair.d, "P")):
            live = core.live()
            weighed = Load(
                sum(not m.started_locally for m in live),
                sum(len(m.remote_blocks or ()) for m in live if m.peer is not None),
                sum(m.peer == peer for m in live),
                sum(len(m.remote_blocks or ()) for m in live if m.peer == peer),
                sum(m.peer == peer and not m.started_locally for m in live),
            )
            if core.store.load(peer) != weighed:  # what the quotas are checked against
                raise pair.violation(f"{name} weighs its transfers {core.store.load(peer)}, they weigh {weighed}")
            if core.stats.protocol_violations:
                raise pair.violation(f"{name} saw a message its table does not allow: {core.stats}")

    def teardown(self) -> None:
        if hasattr(self, "pair") and not self.pair.broken:
            self.pair.settle()


CoreProtocol.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCoreProtocol = CoreProtocol.TestCase


class CoreProtocolWithQuotas(CoreProtocol):
    """One transfer opened by the peer, three registered blocks, one early message at most."""

    config = CoreConfig(
        fence_timeout=CONFIG.fence_timeout,
        retention=CONFIG.retention,
        max_peer_transfers=1,
        max_peer_blocks=3,
        max_peer_early=1,
    )


CoreProtocolWithQuotas.TestCase.settings = CoreProtocol.TestCase.settings
TestCoreProtocolWithQuotas = CoreProtocolWithQuotas.TestCase
