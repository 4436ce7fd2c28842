"""The asyncio runtime that executes the protocol's actions.

`engine` is the thin driver (feeds inputs, executes actions, arms one deadline timer, never loses
a task exception); `writer` posts transport ops from a dedicated thread; `threaded` embeds an
engine in synchronous code (an inference engine's scheduler thread); `loop` picks uvloop when it
is installed.
"""
