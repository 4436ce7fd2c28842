"""What `kvflow.protocol.association` asks the runtime to do, as frozen dataclasses.

Why a module of its own: the associations' decisions (`association`) and their vocabulary of
effects are read separately; the runtime's driver (`kvflow.runtime.peering`) executes these one
by one, in order, and feeds the outcomes some of them name back as inputs.  Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.errors import KVFlowError
from kvflow.layout import KVLayout
from kvflow.protocol.messages import FirstToken, Goodbye, Heartbeat, Hello, Message, Reject, TransferKey
from kvflow.protocol.teardown import PeerFenced, PeerGone, RemovalFailed, RemovePeer

__all__ = (
    "AddRoute",
    "AddTransportPeer",
    "AnswerUnassociated",
    "AssociationAction",
    "AwaitHandshake",
    "Deliver",
    "HandshakeSettled",
    "PeerConnected",
    "PendingHello",
    "Redeliver",
    "Refused",
    "RenewLeases",
    "SendControl",
    "SendHeartbeat",
    "SendHello",
    "TearDown",
    "TokenArrived",
    "UnknownSender",
)


@dataclass(frozen=True, slots=True)
class PendingHello:
    """A Hello that passed every check; it associates its sender once the route is added."""

    incarnation: int
    hello: Hello
    layout: KVLayout


@dataclass(frozen=True, slots=True)
class AddRoute:
    """Tell the control channel where `peer` listens.  With `pending`, the outcome is an input:
    `route_added` on success, `pending_refused` when the channel refuses the address."""

    peer: str
    address: str
    pending: PendingHello | None = None


@dataclass(frozen=True, slots=True)
class AwaitHandshake:
    """A local connect waits for the handshake with `peer` to settle."""

    peer: str


@dataclass(frozen=True, slots=True)
class SendHello:
    """Send this engine's Hello.  With `associating` (the answer that completes an association the
    peer started) the outcome is an input: `hello_sent`, or `hello_unsent` when the send fails.
    Otherwise a failure propagates (a local connect's), unless `best_effort` (then it is logged)."""

    peer: str
    reply: bool
    best_effort: bool = False
    associating: bool = False
    association: int = 0  # our number for the association with `peer` (`Hello.association`)


@dataclass(frozen=True, slots=True)
class SendControl:
    """Send a Reject, a Goodbye, a Heartbeat or a first token, best effort: a failure is
    counted and logged."""

    peer: str
    message: Reject | Goodbye | Heartbeat | FirstToken


@dataclass(frozen=True, slots=True)
class SendHeartbeat:
    """Send a Heartbeat listing the transfers this side still waits on from `peer` at that
    moment; best effort, like `SendControl`."""

    peer: str


@dataclass(frozen=True, slots=True)
class AddTransportPeer:
    """Give the transport the metadata and regions `pending`'s Hello advertises.  The outcome is
    an input: `transport_peer_added` on success, `pending_refused` when the transport
    refuses."""

    peer: str
    pending: PendingHello


@dataclass(frozen=True, slots=True)
class Redeliver:
    """A Hello that arrived while the transport was still adding its sender: decide it now, as if
    it had just arrived (`receive`)."""

    peer: str
    incarnation: int
    hello: Hello


@dataclass(frozen=True, slots=True)
class TearDown:
    """Remove `peer` from the transport and tell the transfer core it is lost.  The association
    itself is already forgotten here."""

    peer: str
    reason: str
    expected: bool = False  # a goodbye: not worth a warning
    # the teardown came from the peer's side of the link (a goodbye, a new Hello, its connection
    # closed): packets between us were flowing then, so nothing it sent can be stuck behind a
    # dead link; False when it only fell silent
    answered: bool = False


@dataclass(frozen=True, slots=True)
class RenewLeases:
    """`peer` still waits on these transfers: hold their blocks at least `lease` past `now`."""

    peer: str
    keys: tuple[TransferKey, ...]
    now: float
    lease: float


@dataclass(frozen=True, slots=True)
class HandshakeSettled:
    """The handshake with `peer` ended: associated (`error` None) or refused."""

    peer: str
    error: KVFlowError | None = None


@dataclass(frozen=True, slots=True)
class PeerConnected:
    """A new association: transfers waiting for `peer` may start."""

    peer: str
    now: float


@dataclass(frozen=True, slots=True)
class Refused:
    """A Hello from `peer` was refused, for the log.  With `abandon` the refusal is for good (the
    layouts differ, the deployment does not permit the peer) and the peer is not associated:
    the transfers waiting for it here can never be served, so they fail now (`peer_lost`)
    instead of holding their blocks until their deadlines."""

    peer: str
    error: KVFlowError
    abandon: bool = False


@dataclass(frozen=True, slots=True)
class UnknownSender:
    """A message from a peer not associated (or from an old incarnation of it), dropped."""

    peer: str


@dataclass(frozen=True, slots=True)
class AnswerUnassociated:
    """A message (not a Goodbye) from run `incarnation` of a peer with no association here at
    all: counted as from an unknown sender, and answered with a Goodbye on the connection it
    came in on (`ControlChannel.answer`), so that the peer ends its side at once and fails the
    transfers it meant for us, instead of waiting for their deadlines to hear nothing."""

    peer: str
    incarnation: int
    goodbye: Goodbye = Goodbye(
        "not associated: this engine has no association with you (it ended it, or never had one)"
    )


@dataclass(frozen=True, slots=True)
class Deliver:
    """A message about one transfer from an associated peer: for the transfer core, or (a first
    token) for the engine's host."""

    peer: str
    message: Message | FirstToken


@dataclass(frozen=True, slots=True)
class TokenArrived:
    """An associated peer's first token for one of its transfers, for the engine's host (the
    endpoint turns a `Deliver` of one into this)."""

    peer: str
    message: FirstToken


AssociationAction = (
    AddRoute
    | AwaitHandshake
    | SendHello
    | SendControl
    | SendHeartbeat
    | AddTransportPeer
    | TearDown
    | RenewLeases
    | HandshakeSettled
    | PeerConnected
    | Refused
    | UnknownSender
    | AnswerUnassociated
    | Deliver
    | Redeliver
    | RemovePeer
    | RemovalFailed
    | PeerGone
    | PeerFenced
)
