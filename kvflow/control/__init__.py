"""The control plane: how engines reach each other's control messages.

`channel` is the contract (and an in-process hub for tests and single-process setups), `zeromq`
the authenticated ZeroMQ implementation, `wire` the msgpack codec (plain data only), `auth` the shared
secret, MACs and replay guard.
"""
