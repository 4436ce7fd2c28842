"""The end-to-end integrity check (`EngineConfig.integrity`): P seals each WRITE with digests of
its KV, D checks what landed before the batch counts.

Real engines over the loopback fabric: a byte flipped in flight and a planner that sends a block
where another belongs each fail the transfer with the layer, the block and the two engines
named; a clean transfer with the check on moves the same bytes as one without; a seal is
checked as hostile input (any bytes decode or are refused, never raise anything else).  Between
ranks of other tensor parallelism and block sizes (the planner's property-test cases), the
check passes what the plan moved and fails a flipped byte or a swapped block.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import kvflow.runtime.dataplane as dataplane_module
from kvflow.control.channel import LocalControlHub
from kvflow.errors import ConfigError, InvalidBatch, PeerProtocolError, TransportUnavailable
from kvflow.layout import KVLayout, Region, plan_transfer
from kvflow.layout.plan import DescriptorPlan
from kvflow.layout.spec import MemoryType
from kvflow.protocol.actions import OpKind, SubmitOp
from kvflow.protocol.core import CoreConfig
from kvflow.protocol.messages import (
    MAX_NOTIFICATION_BYTES,
    Seal,
    TransferKey,
    decode_notification,
    encode_notification,
)
from kvflow.protocol.state import Outcome, Role
from kvflow.runtime.dataplane import DataPlane
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.runtime.integrity import Integrity, picked
from kvflow.transports.loopback import FaultPlan, LoopbackFabric
from kvflow_tools.testing import SMALL_SPEC, EnginePair, KVBuffers, same_kv
from tests.test_layout_hetero import Case as HeteroCase
from tests.test_layout_hetero import cases as hetero_cases

CHECKED = EngineConfig(
    core=CoreConfig(fence_timeout=0.5, retention=5.0), transfer_timeout=5.0, drain_timeout=2.0, integrity=True
)
UNCHECKED = EngineConfig(core=CoreConfig(fence_timeout=0.5, retention=5.0), transfer_timeout=5.0, drain_timeout=2.0)


async def push(pair: EnginePair, p_blocks: Sequence[int], d_blocks: Sequence[int]) -> tuple[Any, Any]:
    """One push transfer "r" of `p_blocks` into `d_blocks`, both results."""
    pair.p_kv.fill(p_blocks, seed=3)
    waiting = await pair.d.expect("r", 1, peer="P", block_ids=list(d_blocks))
    sending = await pair.p.kv_ready("r", 1, block_ids=list(p_blocks), peer="D")
    return await waiting.wait(10), await sending.wait(10)


@pytest.mark.asyncio
async def test_a_transfer_with_the_check_on_moves_the_kv_and_succeeds() -> None:
    pair = await EnginePair(LoopbackFabric(), config=CHECKED).start()
    try:
        d, p = await push(pair, [5, 6, 7], [1, 2, 3])
        assert d.ok and p.ok, (d, p)
        assert same_kv(pair.p_kv, [5, 6, 7], pair.d_kv, [1, 2, 3])
    finally:
        await pair.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("checked", [True, False], ids=["check-on", "check-off"])
async def test_a_byte_flipped_in_flight_fails_the_transfer_naming_the_layer_and_the_block(checked: bool) -> None:
    """The loopback fabric flips the first byte of the WRITE's last descriptor (the last layer's V,
    from D's first block on).  Without the check, what it is for: the transfer "succeeds" with a
    wrong byte in D."""
    faulty = LoopbackFabric(faults=FaultPlan(corrupt_ops={1}))
    pair = await EnginePair(faulty, config=CHECKED if checked else UNCHECKED).start()
    try:
        d, p = await push(pair, [5, 6, 7], [1, 2, 3])
        if checked:
            assert d.outcome is Outcome.FAILED
            last_layer = SMALL_SPEC.num_layers - 1
            assert f"integrity: P -> D: the bytes that landed in layer {last_layer} and block 1 differ" in d.reason
            assert pair.d.stats()["integrity_mismatches"] == 1
        else:
            assert d.ok and p.ok
            assert not same_kv(pair.p_kv, [5], pair.d_kv, [1]) and same_kv(pair.p_kv, [6, 7], pair.d_kv, [2, 3])
            assert pair.d.stats()["integrity_mismatches"] == 0
    finally:
        await pair.close()


@pytest.mark.asyncio
async def test_a_planner_that_swaps_two_blocks_fails_the_transfer_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """P's digests come from its blocks by the layout, not from the planner's descriptors: a
    planted wrong block mapping (P's first and last block sent to each other's place) is seen."""

    def swapping(
        local: KVLayout, remote: KVLayout, local_blocks: Sequence[int], *args: Any, **kw: Any
    ) -> DescriptorPlan:
        blocks = list(local_blocks)
        blocks[0], blocks[-1] = blocks[-1], blocks[0]
        return plan_transfer(local, remote, blocks, *args, **kw)

    monkeypatch.setattr(dataplane_module, "plan_transfer", swapping)
    pair = await EnginePair(LoopbackFabric(), config=CHECKED).start()
    try:
        d, _ = await push(pair, [5, 6, 7], [1, 2, 3])
        assert d.outcome is Outcome.FAILED
        assert "in layers 0, 1 and blocks 1, 3 differ from what P holds" in d.reason, d.reason
    finally:
        await pair.close()


@pytest.mark.asyncio
async def test_d_hashes_off_its_event_loop_and_a_transfer_gone_meanwhile_is_not_a_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D's check of a sealed WRITE runs on the engine's writer thread, so that hashing a long
    prompt's KV does not stall the loop; while it runs the loop goes on (here: D's transfer is
    aborted meanwhile), and a check that ends after its transfer is gone is not counted as a
    mismatch (the blocks may hold another request's KV by then)."""
    where: list[str] = []
    running, release = threading.Event(), threading.Event()
    verify = Integrity._verify

    def held(self: Integrity, *args: Any) -> str | None:
        where.append(threading.current_thread().name)
        running.set()
        assert release.wait(10)
        return verify(self, *args) or "integrity: a planted mismatch"

    fed, checked = threading.Event(), DataPlane._checked

    def feeding(self: DataPlane, *args: Any) -> None:
        checked(self, *args)
        fed.set()

    monkeypatch.setattr(Integrity, "_verify", held)
    monkeypatch.setattr(DataPlane, "_checked", feeding)
    pair = await EnginePair(LoopbackFabric(), config=CHECKED).start()
    try:
        pair.p_kv.fill([5, 6], seed=3)
        waiting = await pair.d.expect("r", 1, peer="P", block_ids=[1, 2])
        await pair.p.kv_ready("r", 1, block_ids=[5, 6], peer="D")
        await asyncio.get_running_loop().run_in_executor(None, running.wait, 10)
        await pair.d.abort("r", 1, Role.DECODE, "the request ended")  # the loop is not held
        release.set()
        result = await waiting.wait(10)
        assert result.outcome is Outcome.ABORTED and where == ["kvflow-writer-D"]
        assert await asyncio.get_running_loop().run_in_executor(None, fed.wait, 10)  # the check's end fed
        assert pair.d.stats()["integrity_mismatches"] == 0 and not pair.d.crashed
    finally:
        release.set()
        await pair.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(("p_checks", "d_checks"), [(False, True), (True, False)])
