"""The ZeroMQ control channel: real sockets on 127.0.0.1, authentication, a live fuzz."""

from __future__ import annotations

import asyncio
import logging
import random
import selectors
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgpack
import pytest
import pytest_asyncio
import zmq

from kvflow.control import wire
from kvflow.control.auth import Secret
from kvflow.control.channel import MAX_CLOCK_SKEW, LocalControlHub, incarnation_ceiling, new_incarnation
from kvflow.control.connections import ConnectionWatch
from kvflow.control.counts import ControlCounts, Rejection
from kvflow.control.receiving import YIELD_EVERY
from kvflow.control.sockets import RECEIVE_QUEUE, is_loopback
from kvflow.control.zeromq import ZmqControl
from kvflow.errors import ConfigError, EngineClosed, HandshakeTimeout, PeerUnknown, PeerUnreachable, UsageError
from kvflow.protocol.messages import (
    MAX_EPOCH,
    ControlMessage,
    Goodbye,
    Heartbeat,
    Notice,
    Ready,
    Registration,
    Reject,
    TransferKey,
)
from kvflow.protocol.state import Mode, Outcome, Role, State
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.transports.loopback import LoopbackFabric
from kvflow_tools.testing import SMALL_SPEC, KVBuffers, same_kv
from kvflow_tools.testing.fuzz import connection_flood, insider_dealer
from tests.waiting import eventually

SECRET = Secret(b"a shared secret of some length")
CONFIG = EngineConfig(transfer_timeout=10.0, drain_timeout=1.0)


@dataclass
class Pair:
    p: Engine
    d: Engine
    p_kv: KVBuffers
    d_kv: KVBuffers
    fabric: LoopbackFabric


async def make_pair(
    secret: Secret | None, d_secret: Secret | None = None, connect: bool = True, curve: bool = True
) -> Pair:
    fabric = LoopbackFabric()
    p_kv, d_kv = KVBuffers(SMALL_SPEC, 16), KVBuffers(SMALL_SPEC, 16)
    p = Engine("P", p_kv.layout, fabric.endpoint("P"), ZmqControl("P", secret=secret, curve=curve), config=CONFIG)
    d_channel = ZmqControl("D", secret=d_secret if d_secret is not None else secret, curve=curve)
    d = Engine("D", d_kv.layout, fabric.endpoint("D"), d_channel, config=CONFIG)
    await p.start()
    await d.start()
    if connect:
        await d.connect("P", p.control.address, timeout=5)
    return Pair(p, d, p_kv, d_kv, fabric)


async def close(pair: Pair) -> None:
    await pair.d.aclose()
    await pair.p.aclose()
    pair.fabric.close()


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[Pair]:
    engines = await make_pair(SECRET)
    yield engines
    await close(engines)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", list(Mode))
async def test_transfers_over_authenticated_zeromq(pair: Pair, mode: Mode) -> None:
    assert pair.p.control.address.startswith("tcp://127.0.0.1:")
    pair.p_kv.fill([4, 5], seed=1)
    waiting = await pair.d.expect("r", 1, peer="P", block_ids=[1, 2], mode=mode)
    await pair.p.kv_ready("r", 1, block_ids=[4, 5], mode=mode, peer="D")
    assert (await waiting.wait(5)).ok
    assert same_kv(pair.p_kv, [4, 5], pair.d_kv, [1, 2])
    assert isinstance(pair.p.control, ZmqControl) and pair.p.control.counters["rejected"] == 0


@pytest.mark.asyncio
async def test_without_a_secret_loopback_works_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvflow.control.zeromq"):
        engines = await make_pair(None)
    try:
        assert "WITHOUT authentication" in caplog.text
        waiting = await engines.d.expect("r", 1, peer="P", block_ids=[1])
        await engines.p.kv_ready("r", 1, block_ids=[2])
        assert (await waiting.wait(5)).ok
    finally:
        await close(engines)


def test_incarnations_grow_and_fit_the_wire_for_centuries(monkeypatch: pytest.MonkeyPatch) -> None:
    year = 365.25 * 86400 * 10**9
    ids = []
    for at in (56 * year, 56 * year + 1000, 71.5 * year, 1100 * year):  # 2026, a microsecond on, 2041, 3070
        monkeypatch.setattr("time.time_ns", lambda at=at: int(at))
        ids.append(new_incarnation())
    assert ids == sorted(set(ids)) and ids[-1] <= MAX_EPOCH


