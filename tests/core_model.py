"""A P core and a D core joined by a simulated network, with a model of both KV memories.

Why a model: the properties that matter are about bytes and ownership, not about which state
names appear.  Ops stay in flight until a rule lands them, so a WRITE can land long after the
transfer it belongs to was aborted; a WRITE's bytes and notification may land before its issuer
hears that it completed (shared memory: D may answer before P's loop sees its own completion);
notifications can be dropped, duplicated and reordered;
control messages stay ordered (they travel on one reliable connection); the link can be torn
down.  Every landing checks that its destination and source blocks are still held by the
transfer that issued it: a block released too early is caught at the moment it would corrupt
someone else's KV.  Each side's verdict is checked against the other's: D reads the KV, so P
never reports a success that D has not reported first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvflow.protocol.actions import Action, DeclarePeerLost, OpKind, ReleaseBlocks, Resolve, SendMessage, SubmitOp
from kvflow.protocol.core import CoreConfig, TransferCore
from kvflow.protocol.messages import OPEN_BATCHES, Message, TransferKey
from kvflow.protocol.requests import Expect, KvReady
from kvflow.protocol.state import Mode, Outcome, Role
from kvflow.protocol.transfer_tables import TERMINAL

NUM_LAYERS = 2
P_BLOCKS = 12
D_BLOCKS = 12
CONFIG = CoreConfig(fence_timeout=3.0, retention=50.0)


class InvariantViolation(AssertionError):
    """A safety property of the transfer protocol was broken."""


@dataclass
class Op:
    issuer: str  # "P" or "D"
    action: SubmitOp
    landed: bool = False  # its bytes moved, its issuer has not heard it completed yet


@dataclass
class Plan:
    """What the router told both sides about one transfer attempt."""

    key: TransferKey
    mode: Mode
    nblocks: int
    batches: list[tuple[int, int, tuple[int, int]]]  # (first position, count, layers)
    p_ttl: float = 30.0  # how long P holds its blocks for this transfer (its lease)
    unclaimed: bool = False  # pull: P makes the KV ready for whichever peer claims it first
    open_count: bool = False  # push: D registers OPEN_BATCHES, P's last notification says how many
    p_blocks: dict[int, int] = field(default_factory=dict)  # position -> P block
    d_blocks: tuple[int, ...] = ()
    sent: int = 0
    # D's prefix-cache hit: it holds positions [0, hit) already and registers only the rest
    # (all of them, push only: an empty registration)
    hit: int = 0
    allocated: bool = False
    withdrawn: bool = False  # D gave up before allocating (and told P): it never registers

    def wanted_batches(self) -> int:
        """P's batches that reach D's positions: the WRITEs D expects."""
        if self.mode is Mode.PULL:
            return 1
        return sum(1 for first, count, _ in self.batches if first + count > self.hit) if self.hit < self.nblocks else 0


@dataclass
class Network:
    now: float = 0.0
    to_p: deque[Message] = field(default_factory=deque)
    to_d: deque[Message] = field(default_factory=deque)
    notifications: list[bytes] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)


class CorePair:
    def __init__(self, config: CoreConfig = CONFIG) -> None:
        self.config = config
        self.p = TransferCore("P", NUM_LAYERS, config)
        self.d = TransferCore("D", NUM_LAYERS, config)
        self.net = Network()
        self.p_content: dict[tuple[int, int], object] = {}
        self.d_content: dict[tuple[int, int], object] = {}
        self.p_owner: dict[int, TransferKey] = {}
        self.d_owner: dict[int, TransferKey] = {}
        self.resolved: dict[tuple[str, TransferKey], Outcome] = {}
        self.plans: dict[TransferKey, Plan] = {}
        self.successes: set[TransferKey] = set()
        self.broken = False  # a violation was raised: teardown must not mask it with another
        self.run("D", self.d.peer_connected("P", 0.0))
        self.run("P", self.p.peer_connected("D", 0.0))

    def violation(self, message: str) -> InvariantViolation:
        self.broken = True
        return InvariantViolation(message)

    # ---------------------------------------------------------------- actions

    def run(self, side: str, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, SendMessage):
                (self.net.to_d if side == "P" else self.net.to_p).append(action.message)
            elif isinstance(action, SubmitOp):
                self._check_submit(side, action)
                self.net.ops.append(Op(side, action))
            elif isinstance(action, ReleaseBlocks):
                self._release(side, action)
            elif isinstance(action, Resolve):
                self._resolve(side, action)
            elif isinstance(action, DeclarePeerLost):
                self.link_down()

    def _check_submit(self, side: str, op: SubmitOp) -> None:
        core = self.p if side == "P" else self.d
        role = Role.PREFILL if side == "P" else Role.DECODE
        state = core.machine(op.key, role).state
        if state in TERMINAL:
            raise self.violation(f"{side} submitted an op for {op.key} in terminal state {state}")

    def _release(self, side: str, action: ReleaseBlocks) -> None:
        owners = self.p_owner if side == "P" else self.d_owner
        for block in action.block_ids:
            if owners.get(block) != action.key:
                raise self.violation(f"{side} released block {block} for {action.key}, owner {owners.get(block)}")
        for op in self.net.ops:
            a = op.action
            if a.key != action.key or (side == "D" and op.landed and a.kind is OpKind.WRITE):
                # P's WRITE whose bytes (and notification) have landed writes nothing more into
                # D's blocks; only its issuer, P, has yet to see it complete, and holds its own
                continue
            touched = self._dst_blocks(op) if side == "D" else self._src_blocks(op)
            if set(touched) & set(action.block_ids):
                raise self.violation(f"{side} released blocks of {action.key} while an op touching them is in flight")
        for block in action.block_ids:
            del owners[block]

    def _resolve(self, side: str, action: Resolve) -> None:
        tag = (side, action.key)
        if tag in self.resolved:
            raise self.violation(f"{side} resolved {action.key} twice")
        self.resolved[tag] = action.outcome
        # D reads the KV, so D's verdict is the transfer's: P never reports a success D did not.
        p_said, d_said = self.resolved.get(("P", action.key)), self.resolved.get(("D", action.key))
        if p_said is Outcome.SUCCEEDED and d_said not in (None, Outcome.SUCCEEDED):
            raise self.violation(f"P reported success for {action.key}, D {d_said.value}")
        if p_said is Outcome.SUCCEEDED and d_said is None:
            raise self.violation(f"P reported success for {action.key} before D's verdict")
        if side == "D" and action.outcome is Outcome.SUCCEEDED:
            self.check_contents(action.key)
            self.successes.add(action.key)

    @staticmethod
    def _dst_blocks(op: Op) -> tuple[int, ...]:
        return op.action.remote_blocks if op.action.kind is OpKind.WRITE else op.action.local_blocks

    @staticmethod
    def _src_blocks(op: Op) -> tuple[int, ...]:
        return op.action.local_blocks if op.action.kind is OpKind.WRITE else op.action.remote_blocks

    # ---------------------------------------------------------------- the data plane

    def land(self, index: int, *, fail: bool, complete: bool = True) -> None:
        """Finish an in-flight op: its bytes land (partly, if it fails) and it completes; or,
        without `complete`, only its bytes and notification land: the op stays in flight for
        its issuer (and its blocks must stay held) until a later call completes it."""
        op = self.net.ops[index % len(self.net.ops)]
        a = op.action
        if not op.landed:
            self._move_bytes(op, fail=fail and complete)
        if not complete and not op.landed:
            op.landed = True
            return
        self.net.ops.remove(op)
        core = self.p if op.issuer == "P" else self.d
        failed = fail and not op.landed
        self.run(op.issuer, core.op_finished(a.op_id, self.net.now, "injected failure" if failed else None))

    def answer_before_completion(self, index: int) -> None:
        """Land the bytes of an op not landed yet, hand its notification to D at once and D's
        answers to P, then complete it."""
        pending = [op for op in self.net.ops if not op.landed]
        op = pending[index % len(pending)]
        self.land(self.net.ops.index(op), fail=False, complete=False)
        if op.action.kind is OpKind.WRITE:
            self.net.notifications.remove(op.action.notification)
            self.run("D", self.d.notification("P", op.action.notification, self.net.now))
        while self.net.to_p:
            self.deliver("P")
        if op in self.net.ops:  # an answer may have torn the link down
            self.land(self.net.ops.index(op), fail=False)

    def _move_bytes(self, op: Op, *, fail: bool) -> None:
        a = op.action
        dst, src = self._dst_blocks(op), self._src_blocks(op)
        layers = range(*(a.layers or (0, NUM_LAYERS)))
        for block in dst:
            if self.d_owner.get(block) != a.key:
                raise self.violation(f"an op of {a.key} landed in D block {block} owned by {self.d_owner.get(block)}")
        for block in src:
            if self.p_owner.get(block) != a.key:
                raise self.violation(f"an op of {a.key} read P block {block} owned by {self.p_owner.get(block)}")
        count = len(dst) // 2 if fail else len(dst)
        for s, d in list(zip(src, dst, strict=True))[:count]:
            for layer in layers:
                self.d_content[(d, layer)] = self.p_content.get((s, layer))
        if not fail and a.kind is OpKind.WRITE:
            self.net.notifications.append(a.notification)

    def notify(self, index: int, *, duplicate: bool) -> None:
        payload = self.net.notifications[index % len(self.net.notifications)]
        if not duplicate:
            self.net.notifications.remove(payload)
        self.run("D", self.d.notification("P", payload, self.net.now))

    def deliver(self, to: str) -> None:
        queue = self.net.to_p if to == "P" else self.net.to_d
        message = queue.popleft()
        core = self.p if to == "P" else self.d
        self.run(to, core.receive("D" if to == "P" else "P", message, self.net.now))

    def link_down(self) -> None:
        """Tear the link down: in-flight ops are cancelled and never land; messages are lost."""
        self.net.ops.clear()
        self.net.to_p.clear()
        self.net.to_d.clear()
        self.net.notifications.clear()
        self.run("D", self.d.peer_lost("P", self.net.now))
        self.run("P", self.p.peer_lost("D", self.net.now))
        self.run("D", self.d.peer_connected("P", self.net.now))
        self.run("P", self.p.peer_connected("D", self.net.now))

    def advance(self, dt: float) -> None:
        self.net.now += dt
        self.run("D", self.d.timer(self.net.now))
        self.run("P", self.p.timer(self.net.now))

    # ---------------------------------------------------------------- the two engines' callers

    def expect(self, plan: Plan, ttl: float) -> None:
        free = [b for b in range(D_BLOCKS) if b not in self.d_owner]
        wanted = plan.nblocks - plan.hit
        if len(free) < wanted:
            return
        plan.d_blocks = tuple(free[:wanted])
        plan.allocated = True
        n_writes = plan.wanted_batches()
        if plan.open_count and plan.mode is Mode.PUSH:
            n_writes = OPEN_BATCHES  # also what an empty registration (nothing wanted) says
        actions = self.d.expect(
            Expect(
                plan.key,
                peer="P",
                mode=plan.mode,
                block_ids=plan.d_blocks,
                expected_batches=n_writes,
                first_position=plan.hit,
            ),
            now=self.net.now,
            deadline=self.net.now + ttl,
        )
        for block in plan.d_blocks:
            self.d_owner[block] = plan.key
            for layer in range(NUM_LAYERS):
                self.d_content[(block, layer)] = "garbage"
        self.run("D", actions)

    def kv_ready(self, plan: Plan, p_extra: int) -> None:
        """Send P's next batch; `p_extra` > 0 makes P's KV larger than D's registration."""
        if plan.sent == len(plan.batches):
            return
        first, count, layers = plan.batches[plan.sent]
        final = plan.sent == len(plan.batches) - 1
        if final:
            count += p_extra
        positions = range(first, first + count)
        if any(self.p_owner.get(plan.p_blocks[pos]) != plan.key for pos in positions if pos in plan.p_blocks):
            return  # kvflow gave these blocks back: the engine stopped computing into them
        needed = [pos for pos in positions if pos not in plan.p_blocks]
        # A transfer's blocks are the union of its batches, each returned once: P does not
        # hand the same transfer a block it already got back from it.
        used = set(plan.p_blocks.values())
        free = [b for b in range(P_BLOCKS) if b not in self.p_owner and b not in used]
        if len(free) < len(needed):
            return
        for pos, block in zip(needed, free, strict=False):
            plan.p_blocks[pos] = block
            self.p_owner[block] = plan.key
        ids = [plan.p_blocks[pos] for pos in positions]
        for pos, block in zip(positions, ids, strict=True):
            for layer in range(*layers):
                self.p_content[(block, layer)] = (plan.key, pos, layer)
        plan.sent += 1
        actions = self.p.kv_ready(
            KvReady(
                plan.key,
                block_ids=ids,
                final=final,
                first_position=first,
                layers=layers if plan.mode is Mode.PUSH else None,
                mode=plan.mode,
                peer=None if plan.unclaimed else "D",
            ),
            now=self.net.now,
            deadline=self.net.now + plan.p_ttl,
        )
        self.run("P", actions)

    def consume(self) -> None:
        for m in self.d.machines():
            if m.state.name == "NOTIFIED":
                self.check_contents(m.key)
                self.run("D", self.d.delivered(m.key, self.net.now))

    def check_contents(self, key: TransferKey) -> None:
        plan = self.plans[key]
        for position, block in enumerate(plan.d_blocks, start=plan.hit):
            for layer in range(NUM_LAYERS):
                got = self.d_content.get((block, layer))
                if got != (key, position, layer):
                    raise self.violation(f"D block {block} layer {layer} of {key} holds {got!r}")

    # ---------------------------------------------------------------- the end

    def settle(self) -> None:
        """Let everything finish: no faults any more, the router completes what it started,
        time moves on."""
        for plan in list(self.plans.values()):
            latest = max(p.key.epoch for p in self.plans.values() if p.key.transfer_id == plan.key.transfer_id)
            if plan.key.epoch != latest:
                continue
            # A late call for a transfer that already ended is absorbed, never refused.
            if not plan.allocated and not plan.withdrawn:
                self.expect(plan, 20.0)
            for _ in range(len(plan.batches)):
                self.kv_ready(plan, 0)
        for _ in range(200):
            while self.net.to_p or self.net.to_d or self.net.ops or self.net.notifications:
                if self.net.to_p:
                    self.deliver("P")
                elif self.net.to_d:
                    self.deliver("D")
                elif self.net.ops:
                    self.land(0, fail=False)
                else:
                    self.notify(0, duplicate=False)
            self.consume()
            if not self.p.live() and not self.d.live():
                break
            self.advance(5.0)
        self.advance(self.config.retention + 1)  # finished machines are forgotten
        live = [(m.role.value, str(m.key), m.state.name) for m in self.p.live() + self.d.live()]
        if live:
            raise self.violation(f"transfers never ended: {live}")
        for name, core in (("P", self.p), ("D", self.d)):
            if len(core.ledger) or core.ledger.held_blocks:
                raise self.violation(f"{name} ledger still holds {core.ledger.held_blocks} blocks")
        if self.d_owner:
            raise self.violation(f"D blocks never released: {sorted(self.d_owner)}")
        if self.p_owner:
            raise self.violation(f"P blocks never released: {sorted(self.p_owner)}")
        for plan in self.plans.values():
            if plan.allocated and ("D", plan.key) not in self.resolved:
                raise self.violation(f"D never resolved {plan.key}")
