"""Start an engine process: its socket, its program, and the descriptors of what it is handed.

Why a module of its own: what crosses to the child when it starts (its end of the socket, the
rings' memory file and eventfds, the host memory's files, exported GPU chunks) goes as inherited
descriptors, numbered into the spec as the child will find them, once and before any call.
`process.EngineProcess` then only talks over the rings and the socket and never touches that
hand-over again; an embedder reads here what the child inherits and in what order.

The KV memory reaches the child as shared memory: `host_memory.share_in_place` moves the
host's pages onto memory files at the same addresses, and the child maps the files and
registers its mapping with the transport.  GPU memory travels as legacy CUDA IPC handles
(`cuda_ipc`: one per allocation) or, for vLLM 0.34's exportable cache, as file descriptors of
its physical chunks (`cuda_vmm`; again over the socket, `send_fds`, after the host remapped
them), opened by the child, whose threads are bound to the device; not yet run on a GPU, so
the vLLM worker uses it only when asked (``engine_process: "process"``) and the GPU check's
phases G and V are its test.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from kvflow.runtime.cuda_ipc import Share, shares_to_wire
from kvflow.runtime.cuda_vmm import Chunk, chunks_to_wire
from kvflow.runtime.host_memory import SharedSpan
from kvflow.runtime.process_spec import ProcessSpec
from kvflow.runtime.ring_memory import HostRings

__all__ = ("SOCKET_BUFFER", "launch")

SOCKET_BUFFER = 4 << 20


def launch(
    spec: ProcessSpec, spans: Sequence[SharedSpan], cuda_shares: Sequence[Share], cuda_chunks: Sequence[Chunk]
) -> tuple[subprocess.Popen[bytes], socket.socket, HostRings, dict[str, Any]]:
    """Start ``python -m kvflow.runtime.engine_process`` on one end of a new socket pair, the
    rings made for it and every descriptor it needs inherited; the child, the host's end of the
    socket, the rings, and the spec to send it first (with each descriptor's number in the child).

    :raises KVFlowError: see `ProcessSpec.to_wire`; `ConfigError` if the rings cannot be made.
    :raises OSError: the child cannot be started (the rings and the socket are closed).
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for end in (ours, theirs):
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    rings = HostRings()
    fds = [theirs.fileno(), *rings.fds, *(span.fd for span in spans), *(chunk.fd for chunk in cuda_chunks)]
    wire = spec.to_wire(spans)
    first_span = 1 + len(rings.fds)
    wire["spans"] = [[fds[first_span + i], span.base, span.length] for i, span in enumerate(spans)]
    wire["rings"] = [*rings.fds, rings.capacity]
    wire["cuda_shares"] = shares_to_wire(cuda_shares)
    wire["cuda_chunks"] = chunks_to_wire(cuda_chunks)
    wire["cuda_chunk_fds"] = [chunk.fd for chunk in cuda_chunks]
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvflow.runtime.engine_process", str(theirs.fileno())],
            pass_fds=fds,
            stdin=subprocess.DEVNULL,
        )
    except BaseException:
        rings.close()
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours, rings, wire