def test_unauthenticated_off_loopback_is_refused() -> None:
    assert is_loopback("tcp://127.0.0.5:1") and is_loopback("tcp://[::1]:1") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://0.0.0.0:1") and not is_loopback("tcp://10.1.2.3:1")
    with pytest.raises(ConfigError, match="KVFLOW_SECRET"):
        ZmqControl("x", bind="tcp://0.0.0.0:0", secret=None)
    with pytest.raises(ConfigError, match="KVFLOW_SECRET"):
        ZmqControl("x", secret=None).add_route("y", "tcp://192.0.2.1:5000")
    ZmqControl("x", bind="tcp://0.0.0.0:0", secret=SECRET)  # with a secret, any interface
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="handshake_timeout must be positive"):
            ZmqControl("x", secret=SECRET, handshake_timeout=bad)


@pytest.mark.parametrize(
    "address", ["tcp://prefill.example:5700", "tcp://localhost:5700", "tcp://127.0.0.1;10.0.0.1:5700", "tcp://1.2.3:5"]
)
def test_a_route_to_a_host_name_is_refused_before_zeromq_would_resolve_it(address: str) -> None:
    # libzmq resolves a name with a blocking lookup on its one I/O thread (at every reconnect
    # too): a slow resolver would stall every peer's control traffic.  Hellos name routes too.
    control = ZmqControl("x", secret=SECRET)
    with pytest.raises(ConfigError, match="literal IPv4|not an IP address"):
        control.add_route("y", address)
    control.add_route("y", "tcp://10.1.2.3:5700")  # literal addresses, v4 and v6, are fine
    control.add_route("z", "tcp://[fd00::1]:5700")


class CountingSelector(selectors.DefaultSelector):
    """The loop's selector, counting its turns (each turn of an asyncio loop selects once)."""

    turns = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        self.turns += 1
        return super().select(timeout)


def test_a_connection_flood_costs_the_event_loop_no_turn_per_connection() -> None:
    # Each stranger's connection is three monitor events (accepted, handshake failed when the
    # 0.2 s handshake interval runs out, disconnected).  They are counted off the loop: the
    # loop, waiting for the flood to end, turns a few times, not once per event.
    connections = 300
    selector = CountingSelector()
    loop = asyncio.SelectorEventLoop(selector)
    control = ZmqControl("P", secret=SECRET, handshake_timeout=0.2)

    async def flood() -> int:
        control.start(asyncio.get_running_loop(), lambda *message: None)
        try:
            before = selector.turns
            stats = await asyncio.get_running_loop().run_in_executor(
                None, lambda: connection_flood(control.address, connections=connections, hold=30.0)
            )
            turns = selector.turns - before
            opened = stats.sent  # a connect the kernel's full backlog held past its timeout was not
            assert opened >= connections // 2 and stats.refused == connections  # each one closed by P
            counted = lambda: control.counters["rejected_handshake"] == opened  # noqa: E731
            await eventually(counted, "every connection is counted")
            assert control.counters["connections_accepted"] == opened
            await eventually(lambda: control.counters["connections_open"] == 0, "every connection is closed")
            return turns
        finally:
            control.close()
            await asyncio.sleep(0)  # the cancelled ZAP handler ends

    try:
        turns = loop.run_until_complete(flood())
    finally:
        loop.close()
    assert not [t for t in threading.enumerate() if t.name == "kvflow-connections-P"]  # stopped with the channel
    assert turns < connections // 10, f"the loop turned {turns} times for about {3 * connections} connection events"


class FailingMonitor:
    """A monitor socket whose first polls raise `errors`, then one with nothing to read, which
    waits until the test is done (`done`), as a poll of an idle monitor would wait."""

    def __init__(self, *errors: zmq.ZMQError) -> None:
        self.errors = list(errors)
        self.polled_after_errors = threading.Event()
        self.done = threading.Event()
        self.closed = threading.Event()

    def poll(self, timeout: int) -> int:
        if self.errors:
            raise self.errors.pop(0)
        self.polled_after_errors.set()
        self.done.wait(timeout / 1000)
        return 0

    def close(self, linger: int | None = None) -> None:
        self.closed.set()


