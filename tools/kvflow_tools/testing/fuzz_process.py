"""`python -m kvflow_tools.testing.fuzz_process`: control-port attacks, for `kvflow soak --fuzz`.

The attacks of `kvflow_tools.testing.fuzz`, one after another, against one engine's control port.

Why a process of its own: at large scale an attacker needs its own descriptors and CPU (a
connection flood holds one descriptor per connection), while the soak's driver keeps timing
real transfers.  Each attack is announced on stdout as a JSON line when it begins and reported
in another when it ends, with CLOCK_MONOTONIC times (one clock for every process of a host), so
that the driver can read the target's counters and the transfers' latency over each attack's
window.  The secret comes from KVFLOW_SECRET, as the engines' does: the attacks that play an
insider (squatting a peer's identity, frames with a bad MAC over an authenticated connection,
recording a connection to replay it) use it; a stranger's attacks do not.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict

import zmq

from kvflow.control.auth import Secret, secret_from_env
from kvflow.control.hardening import curve_keys
from kvflow.errors import ConfigError
from kvflow_tools.testing.fuzz import (
    GREETING,
    AttackStats,
    RecordingProxy,
    bad_mac_flood,
    carries_messages,
    connection_flood,
    insider_dealer,
    replay,
    squat_identity,
    unfinished_multipart,
)

__all__ = ("ATTACKS", "insider_bad_mac", "main", "recorded_replay")

ATTACKS = (
    "unfinished_multipart",
    "bad_mac_flood",
    "insider_bad_mac",
    "connection_flood",
    "squat_identity",
    "replay",
    "idle_insiders",
)
FRAME_BYTES = 64 * 1024
SEND_WAIT_MS = 5000  # an insider's send the target does not take within this long counts as refused


def insider_bad_mac(address: str, secret: Secret, *, frames: int, frame_bytes: int = FRAME_BYTES) -> AttackStats:
    """Send `frames` frames of random bytes with a random MAC over a connection that passed
    CURVE (an insider's): each one reaches the target's MAC check.  `refused`: 1 when the target
    stopped taking frames for `SEND_WAIT_MS` (the rest are not sent).

    :raises zmq.ZMQError: the address is unusable.
    """
    start = time.monotonic()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sent = refused = 0
    try:
        sock = insider_dealer(ctx, b"intruder", address, secret)
        sock.setsockopt(zmq.SNDTIMEO, SEND_WAIT_MS)
        payload = os.urandom(frame_bytes)
        try:
            for _ in range(frames):
                sock.send_multipart([payload, os.urandom(32)])
                sent += 1
        except zmq.Again:
            refused = 1
        sock.close(linger=SEND_WAIT_MS)  # what is queued still goes
    finally:
        ctx.term()
    return AttackStats("insider_bad_mac", sent, refused, time.monotonic() - start)


def idle_insiders(
    address: str, secret: Secret, *, connections: int, hold: float, stop: threading.Event | None = None
) -> AttackStats:
    """`connections` DEALERs of an insider (CURVE keys from the secret, a routing id each),
    connected to `address` and sending nothing, held `hold` seconds or until `stop` is set;
    libzmq reconnects each one the target closes, as any DEALER does.

    :raises zmq.ZMQError: the address is unusable, or no more sockets can be opened.
    """
    start = time.monotonic()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.setsockopt(zmq.MAX_SOCKETS, connections + 64)
    socks: list[zmq.Socket[bytes]] = []
    try:
        for index in range(connections):
            socks.append(insider_dealer(ctx, b"idle-%d" % index, address, secret))
        opened = time.monotonic() - start
        if stop is not None:
            stop.wait(hold)
        else:
            time.sleep(hold)
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
    return AttackStats("idle_insiders", len(socks), 0, time.monotonic() - start, opened)


def recorded_replay(address: str, secret: Secret, *, copies: int) -> AttackStats:
    """Record an insider's authenticated connection through a `RecordingProxy` (a few frames
    sent over it), then replay the recorded bytes `copies` times at the target.

    :raises zmq.ZMQError: the address is unusable.
    :raises OSError: the proxy cannot listen.
    :raises ValueError: the proxy recorded no message to replay.
    """
    proxy = RecordingProxy(address)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = insider_dealer(ctx, b"recorded", proxy.address, secret)
        sock.setsockopt(zmq.SNDTIMEO, SEND_WAIT_MS)
        for n in range(3):
            sock.send_multipart([b"recorded frame %d" % n, os.urandom(32)])
        sock.close(linger=SEND_WAIT_MS)
        ctx.term()  # returns once what was queued went through the proxy
        size, end = -1, time.monotonic() + 5.0
        while time.monotonic() < end:  # the proxy's thread records what it forwards: until it stops growing
            now = sum(len(stream) for stream in proxy.streams)
            if now == size and now > GREETING:
                break
            size = now
            time.sleep(0.2)
    finally:
        proxy.close()
    recorded = [bytes(stream) for stream in proxy.streams if carries_messages(bytes(stream))]
    if not recorded:  # nothing to replay: say so rather than replay nothing and report it done
        raise ValueError("the recording proxy forwarded no message past the handshake")
    streams = recorded * copies
    stats = replay(address, streams, hold=0.1)
    return AttackStats("replay", stats.sent, stats.refused, stats.duration)


def _plan(
    address: str,
    scale: int,
    secret: Secret,
    curve: bool,
    per_second: float = 0.0,
    hold: float = 5.0,
    stop: threading.Event | None = None,
) -> list[tuple[str, Callable[[], AttackStats]]]:
    keys = curve_keys(secret)
    plan: list[tuple[str, Callable[[], AttackStats]]] = []
    if curve:  # without CURVE, an unfinished message is held inside libzmq for good: not a soak's to leave
        plan.append(("unfinished_multipart", lambda: unfinished_multipart(address, parts=scale)))
    plan += [
        ("bad_mac_flood", lambda: bad_mac_flood(address, frames=scale, frame_bytes=FRAME_BYTES, seconds=60.0)),
        ("insider_bad_mac", lambda: insider_bad_mac(address, secret, frames=scale)),
        (
            "connection_flood",
            lambda: connection_flood(address, connections=scale, hold=hold, per_second=per_second, stop=stop),
        ),
        ("squat_identity", lambda: squat_identity(address, b"D", hold=2.0, keys=keys)),
        ("replay", lambda: recorded_replay(address, secret, copies=min(max(scale // 100, 1), 50))),
        ("idle_insiders", lambda: idle_insiders(address, secret, connections=scale, hold=hold, stop=stop)),
    ]
    return plan


def _emit(**event: object) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _all_descriptors() -> None:
    """As many descriptors as the operator allows: a connection flood holds one per connection.
    Raised here, not by the parent between fork and exec: code run there can deadlock on a lock
    another of the parent's threads held when it forked."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _set_at_eof(stop: threading.Event) -> None:
    """Set `stop` once stdin ends: the parent closed it, or exited."""
    while os.read(sys.stdin.fileno(), 4096):
        pass
    stop.set()


