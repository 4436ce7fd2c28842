"""The asyncio runtime that executes what the protocol decides.

`engine` is the thin driver (feeds every input to the protocol's one `Endpoint`, arms one
deadline timer (`timer`), never loses a task exception); `interpreter` performs the effects the
endpoint returns, `peering` the peer effects among them; `config` is its `EngineConfig`;
`results` are the handles, outcomes and counters a caller reads, `handshakes` the futures a `connect` awaits,
`meter` the per-transfer figures for metrics, `first_tokens` the first tokens peers sent
until the host takes them; `dataplane` plans and posts the engine's ops and
drains its transport; `writer` is the dedicated thread it posts them from; `sleep` winds
transfers down and lets go of the KV memory's registration (and takes it up again);
`descriptors` checks file-descriptor headroom; `integrity` seals each WRITE with digests of the
KV it moves and checks what landed (opt-in).

Embedding: `threaded` runs an engine on a thread of synchronous code (an inference engine's
scheduler), `process` in a process of its own (`process_spec` what it is told to build,
`process_launch` how it is started, `process_answers` what it says back,
`engine_process` its program, `engine_agent` the engine's API as commands, which embedders
extend),
with `host_memory` sharing the host's KV caches in place (`cuda_ipc` its GPU memory, by legacy
CUDA IPC handles, `cuda_vmm` by file descriptors of driver-mapped chunks, which `fd_passing`
hands over to a running engine process); the host's calls and the process's
answers go through two rings in shared memory (`ring` the protocol, `ring_memory` the memory
file and the wake-up) and the link's life through a socket (`frames` packs both's records);
`bell` is a wake-up one process rings for another that sleeps on something else (vLLM's engine
core while its requests wait for KV); `loop` picks uvloop when it is installed.
"""