def test_a_monitor_error_is_logged_and_the_watch_reads_on_since_an_unread_monitor_blocks_libzmq(
    caplog: pytest.LogCaptureFixture,
) -> None:
    monitor = FailingMonitor(zmq.ZMQError(zmq.EFAULT), zmq.ZMQError(zmq.EINVAL))
    with caplog.at_level(logging.WARNING, logger="kvflow.control.zeromq"):
        watch = ConnectionWatch(monitor, "P")  # type: ignore[arg-type]
        try:
            assert monitor.polled_after_errors.wait(30.0), "the watch stopped reading after a monitor error"
        finally:
            monitor.done.set()
            watch.close()
    assert monitor.closed.is_set()
    assert "the connection monitor could not read" in caplog.text and "P" in caplog.text


def test_a_terminating_context_ends_the_watch_quietly() -> None:
    monitor = FailingMonitor(zmq.ZMQError(zmq.ETERM))
    watch = ConnectionWatch(monitor, "P")  # type: ignore[arg-type]
    assert monitor.closed.wait(30.0)  # the thread closed its socket and ended, without being told
    assert not monitor.polled_after_errors.is_set()
    watch.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("curve", [True, False])
async def test_a_peer_with_another_secret_is_never_heard(caplog: pytest.LogCaptureFixture, curve: bool) -> None:
    engines = await make_pair(SECRET, Secret(b"another secret, same length!!"), connect=False, curve=curve)
    try:
        with caplog.at_level(logging.WARNING, logger="kvflow.control.zeromq"), pytest.raises(HandshakeTimeout):
            await engines.d.connect("P", engines.p.control.address, timeout=0.5)
        assert isinstance(engines.p.control, ZmqControl)
        counters = engines.p.control.counters
        if curve:  # its connection never completes the handshake: not one of its frames is read
            assert counters["rejected_handshake_protocol"] >= 1 and counters["frames_received"] == 0
            assert caplog.text.count("control plane dropped rejected_handshake") == 1  # then only counted
        else:
            assert counters["rejected_bad_mac"] >= 1
            assert caplog.text.count("dropping control frames") == 1  # logged once, then counted
        assert engines.p.peers() == []
        assert "another secret" not in caplog.text and "a shared secret" not in caplog.text
    finally:
        await close(engines)


def fuzz_frames(valid: list[bytes], rng: random.Random, n: int) -> list[list[bytes]]:
    """Random, mutated, truncated, oversized, replayed and badly signed multipart frames."""
    out: list[list[bytes]] = []
    for i in range(n):
        kind = i % 7
        base = rng.choice(valid)
        if kind == 0:
            frame = [rng.randbytes(rng.randint(0, 200)), rng.randbytes(32)]
        elif kind == 1:
            mutated = bytearray(base)
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] ^= rng.randint(1, 255)
            frame = [bytes(mutated), SECRET.sign(base)]
        elif kind == 2:
            frame = [base[: rng.randrange(len(base))], SECRET.sign(base)]
        elif kind == 3 and i % 70 == 3:  # about 140 of these: each is over a MiB
            frame = [rng.randbytes(wire.MAX_FRAME_BYTES + 1 + rng.randint(0, 1000)), b""]
        elif kind == 3:
            frame = [rng.randbytes(rng.randint(1, 64)), b""]  # short and unsigned
        elif kind == 4:
            frame = [base, SECRET.sign(base)]  # a replay: every one of these was sent before
        elif kind == 5:
            frame = [base, Secret(b"the attacker's own secret key").sign(base)]
        else:
            frame = [base] + [rng.randbytes(8)] * rng.choice([0, 2, 3])  # wrong number of parts
        out.append(frame)
    return out


