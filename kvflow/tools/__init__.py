"""Command-line tools behind `kvflow` (`cli`).

The environment check (`doctor`), the state diagrams drawn from the transition tables
(`diagrams`), and what the project measures itself with.

Benchmarks: `bench_engine` (the control plane), `bench_nixl` (NIXL WRITEs), `bench_frames`
(costly frames), `bench_floods` (connection floods), `bench_router` and `router_stand` (hostile
HTTP clients against the router), `bench_hma` and `bench_hma_moved` (hybrid models).
Soaks: `soak` (transfers between engine processes under faults), `soak_fuzz` and `router_fuzz`
(attacks meanwhile), `peer_driver` (an engine process driven from asyncio), `netns` (hosts in
network namespaces joined by links that can be cut).  `children` starts the child processes of
them all from asyncio, with no Python run in the child before its exec.
"""
