"""Data-plane transports: the contract (`base`), the registry (`registry`) and the implementations.

Importable as `kvflow.transports.<name>` (the directory is linked into the package; see
docs/design.md).  Implementations: `loopback` (in-process, fault injection), `shm` (shared memory
between processes on one host, with `shm_files` for its files under /dev/shm, `shm_peer`
for checking what a peer advertises and `shm_association` for what is held open for one peer
and the fenced copy into it), `nixl` (NIXL over UCX or LIBFABRIC, DRAM or GPU memory),
with `nixl_setup` for which NIXL build it imports and which network devices UCX may use,
`nixl_agent_thread` for the one thread that owns a NIXL agent and `nixl_descriptors` for
kvflow's regions and plans as NIXL descriptor lists.
Look one up by name with `kvflow.transports.registry.load_transport`; a backend whose library is
missing fails with an install hint instead of an ImportError.
"""