@pytest.mark.asyncio
async def test_live_fuzz_of_a_running_engine(pair: Pair) -> None:
    waiting = await pair.d.expect("held", 1, peer="P", block_ids=[3], timeout=60)
    held = (TransferKey("held", 1), Role.PREFILL)
    await eventually(lambda: held in {m.owner for m in pair.p.core.machines()}, "P has D's registration")
    assert pair.p.core.machine(*held).state is State.REGISTERED
    before = [(m.key, m.role, m.state, m.deadline) for m in pair.p.core.machines() + pair.d.core.machines()]
    stats_before = pair.p.stats()
    assert isinstance(pair.p.control, ZmqControl)
    control = pair.p.control
    rejected_before = control.counters["rejected"]
    # A sender that holds the secret but is not associated: its valid frames are accepted by the
    # channel and dropped by the engine; replayed afterwards, the channel itself refuses them.
    key = TransferKey("held", 1)
    samples: list[ControlMessage] = [
        Registration(key, (0, 1), 1, 5.0),
        Ready(key, (1,)),
        Notice(key, Outcome.ABORTED, "x"),
        Heartbeat((key,)),
    ]
    bound = control.incarnation
    valid = [wire.encode(wire.Envelope("mallory", 1, "P", seq, msg, bound)) for seq, msg in enumerate(samples, start=1)]
    ctx = zmq.Context()
    sock = insider_dealer(ctx, b"mallory", control.address, SECRET)
    sock.setsockopt(zmq.SNDHWM, 0)
    for signed in valid:
        sock.send_multipart([signed, SECRET.sign(signed)])
    frames = fuzz_frames(valid, random.Random(7), 10_000)
    for frame in frames:
        sock.send_multipart(frame)
    # wait until every frame was seen (oversized ones may also drop the connection), however
    # long a loaded machine takes: the bound only guards against a hang
    unknown = stats_before["messages_from_unknown_peers"] + 4

    def read_all() -> bool:
        rejected = control.counters["rejected"] - rejected_before
        return rejected >= len(frames) and pair.p.stats()["messages_from_unknown_peers"] >= unknown

    await eventually(read_all, "P read every fuzzed frame and dropped the 4 valid ones", timeout=120)
    sock.close()
    ctx.term()
    assert control.counters["rejected"] - rejected_before == len(frames)
    after = [(m.key, m.role, m.state, m.deadline) for m in pair.p.core.machines() + pair.d.core.machines()]
    assert after == before and pair.p.crashed == [] and pair.d.crashed == []
    stats_after = pair.p.stats()
    assert stats_after.pop("messages_from_unknown_peers") == stats_before.pop("messages_from_unknown_peers") + 4
    assert stats_after == stats_before
    reasons = {k for k, v in control.counters.items() if k.startswith("rejected_") and v}
    assert {"rejected_bad_mac", "rejected_oversized", "rejected_replayed", "rejected_shape"} <= reasons
    # still alive: the transfer that was waiting completes
    pair.p_kv.fill([9], seed=2)
    await pair.p.kv_ready("held", 1, block_ids=[9])
    assert (await waiting.wait(5)).ok


@pytest.mark.asyncio
async def test_another_protocol_version_is_refused_with_the_reason() -> None:
    engines = await make_pair(SECRET, connect=False)
    ctx = zmq.Context()
    sender = insider_dealer(ctx, b"future", engines.p.control.address, SECRET)
    try:
        frame = msgpack.packb(
            [wire.MAGIC, wire.VERSION + 1, "future", 1, "P", 1, 1, ["whatever", "the", "future", "holds"]]
        )
        sender.send_multipart([frame, SECRET.sign(frame)])
        # the answer comes back on the connection the frame came in on
        await eventually(lambda: bool(sender.poll(0)), "P answers a frame of another version")
        answer, mac = sender.recv_multipart()
        assert SECRET.verify(answer, mac)
        reject = wire.decode(answer).message
        assert f"speaks control protocol version {wire.VERSION + 1}; this engine speaks {wire.VERSION}" in getattr(
            reject, "reason", ""
        )
    finally:
        sender.close()
        ctx.term()
        await close(engines)


@pytest.mark.asyncio
async def test_send_failures_say_whether_the_peer_is_unknown_or_unreachable() -> None:
    routes = {"slow": "tcp://127.0.0.1:9", "bad": "bogus://x"}  # nothing reads on port 9 (discard)
    control = ZmqControl("A", secret=SECRET, routes=routes, send_queue=1)
    with pytest.raises(UsageError, match="used before it was started"):
        control.send("slow", Goodbye("x"))
    control.start(asyncio.get_running_loop(), lambda sender, incarnation, message: None)
    try:
        with pytest.raises(PeerUnknown, match="no control address known for 'nobody'"):
            control.send("nobody", Goodbye("x"))
        with pytest.raises(PeerUnreachable, match="cannot connect to 'bad' at bogus://x"):
            control.send("bad", Goodbye("x"))
        with pytest.raises(PeerUnreachable, match="control queue to 'slow' is full"):
            for _ in range(100):
                control.send("slow", Goodbye("x"))
        assert control.counters["send_queue_full"] == 1
        with pytest.raises(UsageError, match="already started"):
            control.start(asyncio.get_running_loop(), lambda sender, incarnation, message: None)
    finally:
        control.close()
    with pytest.raises(EngineClosed, match="is closed"):
        control.send("slow", Goodbye("x"))
    hub = LocalControlHub()
    gone = asyncio.new_event_loop()
    gone.close()
    hub.channel("gone").start(gone, lambda sender, incarnation, message: None)
    with pytest.raises(PeerUnknown, match="no engine named 'nobody'"):
        hub.channel("me").send("nobody", Goodbye("x"))
    with pytest.raises(PeerUnreachable, match="'gone' is no longer running"):
        hub.channel("me").send("gone", Goodbye("x"))


