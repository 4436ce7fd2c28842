"""Hypothesis drives two real engines over the loopback transport with random faults.

The engines are the production asyncio engines; only time (a manual clock), the fabric (manual
stepping) and the writer (inline) are made deterministic.  Faults: failed and torn WRITEs,
stalled ops that land much later, dropped, duplicated and reordered notifications, aborts on
either side, deadlines.  Properties: no engine records a crash; every D success holds exactly
P's bytes; no block is returned twice or while it is still in use; once faults stop and every
deadline (plus the fence grace) has passed, every transfer has ended and both ledgers are empty.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvflow.errors import ConfigError, UnknownTransfer
from kvflow.protocol.core import CoreConfig
from kvflow.protocol.state import Mode, Outcome, Role
from kvflow.runtime.engine import EngineConfig
from kvflow.runtime.writer import InlineSubmitter
from kvflow.transports.loopback import FaultPlan, LoopbackFabric
from kvflow_tools.testing import EnginePair, KVBuffers, ManualClock

EXAMPLES = int(os.environ.get("KVFLOW_STATEFUL_EXAMPLES", "300"))
CONFIG = EngineConfig(core=CoreConfig(fence_timeout=2.0, retention=30.0), transfer_timeout=10.0, drain_timeout=0.01)
BLOCKS = 12
LAYERS = 2


class EngineProtocol(RuleBasedStateMachine):
    @initialize(
        seed=st.integers(0, 2**16),
        fail_rate=st.sampled_from([0.0, 0.1, 0.3]),
        stall_rate=st.sampled_from([0.0, 0.2]),
        note_faults=st.sampled_from([0.0, 0.2]),
    )
    def setup(self, seed: int, fail_rate: float, stall_rate: float, note_faults: float) -> None:
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock()
        faults = FaultPlan(
            seed=seed,
            fail_rate=fail_rate,
            stall_rate=stall_rate,
            drop_rate=note_faults,
            duplicate_rate=note_faults,
            reorder_rate=note_faults,
        )
        self.fabric = LoopbackFabric(faults=faults, manual=True)
        self.pair = EnginePair(
            self.fabric, num_blocks=BLOCKS, config=CONFIG, submitter=InlineSubmitter, clock=self.clock
        )
        self.loop.run_until_complete(self.pair.start())
        execute = self.fabric._execute

        def checked(op: Any) -> None:  # every op is checked at the moment its bytes would move
            self.check_landing(op)
            execute(op)

        self.fabric._execute = checked  # type: ignore[method-assign]
        self.free = {"P": set(range(BLOCKS)), "D": set(range(BLOCKS))}
        self.expected: dict[tuple[str, int], list[bytes]] = {}  # P's bytes per D transfer
        self.d_blocks: dict[tuple[str, int], list[int]] = {}
        self.plans: dict[tuple[str, int], tuple[Mode, int, int]] = {}  # mode, batches, sent
        self.p_blocks: dict[tuple[str, int], list[int]] = {}
        self.p_gave_up_unproduced: set[tuple[str, int]] = set()  # P aborted before any kv_ready
        self.d_ended: set[tuple[str, int]] = set()  # D reported an outcome
        self.next_epoch = 1
        self.deadline = 0.0

    # ------------------------------------------------------------------ helpers

    def check_landing(self, op: Any) -> None:
        """An op about to move bytes: its D blocks (destination) and P blocks (source) must
        still be held by the transfer that issued it; otherwise a stale op lands in (or reads)
        blocks that may already belong to someone else."""
        fabric, target = self.fabric, self.fabric._endpoints.get(op.peer)
        if op.cancelled or target is None or op.initiator.name not in target._peers:
            return  # the fabric refuses it: nothing moves
        if fabric.is_dead(op.peer) or fabric.is_dead(op.initiator.name):
            return
        issuer = self.pair.p if op.initiator.name == "P" else self.pair.d
        owner = issuer.core.op_owner(op.op_id)
        assert owner is not None, f"op {op.op_id} of {op.initiator.name} runs for no transfer"
        key = owner[0]
        d_ledger, p_ledger = self.pair.d.core.ledger, self.pair.p.core.ledger
        p_owner = (key, Role.PREFILL)
        for dst, src, length in op.copies:
            for d_block in locate(self.pair.d_kv, dst, length):
                holder = d_ledger.holder_of(d_block)
                assert holder == (key, Role.DECODE), f"an op of {key} lands in D block {d_block}, held by {holder}"
            for p_block in locate(self.pair.p_kv, src, length):
                assert p_ledger.holds(p_owner) and p_block in p_ledger.blocks_of(p_owner), (
                    f"an op of {key} reads P block {p_block}, which its transfer no longer holds"
                )

    def spin(self) -> None:
        """Run every callback the engines scheduled (messages, drains), to a fixed point."""
        for _ in range(30):
            self.loop.run_until_complete(asyncio.sleep(0))
        self.collect()

    def collect(self) -> None:
        for side, engine in (("P", self.pair.p), ("D", self.pair.d)):
            while engine.released:
                release = engine.released.popleft()
                if side == "P":  # the host engine stops computing into blocks it got back
                    key = (release.key.transfer_id, release.key.epoch)
                    mode, batches, _ = self.plans[key]
                    self.plans[key] = (mode, batches, batches)
                for block in release.block_ids:
                    assert block not in self.free[side], f"{side} block {block} returned twice"
                    self.free[side].add(block)
        while self.pair.d.finished:
            result = self.pair.d.finished.popleft()
            key = (result.key.transfer_id, result.key.epoch)
            self.d_ended.add(key)
            if result.outcome is Outcome.SUCCEEDED:
                got = self.pair.d_kv.snapshot(self.d_blocks[key])
                assert got == self.expected[key], f"D's bytes for {key} differ from P's"
        self.pair.p.finished.clear()

    def take(self, side: str, n: int) -> list[int] | None:
        pool = sorted(self.free[side])
        if len(pool) < n:
            return None
        taken = pool[:n]
        self.free[side] -= set(taken)
        return taken

    # ------------------------------------------------------------------ rules

    @rule(mode=st.sampled_from(Mode), nblocks=st.integers(1, 3), layered=st.booleans())
    def start_transfer(self, mode: Mode, nblocks: int, layered: bool) -> None:
        key = (f"t{self.next_epoch}", 1)
        self.next_epoch += 1
        d = self.take("D", nblocks)
        p = self.take("P", nblocks)
        if d is None or p is None:
            for side, got in (("D", d), ("P", p)):
                self.free[side] |= set(got or [])
            return
        batches = LAYERS if layered and mode is Mode.PUSH else 1
        self.d_blocks[key], self.p_blocks[key] = d, p
        self.plans[key] = (mode, batches, 0)
        self.pair.p_kv.fill(p, seed=self.next_epoch)
        self.expected[key] = self.pair.p_kv.snapshot(p)
        self.deadline = max(self.deadline, self.clock.now + CONFIG.transfer_timeout)
        self.loop.run_until_complete(
            self.pair.d.expect(key[0], key[1], peer="P", block_ids=d, mode=mode, expected_batches=batches)
        )
        self.spin()

    @precondition(lambda self: any(sent < n for _, n, sent in self.plans.values()))
    @rule(data=st.data())
    def prefill_produces(self, data: st.DataObject) -> None:
        pending = sorted(k for k, (_, n, sent) in self.plans.items() if sent < n)
        key = data.draw(st.sampled_from(pending))
        mode, batches, sent = self.plans[key]
        self.plans[key] = (mode, batches, sent + 1)
        layers = (sent, sent + 1) if batches > 1 else None
        final = sent + 1 == batches
        self.deadline = max(self.deadline, self.clock.now + CONFIG.transfer_timeout)  # P's own
        try:
            self.loop.run_until_complete(
                self.pair.p.kv_ready(
                    key[0], key[1], block_ids=self.p_blocks[key], final=final, layers=layers, mode=mode, peer="D"
                )
            )
        except ConfigError as exc:
            # The only refusal these inputs can cause: P gave up on the transfer before producing
            # any of it, and its record of that abort is not a pull transfer.  Nothing was handed
            # to P: the blocks are still ours.
            assert sent == 0 and mode is Mode.PULL and key in self.p_gave_up_unproduced, f"{key}: {exc!r}"
            self.free["P"] |= set(self.p_blocks[key])
        self.spin()

    @precondition(lambda self: self.fabric.pending() > 0)
    @rule(index=st.integers(0, 5))
    def an_op_runs(self, index: int) -> None:
        self.fabric.step(index)
        self.spin()

    @rule()
    def stalled_ops_resume(self) -> None:
        self.fabric.unstall()
        self.fabric.flush_held_notifications()
        self.spin()

    @precondition(lambda self: bool(self.plans))
    @rule(data=st.data(), side=st.sampled_from(["P", "D"]))
    def abort(self, data: st.DataObject, side: str) -> None:
        key = data.draw(st.sampled_from(sorted(self.plans)))
        engine, role = (self.pair.p, Role.PREFILL) if side == "P" else (self.pair.d, Role.DECODE)
        try:
            self.loop.run_until_complete(engine.abort(key[0], key[1], role, "test abort"))
        except UnknownTransfer as exc:
            # P may abort any transfer; D forgets one only `retention` after its outcome.
            assert side == "D" and key in self.d_ended, f"{side} {key}: {exc!r}"
        else:
            if side == "P" and self.plans[key][2] == 0:
                self.p_gave_up_unproduced.add(key)
        self.spin()

    @rule(dt=st.sampled_from([0.5, 2.0, 6.0]))
    def time_passes(self, dt: float) -> None:
        self.clock.advance(dt)
        self.pair.p.poke()
        self.pair.d.poke()
        self.spin()

    @precondition(lambda self: "P" not in self.pair.d.peers())
    @rule()
    def reconnect(self) -> None:
        self.loop.run_until_complete(self.pair.d.connect("P", timeout=1.0))
        self.spin()

    @invariant()
    def nothing_crashed(self) -> None:
        if hasattr(self, "pair"):
            assert self.pair.p.crashed == [] and self.pair.d.crashed == []
            assert self.pair.p.stats()["protocol_violations"] == 0
            assert self.pair.d.stats()["protocol_violations"] == 0

    # ------------------------------------------------------------------ the end

    def teardown(self) -> None:
        if not hasattr(self, "pair"):
            return
        try:
            # Faults stop; stalled ops resume and land; then time passes every deadline.
            self.fabric.unstall()
            self.fabric.flush_held_notifications()
            for _ in range(50):
                self.fabric.run_until_idle()
                self.spin()
            self.clock.advance(self.deadline - self.clock.now + 3 * CONFIG.core.fence_timeout + 1)
            for _ in range(5):
                self.pair.p.poke()
                self.pair.d.poke()
                self.fabric.run_until_idle()
                self.spin()
                self.clock.advance(CONFIG.core.fence_timeout + 0.1)
            live = [(m.role.value, str(m.key), m.state.name) for m in self.pair.p.core.live() + self.pair.d.core.live()]
            assert live == [], f"transfers not ended by their deadlines: {live}"
            for engine in (self.pair.p, self.pair.d):
                assert engine.core.ledger.held_blocks == 0, f"{engine.engine_id} still holds blocks"
            self.loop.run_until_complete(self.pair.close())
            self.collect()
            for key, (_, _, sent) in self.plans.items():
                if sent == 0:  # P's engine never got these blocks: the test still owns them
                    self.free["P"] |= set(self.p_blocks[key])
            assert self.free == {"P": set(range(BLOCKS)), "D": set(range(BLOCKS))}, "blocks never returned"
        finally:
            self.fabric.close()
            self.loop.close()


def locate(kv: KVBuffers, address: int, length: int) -> list[int]:
    """The blocks of `kv` that the byte range [address, address+length) covers."""
    span = kv.num_blocks * kv.spec.block_len  # one K or V array of a layer
    for layer in kv.layers:
        base = layer.ctypes.data
        if base <= address < base + layer.nbytes:
            assert address + length <= base + layer.nbytes, "a descriptor crosses layer buffers"
            # a coalesced run may continue from the last K block into the first V block
            start, step = address - base, kv.spec.block_len
            return [(offset % span) // step for offset in range(start, start + length, step)]
    raise AssertionError(f"address {address:#x} is in no KV buffer")


EngineProtocol.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestEngineProtocol = EngineProtocol.TestCase
