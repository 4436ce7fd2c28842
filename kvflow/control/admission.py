"""Which control frames the ZeroMQ channel delivers, decided by one pure function.

Every check a frame passes before its message reaches the engine is here.

Why apart from the channel (`kvflow.control.zeromq`): the checks (shape, size, MAC, version,
receiver, identity, runs, replay) are the control plane's defence against whoever reaches the
port, and read best, and are tested best, as one decision over bytes with no socket: `admit`
returns the envelope to deliver, or why the frame is dropped and what, if anything, to tell the
sender.  The channel does the I/O (the counting and logging of `Dropped`, the answers).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.control.auth import MAC_BYTES, ReplayGuard, Secret
from kvflow.control.channel import incarnation_ceiling
from kvflow.control.counts import Rejection
from kvflow.control.wire import MAX_FRAME_BYTES, Envelope, decode
from kvflow.errors import PeerProtocolError, UnsupportedVersion
from kvflow.protocol.messages import Hello, Reject

__all__ = ("RESTARTED", "Dropped", "admit")

RESTARTED = "restarted: the association this frame is for was with an earlier run of this engine"


@dataclass(frozen=True, slots=True)
class Dropped:
    """A frame not delivered: why (`reason`, `detail`), and a Reject to send back to `peer` on
    the connection it came in on (`tell`: its text; empty: none)."""

    reason: Rejection
    detail: str
    peer: str = ""
    tell: str = ""


def admit(
    frames: list[bytes],
    engine_id: str,
    incarnation: int,
    secret: Secret | None,
    guard: ReplayGuard,
    now_ns: int,
) -> Envelope | Dropped:
    """The envelope of `frames` (ZeroMQ's parts: the sender's routing id, the frame, its MAC)
    when this engine (`engine_id`, in its run `incarnation`, holding `secret` or None) delivers
    it, else why not.  `guard` remembers each sender's run and last sequence number (a frame
    accepted updates it); `now_ns` is the wall clock, which bounds a sender's run.  Never raises."""
    if len(frames) != 3:
        return Dropped(Rejection.SHAPE, f"{len(frames)} parts")
    identity, frame, mac = frames
    if len(frame) > MAX_FRAME_BYTES:
        return Dropped(Rejection.OVERSIZED, f"{len(frame)} bytes")
    if secret is not None:
        if len(mac) != MAC_BYTES or not secret.verify(frame, mac):
            return Dropped(Rejection.BAD_MAC, "authentication failed")
    elif mac:
        return Dropped(Rejection.UNEXPECTED_MAC, "peer signs frames but this engine has no secret")
    try:
        envelope = decode(frame)
    except UnsupportedVersion as exc:
        return Dropped(Rejection.VERSION, str(exc), exc.sender, str(exc))
    except PeerProtocolError as exc:
        return Dropped(Rejection.MALFORMED, str(exc))
    if envelope.receiver != engine_id:
        return Dropped(Rejection.MISDIRECTED, f"frame for {envelope.receiver!r}")
    if envelope.sender.encode() != identity.partition(b"\0")[0]:
        return Dropped(Rejection.IDENTITY, f"frame claims to come from {envelope.sender!r}")
    if envelope.receiver_incarnation != incarnation:
        message = envelope.message
        opening = (isinstance(message, Hello) and not message.reply) or isinstance(message, Reject)
        if envelope.receiver_incarnation != 0:
            return Dropped(Rejection.STALE, "frame for an earlier run of this engine", envelope.sender, RESTARTED)
        if not opening:
            return Dropped(Rejection.UNBOUND, "frame names no run of this engine")
    if envelope.incarnation > incarnation_ceiling(now_ns):  # it would shut the real sender's runs out
        return Dropped(Rejection.FUTURE, f"incarnation {envelope.incarnation} is no clock reading yet")
    if not guard.accept(envelope.sender, envelope.incarnation, envelope.seq):
        return Dropped(Rejection.REPLAYED, "old incarnation or sequence number")
    return envelope