def main(argv: list[str] | None = None) -> int:
    """Run every attack in turn; a line per attack's beginning and end on stdout.

    :raises ConfigError: no secret in the environment, or KVFLOW_SECRET and its file both set.
    """
    parser = argparse.ArgumentParser(prog="python -m kvflow_tools.testing.fuzz_process")
    parser.add_argument("--address", required=True, help="the target's control address, tcp://host:port")
    parser.add_argument("--scale", type=int, default=1000, help="frames, parts or connections per attack")
    parser.add_argument(
        "--per-second", type=float, default=0.0, help="connection_flood: connections a second (0: as fast as it can)"
    )
    parser.add_argument(
        "--hold",
        type=float,
        default=5.0,
        help="connection_flood: seconds to hold each (inf: till the target closes); idle_insiders: all of them",
    )
    parser.add_argument(
        "--until-stdin-closes",
        action="store_true",
        help="connection_flood, idle_insiders: stop opening, and close every connection held, when stdin closes",
    )
    parser.add_argument("--no-curve", action="store_true", help="the target does not use CURVE")
    parser.add_argument("--attack", choices=ATTACKS, action="append", help="run only this attack (repeatable)")
    args = parser.parse_args(argv)
    _all_descriptors()
    secret = secret_from_env()
    if secret is None:
        raise ConfigError("the insider attacks need KVFLOW_SECRET")
    stop = threading.Event() if args.until_stdin_closes else None
    if stop is not None:
        threading.Thread(target=_set_at_eof, args=(stop,), daemon=True).start()
    plan = _plan(args.address, args.scale, secret, not args.no_curve, args.per_second, args.hold, stop)
    for name, attack in plan:
        if args.attack and name not in args.attack:
            continue
        _emit(event="begin", attack=name, t=time.monotonic())
        try:
            stats = attack()
        except (OSError, ValueError, zmq.ZMQError) as exc:  # the attack could not run: reported
            _emit(event="end", attack=name, t=time.monotonic(), error=f"{type(exc).__name__}: {exc}")
            continue
        _emit(event="end", t=time.monotonic(), rate=stats.rate, **asdict(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
