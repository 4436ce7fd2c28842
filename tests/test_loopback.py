"""The loopback transport keeps the transport contract: bytes, notifications, faults, teardown."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvflow.errors import ConfigError, TransportError
from kvflow.layout import DescriptorPlan, MemoryType, Region
from kvflow.layout.buffers import region_of
from kvflow.protocol.actions import OpKind
from kvflow.transports.base import Completion, Transport
from kvflow.transports.loopback import (
    FaultPlan,
    LinkModel,
    LoopbackFabric,
    LoopbackTransport,
)
from kvflow_tools.standin.fabrics import fabric_of, install_fabric, named_fabric


def plan(rows: list[tuple[int, int, int, int, int]]) -> DescriptorPlan:
    lr, lo, rr, ro, ln = (np.array(c, dtype=np.int64) for c in zip(*rows, strict=True))
    return DescriptorPlan(lr, lo, rr, ro, ln, uncoalesced=len(rows))


class Ends:
    def __init__(self, fabric: LoopbackFabric) -> None:
        self.fabric = fabric
        self.a_mem = np.arange(256, dtype=np.uint8)
        self.b_mem = np.zeros(256, dtype=np.uint8)
        self.a = fabric.endpoint("a")
        self.b = fabric.endpoint("b")
        self.a.register_regions([region_of(self.a_mem)])
        self.b.register_regions([region_of(self.b_mem)])
        self.a.add_peer("b", self.b.local_metadata(), [region_of(self.b_mem)])
        self.b.add_peer("a", self.a.local_metadata(), [region_of(self.a_mem)])


def wait_for(
    endpoint: LoopbackTransport, completions: int = 1, notes: int = 0, timeout: float = 2.0
) -> tuple[list[Completion], list[bytes]]:
    done: list[Completion] = []
    got: list[bytes] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end and (len(done) < completions or len(got) < notes):
        c, n = endpoint.poll()
        done += c
        got += [x.payload for x in n]
        time.sleep(0.001)
    return done, got


def test_loopback_is_a_transport() -> None:
    assert isinstance(LoopbackFabric(manual=True).endpoint("x"), Transport)


def test_write_and_read_move_exact_bytes_and_notify_after_landing() -> None:
    ends = Ends(LoopbackFabric(LinkModel(latency=1e-4, bandwidth=1e9)))
    seen: list[int] = []

    def on_note() -> None:
        seen.append(int(ends.b_mem[100]))  # the bytes are there before the notification

    ends.b.set_listener(on_note)
    ends.a.submit(1, OpKind.WRITE, "b", plan([(0, 10, 0, 100, 20)]), b"done")
    completions, _ = wait_for(ends.a)
    _, notes = wait_for(ends.b, completions=0, notes=1)
    assert completions == [Completion(1)] and notes == [b"done"]
    assert np.array_equal(ends.b_mem[100:120], ends.a_mem[10:30]) and seen and seen[0] == 10
    ends.b_mem[200:210] = 7
    ends.a.submit(2, OpKind.READ, "b", plan([(0, 0, 0, 200, 10)]), b"")
    assert wait_for(ends.a)[0] == [Completion(2)]
    assert (ends.a_mem[0:10] == 7).all()
    ends.fabric.close()


def test_refuses_unknown_peers_and_unregistered_memory() -> None:
    ends = Ends(LoopbackFabric(manual=True))
    with pytest.raises(TransportError, match="unknown peer"):
        ends.a.submit(1, OpKind.WRITE, "nobody", plan([(0, 0, 0, 0, 1)]), b"")
    with pytest.raises(TransportError, match="outside region"):
        ends.a.submit(1, OpKind.WRITE, "b", plan([(0, 250, 0, 0, 10)]), b"")
    with pytest.raises(TransportError, match="region 3 is not registered"):
        ends.a.submit(1, OpKind.WRITE, "b", plan([(0, 0, 3, 0, 1)]), b"")
    # a peer that advertises memory it never registered is caught when the op runs
    lying = Region(region_of(ends.b_mem).base + 4096, 64)
    ends.a.add_peer("b", b"b", [lying])
    ends.a.submit(2, OpKind.WRITE, "b", plan([(0, 0, 0, 0, 8)]), b"")
    ends.fabric.run_until_idle()
    (completion,), _ = ends.a.poll()
    assert completion.op_id == 2 and "not registered" in (completion.error or "")
    with pytest.raises(TransportError, match="host memory only"):
        ends.a.register_regions([Region(1, 1, MemoryType.VRAM)])
    with pytest.raises(ConfigError, match="already exists"):
        ends.fabric.endpoint("a")


def test_faults_are_deterministic_for_a_seed() -> None:
    def outcome(seed: int) -> list[str | None]:
        ends = Ends(LoopbackFabric(faults=FaultPlan(seed=seed, fail_rate=0.5), manual=True))
        for op in range(20):
            ends.a.submit(op, OpKind.WRITE, "b", plan([(0, 0, 0, 0, 4)]), b"")
        ends.fabric.run_until_idle()
        return [c.error for c in ends.a.poll()[0]]

    assert outcome(3) == outcome(3)
    assert outcome(3) != outcome(4)
    assert {e is None for e in outcome(3)} == {True, False}


def test_failed_write_tears_and_sends_no_notification() -> None:
    ends = Ends(LoopbackFabric(faults=FaultPlan(fail_ops={1}), manual=True))
    ends.a.submit(1, OpKind.WRITE, "b", plan([(0, 0, 0, 0, 4), (0, 100, 0, 100, 4)]), b"n")
    ends.fabric.run_until_idle()
    assert ends.a.poll()[0] == [Completion(1, "injected op failure")]
    assert ends.b.poll()[1] == []
    assert np.array_equal(ends.b_mem[0:4], ends.a_mem[0:4]) and not ends.b_mem[100:104].any()


def test_notifications_can_be_dropped_duplicated_and_reordered() -> None:
    faults = FaultPlan(seed=1, drop_rate=0.3, duplicate_rate=0.3, reorder_rate=0.3)
    ends = Ends(LoopbackFabric(faults=faults, manual=True))
    for op in range(40):
        ends.a.submit(op, OpKind.WRITE, "b", plan([(0, 0, 0, 0, 1)]), str(op).encode())
    ends.fabric.run_until_idle()
    ends.fabric.flush_held_notifications()
    got = [int(n.payload) for n in ends.b.poll()[1]]
    assert len(set(got)) < 40  # some dropped
    assert len(got) != len(set(got))  # some twice
    assert got != sorted(got)  # some out of order


def test_stalled_op_lands_late_unless_the_peer_is_removed() -> None:
    ends = Ends(LoopbackFabric(faults=FaultPlan(stall_ops={1, 2}), manual=True))
    ends.a.submit(1, OpKind.WRITE, "b", plan([(0, 5, 0, 5, 1)]), b"")
    assert not ends.fabric.step()  # stalled: nothing runs
    ends.fabric.unstall()
    assert ends.fabric.step() and ends.b_mem[5] == 5
    ends.a.submit(2, OpKind.WRITE, "b", plan([(0, 6, 0, 6, 1)]), b"")
    ends.a.remove_peer("b")  # after this, nothing of the op can land
    ends.fabric.unstall()
    ends.fabric.run_until_idle()
    assert ends.b_mem[6] == 0
    assert ends.a.poll()[0][-1].error is not None


def test_removing_a_peer_also_fences_its_ops_into_this_endpoint() -> None:
    ends = Ends(LoopbackFabric(faults=FaultPlan(stall_ops={1, 2}), manual=True))
    ends.a.submit(1, OpKind.WRITE, "b", plan([(0, 9, 0, 9, 1)]), b"late")  # a WRITE into b
    ends.b_mem[50] = 77
    ends.a.submit(2, OpKind.READ, "b", plan([(0, 0, 0, 50, 1)]), b"")  # a READ of b
    ends.b.remove_peer("a")  # b tears a down: nothing a issued may touch b's memory any more
    ends.fabric.unstall()
    ends.fabric.run_until_idle()
    assert ends.b_mem[9] == 0 and ends.a_mem[0] == 0
    assert [c.error is not None for c in ends.a.poll()[0]] == [True, True]
    assert ends.b.poll()[1] == []
    ends.a.submit(3, OpKind.WRITE, "b", plan([(0, 9, 0, 9, 1)]), b"later")  # a does not know yet
    ends.fabric.run_until_idle()
    assert ends.b_mem[9] == 0 and "does not accept" in (ends.a.poll()[0][0].error or "")


def test_killed_peer_fails_in_flight_and_later_ops() -> None:
    ends = Ends(LoopbackFabric(faults=FaultPlan(stall_ops={1}), manual=True))
    ends.a.submit(1, OpKind.WRITE, "b", plan([(0, 0, 0, 0, 1)]), b"")
    ends.fabric.kill("b")
    ends.fabric.run_until_idle()
    assert ends.a.poll()[0][0].error is not None
    with pytest.raises(TransportError, match="dead"):
        ends.a.submit(2, OpKind.WRITE, "b", plan([(0, 0, 0, 0, 1)]), b"")
    with pytest.raises(TransportError):
        ends.b.submit(3, OpKind.WRITE, "a", plan([(0, 0, 0, 0, 1)]), b"")


def test_link_model_serialises_ops_on_a_link() -> None:
    ends = Ends(LoopbackFabric(LinkModel(latency=0.0, bandwidth=256 * 20)))  # 256 B takes 50 ms
    start = time.monotonic()
    done = threading.Event()
    ends.a.set_listener(done.set)
    ends.a.submit(1, OpKind.WRITE, "b", plan([(0, 0, 0, 0, 128)]), b"")
    ends.a.submit(2, OpKind.WRITE, "b", plan([(0, 128, 0, 128, 128)]), b"")
    completions, _ = wait_for(ends.a, completions=2)
    elapsed = time.monotonic() - start
    assert [c.op_id for c in completions] == [1, 2]
    assert elapsed >= 0.045  # two 25 ms ops back to back on one link, not in parallel
    ends.fabric.close()


def test_a_named_fabric_is_shared_while_in_use_and_forgotten_with_its_last_endpoint() -> None:
    name = f"named-{id(object())}"
    fabric = named_fabric(name)
    assert named_fabric(name) is fabric
    a, b = fabric.endpoint("A"), named_fabric(name).endpoint("B")
    with pytest.raises(ConfigError, match="in use"):
        install_fabric(name, LoopbackFabric())
    a.close()
    assert named_fabric(name) is fabric  # B is still on it
    b.close()
    assert named_fabric(name) is not fabric  # forgotten with its last endpoint
    faulty = LoopbackFabric(faults=FaultPlan(fail_ops={1}))
    fresh = f"{name}-faults"
    install_fabric(fresh, faulty)
    endpoint = named_fabric(fresh).endpoint("C")
    assert endpoint.fabric is faulty
    endpoint.close()
    fabric.close()
    faulty.close()


def test_the_stand_ins_fabric_keys_never_reach_the_connectors_settings() -> None:
    extra = {"transport": "loopback", "fabric": "f1", "port": 0}
    assert fabric_of(extra) == ({"port": 0}, "f1")
    assert fabric_of({"transport": "loopback"}) == ({}, "default")
    assert fabric_of({"transport": "nixl", "fabric": "f2", "port": 1}) == ({"transport": "nixl", "port": 1}, None)