async def test_the_check_on_one_side_only(p_checks: bool, d_checks: bool) -> None:
    """D with the check on refuses an unsealed WRITE; D with it off takes a sealed one."""
    fabric, hub = LoopbackFabric(), LocalControlHub()
    p_kv, d_kv = KVBuffers(SMALL_SPEC, 16), KVBuffers(SMALL_SPEC, 16)
    configs = {True: CHECKED, False: UNCHECKED}
    p = Engine("P", p_kv.layout, fabric.endpoint("P"), hub.channel("P"), config=configs[p_checks])
    d = Engine("D", d_kv.layout, fabric.endpoint("D"), hub.channel("D"), config=configs[d_checks])
    await p.start()
    await d.start()
    try:
        await d.connect("P")
        p_kv.fill([5], seed=3)
        waiting = await d.expect("r", 1, peer="P", block_ids=[1])
        await p.kv_ready("r", 1, block_ids=[5], peer="D")
        result = await waiting.wait(10)
        if d_checks:
            assert result.outcome is Outcome.FAILED and "came without digests" in result.reason, result.reason
        else:
            assert result.ok and same_kv(p_kv, [5], d_kv, [1])
    finally:
        await p.aclose()
        await d.aclose()
        fabric.close()


@given(st.lists(st.binary(max_size=300), min_size=1, max_size=6))
def test_a_unit_digest_is_xxh3_of_its_chunks_one_after_the_other(chunks: list[bytes]) -> None:
    """Hashed without joining (no copy of a block's arrays): the same XXH3-64 as of the joined
    bytes, so the digest depends on the bytes alone, not on how a layout cuts them."""
    assert Integrity("P", KVBuffers(SMALL_SPEC, 1).layout).hash(chunks) == xxhash.xxh3_64_intdigest(b"".join(chunks))


