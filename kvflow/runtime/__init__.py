"""The asyncio runtime that executes the protocol's actions.

`engine` is the thin driver (feeds inputs to the transfer core and to the peer associations,
executes their actions, arms one deadline timer, never loses a task exception); `config` is
its `EngineConfig`; `results` are the handles and outcomes a caller awaits, `handshakes` the
futures a `connect` awaits; `writer` posts transport ops from a dedicated thread;
`threaded` embeds an engine in synchronous code (an inference engine's scheduler thread); `loop`
picks uvloop when it is installed.
"""
