"""The sans-IO transfer protocol: what every transfer may do next, decided without any I/O.

`state` holds the transition tables (one per mode and role) and the state-triggered hops;
`machine` is the per-transfer record; `ledger` accounts for every block; `core` owns the
transfers, their deadlines and epochs and turns inputs into `actions`; `messages` are what peers
say to each other, and `inbox` checks what they say before it becomes an input.  Nothing here
reads a clock, opens a socket or touches asyncio: time is an input, effects are returned as
data, and the runtime executes them.
"""
