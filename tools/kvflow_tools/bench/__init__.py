"""What kvflow measures itself with: benchmarks and soaks (`kvflow bench ...`, `kvflow soak`).

Benchmarks: `bench_engine` (the control plane), `bench_nixl` (NIXL WRITEs), `bench_frames`
(costly frames), `bench_floods` (connection floods), `bench_router` and `router_stand` (hostile
HTTP clients against the router), `bench_hma` and `bench_hma_moved` (hybrid models),
`bench_integrity` (what the end-to-end integrity check costs).  Against
vLLM's own connectors, each engine inside vLLM's real scheduler (`runner`, one engine process;
`systems`, each system's connector and the environment of the vLLM release it needs):
`runner_pair` (P and D as two `runner` processes, and the router between them), `bench_vllm`
(`kvflow bench vllm`), `bench_host` (what a connector costs its host), `bench_prefix`
(prefix tails), `bench_report` (their tables).  Soaks: `soak` (transfers between engine
processes under faults), `soak_fuzz` (attacks meanwhile), `peer_driver` (an engine process
driven from asyncio).
"""