@pytest.mark.asyncio
async def test_frames_for_an_earlier_run_of_the_receiver_are_refused() -> None:
    # Frames a holder of the secret signed for P's earlier run (as recorded on the path): P, restarted
    # under the same name, has an empty replay guard, and refuses them by the run they name.
    earlier = ZmqControl("P", secret=SECRET)
    earlier.start(asyncio.get_running_loop(), lambda sender, incarnation, message: None)
    earlier.close()
    got: list[ControlMessage] = []
    restarted = ZmqControl("P", secret=SECRET)
    restarted.start(asyncio.get_running_loop(), lambda sender, incarnation, message: got.append(message))
    ctx = zmq.Context()
    sock = insider_dealer(ctx, b"D", restarted.address, SECRET)
    try:
        runs = [earlier.incarnation, 0, 0, restarted.incarnation]  # earlier run, none (twice), this run
        messages: list[ControlMessage] = [Goodbye("old"), Goodbye("unbound"), Reject("opening"), Goodbye("now")]
        for seq, (run, message) in enumerate(zip(runs, messages, strict=True), start=1):
            frame = wire.encode(wire.Envelope("D", 7, "P", seq, message, run))
            sock.send_multipart([frame, SECRET.sign(frame)])
        await eventually(lambda: restarted.counters["frames_received"] == 4, "P read every frame")
        assert restarted.counters["rejected_stale"] == 1 and restarted.counters["rejected_unbound"] == 1
        assert got == [Reject("opening"), Goodbye("now")]  # a Reject may come before any contact
    finally:
        sock.close()
        ctx.term()
        restarted.close()


@pytest.mark.asyncio
async def test_a_frame_from_a_run_no_clock_reads_yet_is_refused_and_the_real_run_still_heard() -> None:
    # An insider's Hello as "D" with incarnation 2**63 - 1, accepted, would make the real D's
    # frames (today's clock) replays of an older run until P restarts.
    got: list[tuple[int, ControlMessage]] = []
    p = ZmqControl("P", secret=SECRET)
    p.start(asyncio.get_running_loop(), lambda sender, incarnation, message: got.append((incarnation, message)))
    ctx = zmq.Context()
    sock = insider_dealer(ctx, b"D", p.address, SECRET)
    try:
        now = new_incarnation()
        future = incarnation_ceiling(time.time_ns() + 3600 * 10**9)  # a clock an hour past the skew allowed
        for seq, run in enumerate([MAX_EPOCH, future, now], start=1):
            frame = wire.encode(wire.Envelope("D", run, "P", seq, Reject(f"run {run}"), 0))
            sock.send_multipart([frame, SECRET.sign(frame)])
        await eventually(lambda: p.counters["frames_received"] == 3, "P read every frame")
        assert p.counters["rejected_future"] == 2, p.counters
        assert got == [(now, Reject(f"run {now}"))]
    finally:
        sock.close()
        ctx.term()
        p.close()