def test_gpu_memory_needs_the_cuda_driver_and_says_so_when_the_engine_is_made() -> None:
    layout = KVLayout.per_layer_regions(SMALL_SPEC, 4, [Region(4096, 512, MemoryType.VRAM)] * SMALL_SPEC.num_layers)
    try:
        Integrity("P", layout)
    except TransportUnavailable as exc:  # CI: no driver (a GPU host makes the check)
        assert "libcuda.so.1" in str(exc)


def _on_gpu(layout: KVLayout, reads: list[int]) -> tuple[KVLayout, Any]:
    """`layout` relabelled as GPU memory, and a copy function standing in for the driver's
    cuMemcpyDtoH (it reads the same bytes, counting the reads)."""

    def copy(device: int, address: int, length: int) -> bytes:
        reads.append(length)
        return ctypes.string_at(address, length)

    regions = tuple(replace(r, memory=MemoryType.VRAM) for r in layout.regions)
    return replace(layout, regions=regions), copy


KEY = TransferKey("r", 1)
SEAL = Seal((1, 2), (0, 2), 1, 3, ((0, 11), (1, 12)), ((1, 2**64 - 1), (2, 0)))


def test_a_seal_round_trips_and_a_plain_notification_has_none() -> None:
    assert decode_notification(encode_notification(KEY, 3, True, SEAL)) == (KEY, 3, True, SEAL)
    assert decode_notification(encode_notification(KEY, 0)) == (KEY, 0, False, None)


def test_a_seal_too_large_for_a_notification_is_refused_when_sealing() -> None:
    many = tuple(range(3000))
    seal = Seal(many, None, 0, len(many), (), tuple((block, 7) for block in many))
    with pytest.raises(InvalidBatch, match=f"over {MAX_NOTIFICATION_BYTES}: push in smaller batches"):
        encode_notification(KEY, 0, False, seal)


HOSTILE = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.binary(max_size=24) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=8),
    max_leaves=24,
)


@given(HOSTILE)
def test_any_seal_a_peer_sends_decodes_or_is_refused_as_a_protocol_error(seal: Any) -> None:
    try:
        payload = msgpack.packb(["kvf1", "r", 1, 0, False, seal])
    except (OverflowError, ValueError):
        return  # msgpack cannot carry it: no peer can send it
    try:
        _, _, _, decoded = decode_notification(payload)
    except PeerProtocolError:
        return
    assert isinstance(decoded, Seal) and len(decoded.blocks) == len(set(decoded.blocks)) > 0


