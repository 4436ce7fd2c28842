"""kvflow-tools: the `kvflow` command and what the project measures and tests itself with.

The second distribution of this repository, never loaded by an engine that embeds kvflow nor by
vLLM (the library, `kvflow`, imports nothing of it; `tests/test_architecture.py` checks).

- `cli`: the `kvflow` command; `doctor` (the environment check), `diagrams` (the state diagrams
  drawn from the transition tables), `children` (child processes started from asyncio with no
  Python run before their exec), `netns` (hosts in network namespaces joined by links that can be
  cut), `errors` (the tools' exceptions, under the library's `KVFlowError`).
- `bench`: the benchmarks and soaks; `standin` (vLLM's real scheduler and KV allocation without a
  model), `pd` (`kvflow bench pd`), `serve` (real vLLM servers: `kvflow serve`, `kvflow demo`,
  `kvflow bench serve`).
- `routing`: the P/D router in front of vLLM servers.
- `testing`: the test kit (`EnginePair`, an engine in its own process, attacks and fuzzers).
"""