def test_the_incarnation_ceiling_leaves_room_for_clock_skew_only() -> None:
    now_ns = time.time_ns()
    ceiling = incarnation_ceiling(now_ns)
    assert new_incarnation() < ceiling < ((now_ns // 1000 + (MAX_CLOCK_SKEW + 1) * 1_000_000) << 8)


@pytest.mark.asyncio
async def test_the_receive_loop_lets_the_event_loop_run_while_frames_are_queued() -> None:
    control = ZmqControl("P", secret=SECRET)
    control.start(asyncio.get_running_loop(), lambda sender, incarnation, message: None)
    ctx = zmq.Context()
    sock = insider_dealer(ctx, b"mallory", control.address, SECRET)
    observed: list[int] = []
    try:
        sock.send_multipart([b"x" * 1024, b"\0" * 32])  # the handshake needs the loop (ZAP)
        await eventually(lambda: control.counters["rejected_bad_mac"] == 1, "mallory is connected")
        # While this coroutine blocks the loop, 100 badly signed frames queue up at P (fewer than
        # the RECEIVE_QUEUE a connection may fill).
        frames = 100
        assert frames < RECEIVE_QUEUE
        body = bytes(256 * 1024)
        for _ in range(frames):
            sock.send_multipart([body, b"\0" * 32], copy=False)
        sock.close(linger=30_000)  # returns once every frame is on its way
        ctx.term()

        async def observe() -> None:
            observed.append(control.counters["rejected_bad_mac"])
            while observed[-1] < frames + 1:
                await asyncio.sleep(0)
                observed.append(control.counters["rejected_bad_mac"])

        await asyncio.wait_for(observe(), 60)
    finally:
        sock.close(linger=0)
        control.close()
    steps = [b - a for a, b in zip(observed, observed[1:], strict=False)]
    # A ROUTER frame is 3 parts: at most YIELD_EVERY parts are read per pass of the reader.  One
    # turn of the loop can run two passes (the reader's own continuation and the socket's
    # readable callback, when more frames arrived meanwhile), never more, and never all 100.
    batch = YIELD_EVERY // 3 + 1
    assert max(steps) <= 2 * batch < frames, f"{max(steps)} frames checked in one turn of the loop"


@pytest.mark.asyncio
async def test_a_failure_of_the_channels_own_receiving_reaches_its_owner_not_a_lost_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in the ZAP server's task or in reading a socket would end that receiving with
    only asyncio's "exception never retrieved" to show for it; the owner (the engine, whose
    next call then raises `EngineCrashed`) is told instead."""
    from kvflow.control import zeromq

    crashes: list[BaseException] = []

    async def broken_zap(*args: object) -> None:
        raise RuntimeError("the ZAP server broke")

    a = ZmqControl("A", secret=SECRET)
    with monkeypatch.context() as patched:  # (the other two run ZAP too: NULL, see `serve_zap`)
        patched.setattr(zeromq, "serve_zap", broken_zap)
        a.start(asyncio.get_running_loop(), lambda *message: None, crashes.append)
    receiver, sender = ZmqControl("C", secret=SECRET, curve=False), ZmqControl("D", secret=SECRET, curve=False)

    def broken_frames(self: ZmqControl, frames: list[bytes], sock: object, source: int = -1) -> None:
        raise RuntimeError("reading a frame broke")

    try:
        await eventually(lambda: len(crashes) == 1, "the ZAP task's failure reported")
        assert "ZAP server broke" in str(crashes[0])
        monkeypatch.setattr(ZmqControl, "_on_frames", broken_frames)
        receiver.start(asyncio.get_running_loop(), lambda *message: None, crashes.append)
        sender.start(asyncio.get_running_loop(), lambda *message: None)
        sender.add_route("C", receiver.address)
        sender.send("C", Goodbye("x"))
        await eventually(lambda: len(crashes) == 2, "the reader's failure reported")
        assert "reading a frame broke" in str(crashes[1])
    finally:
        for control in (a, receiver, sender):
            control.close()


def test_the_channels_counts_read_under_their_flat_names_and_a_count_never_made_reads_zero() -> None:
    counts = ControlCounts()
    assert counts.reject(Rejection.BAD_MAC) == 1 and counts.reject(Rejection.BAD_MAC) == 2
    assert counts.reject(Rejection.REPLAYED) == 3
    counts.frames_received += 3
    counts.zap_refused += 1
    flat = counts.snapshot({"connections_accepted": 5, "rejected_handshake": 1})
    assert flat["rejected"] == 3 and flat["rejected_bad_mac"] == 2 and flat["rejected_replayed"] == 1
    assert flat["frames_received"] == 3 and flat["zap_refused"] == 1 and flat["frames_sent"] == 0
    assert flat["connections_accepted"] == 5 and flat["rejected_handshake"] == 1  # the monitor's, beside
    assert flat["rejected_stale"] == 0  # never counted: 0, as a bag read before
    flat["frames_sent"] += 1  # a copy: the channel's own counts stay
    assert counts.frames_sent == 0 and counts.snapshot({})["rejected_bad_mac"] == 2