def test_d_checks_only_blocks_it_registered_and_leaves_a_malformed_payload_to_the_inbox() -> None:
    kv = KVBuffers(SMALL_SPEC, 8)
    check = Integrity("D", kv.layout).check
    stranger = encode_notification(KEY, 0, True, Seal((1, 6), None, 0, 2, (), ()))
    assert "names blocks [6] D did not register for" in (check("P", stranger, kv.layout, lambda key: (1, 2)) or "")
    beyond = encode_notification(KEY, 0, True, Seal((1,), (0, 9), 0, 1, (), ()))
    assert "does not map onto D's KV cache: layers 0..9 outside" in (
        check("P", beyond, kv.layout, lambda key: (1,)) or ""
    )
    unfilled = encode_notification(KEY, 0, True, Seal((1,), None, 0, 2, (), ()))  # 2 P blocks in one D block
    assert "2 P blocks from position 0" in (check("P", unfilled, kv.layout, lambda key: (1,)) or "")
    assert check("P", b"\xc1 not msgpack", kv.layout, lambda key: ()) is None
    assert check("P", stranger, kv.layout, lambda key: ()) is None  # no such transfer: the inbox counts it


def test_p_refuses_to_seal_a_write_its_planner_would_refuse_and_seals_every_other_whatever_its_sample() -> None:
    p_kv, other = KVBuffers(SMALL_SPEC, 4), KVBuffers(replace(SMALL_SPEC, block_size=6), 4)
    op = SubmitOp(1, KEY, "D", OpKind.WRITE, (0,), (0,), None, encode_notification(KEY, 0, True))
    with pytest.raises(InvalidBatch, match="cannot read this WRITE: .*do not fill blocks of 6"):
        Integrity("P", p_kv.layout).seal(op, other.layout)  # blocks of 4 tokens and of 6
    for every in (1, 2, 1000):  # P cannot know which transfers D checks, so it seals them all
        assert decode_notification(Integrity("P", p_kv.layout, every=every).seal(op, p_kv.layout))[3] is not None


def _in_memory(layout: KVLayout) -> tuple[KVLayout, npt.NDArray[np.uint8]]:
    """`layout` over real memory of its size (the planner's tests give made-up addresses)."""
    (region,) = layout.regions
    memory = np.zeros(region.length, dtype=np.uint8)
    return replace(layout, regions=(Region(memory.ctypes.data, region.length),)), memory


def _write(plan: DescriptorPlan, source: npt.NDArray[np.uint8], target: npt.NDArray[np.uint8]) -> list[int]:
    """Do what the plan's descriptors say (one region each side); the target offsets written."""
    written: list[int] = []
    for d in plan:
        target[d.remote_offset : d.remote_offset + d.length] = source[d.local_offset : d.local_offset + d.length]
        written += range(d.remote_offset, d.remote_offset + d.length)
    return written


