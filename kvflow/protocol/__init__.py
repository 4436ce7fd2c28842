"""The sans-IO transfer protocol: what every transfer may do next, decided without any I/O.

`vocabulary` names the states, inputs and effects; `transfer_tables` builds the transition
tables (one per mode and role) and `state` looks them up, with the state-triggered hops;
`machine` is the per-transfer record; `ledger` accounts for every block; `transfers` stores the
machines, their epochs and deadlines; `core` turns inputs into `actions`, `steps` carrying out
each step a table picks, with `inbox` refining what peers send and `early` keeping what they say
about transfers not started yet; `messages` are what peers say to each other, and `requests`
what a host asks of its engine (expect, KV ready, abort), each one typed value with its wire form.

Peers: `association` decides handshakes, incarnations and leases, by the table of each peer's
phase in `phases`, keeping one `peer_record` per peer and returning the effects of
`peer_actions`; `liveness` when each peer is due a heartbeat or lost, `teardown` when a
torn-down peer's blocks may go back (a table), and `admission` whom an engine may associate
with.  `lifecycle` is an engine's own life (a table).
`tables` builds the tables that are not the transfers': each pair a row or declared ignored.

`endpoint` is one engine's whole pure state behind one door: it owns the core and the
associations (with their teardowns), coordinates them, and answers every input with one list of
effects and one next deadline.

Nothing here reads a clock, opens a socket or touches asyncio: time is an input, effects are
returned as data, and the runtime executes them.
"""
