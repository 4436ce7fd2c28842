"""Hellos and a pure `Associations` of engine "D", for the tests that drive handshakes by hand.

Helpers, no tests: `receive` answers what the associations ask of a transport and a channel as
ones that accept the peer and send, so a test sees the whole handshake's actions."""

from __future__ import annotations

from kvflow.layout import fingerprint, layout_to_wire
from kvflow.protocol.association import Associations
from kvflow.protocol.messages import Hello
from kvflow.protocol.peer_actions import AddTransportPeer, SendHello
from kvflow_tools.testing import SMALL_SPEC, KVBuffers


def hello(sender: str, *, reply: bool = False, address: str = "", association: int = 0) -> Hello:
    layout = layout_to_wire(KVBuffers(SMALL_SPEC, 8).layout)
    return Hello(sender, fingerprint(SMALL_SPEC), layout, b"meta", reply, address, association)


def associations() -> Associations:
    return Associations("D", fingerprint(SMALL_SPEC), lease=6.0, interval=1.0)


def kept(peers: Associations, field: str) -> dict[str, object]:
    """Each peer's `field` of its `PeerRecord`, for the peers that keep one (not None, not empty)."""
    return {
        peer: value for peer, record in peers.records.items() if (value := getattr(record, field)) not in (None, "", [])
    }


def receive(peers: Associations, sender: str, incarnation: int, message: Hello, now: float) -> list[object]:
    """Feed a message, answer each `AddTransportPeer` as a transport that accepts the peer, and
    each answering `SendHello` as a channel that sends it."""
    actions: list[object] = []
    queue = list(peers.receive(sender, incarnation, message, now))
    while queue:
        action = queue.pop(0)
        actions.append(action)
        if isinstance(action, AddTransportPeer):
            queue[:0] = peers.transport_peer_added(action.peer, action.pending, now)
        elif isinstance(action, SendHello) and action.associating:
            queue[:0] = peers.hello_sent(action.peer, now)
    return actions
