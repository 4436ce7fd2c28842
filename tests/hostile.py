"""A ZeroMQ engine "P" and the frames a peer holding the secret could send it, for the tests of
hostile peers, of the allow-list, and of the peer thread.
"""

from __future__ import annotations

import zmq

from kvflow.control import wire
from kvflow.control.auth import Secret
from kvflow.control.hardening import curve_keys
from kvflow.control.zeromq import ZmqControl
from kvflow.layout import fingerprint, layout_to_wire
from kvflow.protocol.messages import Hello
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.transports.loopback import LoopbackFabric
from kvflow_tools.testing import SMALL_SPEC, KVBuffers

SECRET = Secret(b"a shared secret of some length")
CONFIG = EngineConfig(transfer_timeout=10.0, drain_timeout=1.0, lease=600.0)  # made-up peers never beat
LAYOUT = layout_to_wire(KVBuffers(SMALL_SPEC, 16).layout)


def hello(sender: str, address: str, *, reply: bool = False) -> Hello:
    return Hello(sender, fingerprint(SMALL_SPEC), LAYOUT, sender.encode(), reply, address)


def signed(sender: str, receiver: str, message: Hello, incarnation: int = 1, seq: int = 1) -> list[bytes]:
    frame = wire.encode(wire.Envelope(sender, incarnation, receiver, seq, message))
    return [frame, SECRET.sign(frame)]


class Zmq:
    """An engine "P" over authenticated ZeroMQ, on a loopback fabric the test adds endpoints to."""

    def __init__(self, config: EngineConfig = CONFIG) -> None:
        self.fabric = LoopbackFabric()
        self.kv = KVBuffers(SMALL_SPEC, 16)
        self.p = Engine("P", self.kv.layout, self.fabric.endpoint("P"), ZmqControl("P", secret=SECRET), config=config)
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 4096)
        self.sockets: list[zmq.Socket[bytes]] = []

    def dealer(self, identity: str) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        keys = curve_keys(SECRET)  # a peer holding the secret passes the connection's handshake
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
        sock.connect(self.p.control.address)
        self.sockets.append(sock)
        return sock

    def sink(self) -> int:
        """Where made-up peers say they listen: a ROUTER that passes P's CURVE handshakes (so
        that P's connections stay up) and never reads.  Its port."""
        sink = self.ctx.socket(zmq.ROUTER)
        self.sockets.append(sink)
        sink.setsockopt(zmq.LINGER, 0)
        sink.setsockopt(zmq.CURVE_SERVER, 1)
        sink.setsockopt(zmq.CURVE_SECRETKEY, curve_keys(SECRET).server_secret)
        return sink.bind_to_random_port("tcp://127.0.0.1")

    async def close(self) -> None:
        try:
            await self.p.aclose()
        finally:
            for sock in self.sockets:
                sock.close()
            self.ctx.term()
            self.fabric.close()
