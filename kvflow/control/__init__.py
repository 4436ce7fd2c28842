"""The control plane: how engines reach each other's control messages.

`channel` is the contract (and an in-process hub for tests and single-process setups), `zeromq`
the authenticated ZeroMQ implementation (its sockets set up by `sockets` and read on the loop
by `receiving`), `wire`
the msgpack codec (plain data only), `auth` the shared secret, MACs and replay guard.  Around
the ZeroMQ channel: `hardening` (CURVE keys, the ZAP handler), `connections` (counting the
ROUTER's connections and their descriptors, closing idle ones when the process is short of
them), `connection_book` (which ones give way, pure) and `monitor` (whether the link to a peer
is up); `admission` decides which frames it delivers; `counts` is what the channel counts, each
count a field and each reason to drop a frame a `Rejection`.
"""