@settings(max_examples=150, deadline=None)
@given(hetero_cases(), st.randoms(use_true_random=False), st.sampled_from(["host", "gpu", "p-gpu", "d-gpu"]))
def test_heterogeneous_ranks_and_block_sizes_check_what_each_write_carries(
    case: HeteroCase, rng: Any, memory: str
) -> None:
    """Any pair of ranks the planner moves KV between (other tensor parallelism: the heads both
    hold; other block sizes: P's blocks at token offsets in D's, from any `fine_start`): a WRITE
    that moved what the plan says passes D's check; one byte of it flipped, or D's first two
    blocks swapped in the plan (where that changes D's bytes), fails it naming a block.  Either
    side's KV may be GPU memory, read through the driver's copy (here one that reads the same
    bytes): the digests are the same whatever memory holds them."""
    (p, p_memory), (d, d_memory) = _in_memory(case[0]), _in_memory(case[1])
    reads: list[int] = []
    p_copy = d_copy = None
    if memory in ("gpu", "p-gpu"):
        p, p_copy = _on_gpu(p, reads)
    if memory in ("gpu", "d-gpu"):
        d, d_copy = _on_gpu(d, reads)
    lids, rids, layers, start = case[2], case[3], (case[4].start, case[4].stop), case[5]
    p_memory[:] = np.frombuffer(rng.randbytes(p_memory.size), dtype=np.uint8)
    d_memory[:] = np.frombuffer(rng.randbytes(d_memory.size), dtype=np.uint8)
    op = SubmitOp(1, KEY, "D", OpKind.WRITE, tuple(lids), tuple(rids), layers, encode_notification(KEY, 0), start)
    sealed = Integrity("P", p, device_copy=p_copy).seal(op, d)
    check = Integrity("D", d, device_copy=d_copy).check
    clean = d_memory.copy()
    written = _write(plan_transfer(p, d, lids, rids, layers, fine_start=start), p_memory, d_memory)
    assert check("P", sealed, p, lambda key: rids) is None
    assert bool(reads) == (memory != "host")  # GPU memory was read through the copy, and only it
    flipped = rng.choice(written)
    d_memory[flipped] ^= 0x01
    assert "differ from what P holds" in (check("P", sealed, p, lambda key: rids) or "")
    if len(rids) > 1:
        d_memory[flipped] ^= 0x01
        faithful, d_memory[:] = d_memory.copy(), clean
        swapped = [rids[1], rids[0], *rids[2:]]
        _write(plan_transfer(p, d, lids, swapped, layers, fine_start=start), p_memory, d_memory)
        if (d_memory[written] != faithful[written]).any():  # tiny random blocks can be equal
            assert "differ from what P holds" in (check("P", sealed, p, lambda key: rids) or "")


def test_d_checks_one_transfer_in_n_picked_by_a_secret_no_one_else_holds() -> None:
    """`integrity_sample` N: D checks about one transfer in N, picked by a digest keyed with a
    secret each D draws for itself, so that whoever names the transfers (a client, the router)
    or writes them (P) cannot tell which are checked: two D engines pick different transfers, and
    D's picks are not the ones a digest of the id alone (or of the id under another key) gives.
    Every WRITE must come sealed, picked or not, and name only the transfer's blocks."""
    keys = [TransferKey(f"request-{i}", 1) for i in range(2000)]
    p_kv, d_kv = KVBuffers(SMALL_SPEC, 4), KVBuffers(SMALL_SPEC, 4)
    sealer = Integrity("P", p_kv.layout)
    d1, d2 = Integrity("D", d_kv.layout, every=4), Integrity("D", d_kv.layout, every=4)

    def checks(d: Integrity, key: TransferKey, payload: bytes, mine: tuple[int, ...] = (0,)) -> bool:
        return d.prepare("P", payload, p_kv.layout, lambda k: mine if k == key else ()) is not None

    def sealed(key: TransferKey) -> bytes:
        op = SubmitOp(1, key, "D", OpKind.WRITE, (0,), (0,), None, encode_notification(key, 0))
        return sealer.seal(op, d_kv.layout)

    first = {key for key in keys if checks(d1, key, sealed(key))}
    second = {key for key in keys if checks(d2, key, sealed(key))}
    assert 400 < len(first) < 600 and 400 < len(second) < 600
    assert len(first & second) < 250  # independent picks share about a quarter (125); one rule would share all
    assert first == {key for key in keys if checks(d1, key, sealed(key))}  # the same transfer, the same pick
    assert first == {key for key in keys if picked(key, 4, d1._secret)}
    assert first != {key for key in keys if picked(key, 4, b"")}  # no key: what anyone could work out
    assert all(picked(key, 1, d1._secret) for key in keys)
    # unpicked, yet unsealed or naming a block D did not register for it: refused all the same
    unpicked = next(key for key in keys if key not in first)
    unsealed = d1.check("P", encode_notification(unpicked, 0, True), p_kv.layout, lambda k: (0,))
    assert unsealed is not None and "came without digests" in unsealed
    stranger = d1.check("P", sealed(unpicked), p_kv.layout, lambda k: (3,))
    assert stranger is not None and "names blocks [0] D did not register" in stranger
    with pytest.raises(ConfigError, match="integrity_sample"):
        EngineConfig(integrity=True, integrity_sample=0)
