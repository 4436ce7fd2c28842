"""The sans-IO transfer protocol: what every transfer may do next, decided without any I/O.

`vocabulary` names the states, inputs and effects; `state` holds the transition tables (one per
mode and role) and the state-triggered hops; `machine` is the per-transfer record; `ledger`
accounts for every block; `transfers` stores the machines, their epochs and deadlines; `core`
turns inputs into `actions`, with `inbox` refining what peers send; `association` decides
handshakes, heartbeats and leases; `messages` are what peers say to each other.  Nothing here
reads a clock, opens a socket or touches asyncio: time is an input, effects are returned as
data, and the runtime executes them.
"""
