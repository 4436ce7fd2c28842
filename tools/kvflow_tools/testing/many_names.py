"""An insider speaking as many engines: each name a real kvflow engine that associates with a target.

Why: the secret is shared by a deployment's engines and the sender name is the sender's to
choose, so whoever holds it can associate under as many names as the target accepts, each
association holding the target's sockets, shared-memory files and mappings.  docs/security.md
states what bounds that (`EngineConfig.max_peers`, the descriptor reserve, an allow-list of
engine ids); `kvflow bench floods --attack many_names` measures it with this process.

Run as ``python -m kvflow_tools.testing.many_names --address tcp://127.0.0.1:PORT --names 300``
with the deployment's secret in the environment.  It starts one engine per name in this
process (shared memory, the peer process's small layout, an address of its own on loopback),
connects every one to the target, a few at a time, and prints one JSON line
``{"event": "begin", "associated": n, "refused": m, "reasons": {...}, ...}`` once every name
is decided; the associations are then held until stdin closes, and a last line ``{"event":
"end", "sent": names, "refused": m, "opened": seconds, "duration": seconds}`` follows once
every engine is closed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import sys
import threading
import time
from collections import Counter

from kvflow.control.zeromq import ZmqControl
from kvflow.errors import KVFlowError
from kvflow.layout import KVLayout
from kvflow.layout.buffers import region_of
from kvflow.runtime.engine import Engine, EngineConfig
from kvflow.runtime.loop import run
from kvflow.transports.shm import ShmTransport
from kvflow_tools.testing.peer_process import spec

__all__ = ("main",)

BLOCKS = 2  # each name's KV memory: as small as an engine may be
AT_ONCE = 16  # names connecting at the same time
CONNECT_S = 3.0  # the longest one name waits for the target's answer


def _engine(name: str) -> Engine:
    """One name's engine: shared memory of `BLOCKS` blocks a layer, its control on loopback."""
    kv = spec("float16")
    transport = ShmTransport(name, prefix=f"kvflow-{name}")
    buffers = [transport.allocate(2 * BLOCKS * kv.block_len) for _ in range(kv.num_layers)]
    layout = KVLayout.per_layer_regions(kv, BLOCKS, [region_of(b) for b in buffers])
    control = ZmqControl(name, "tcp://127.0.0.1:0")
    return Engine(name, layout, transport, control, config=EngineConfig(drain_timeout=0.5))


def _reason(error: KVFlowError) -> str:
    """A refusal's kind, for the histogram: the error's type and the start of its message."""
    return f"{type(error).__name__}: {str(error)[:80]}"


async def _associate(engines: list[Engine], target: str, address: str) -> Counter[str]:
    """Connect every engine to `target`; what each refusal said, counted ("associated" for
    the ones that did)."""
    outcomes: Counter[str] = Counter()
    gate = asyncio.Semaphore(AT_ONCE)

    async def one(engine: Engine) -> None:
        async with gate:
            try:
                await engine.start()
                await engine.connect(target, address, timeout=CONNECT_S)
            except KVFlowError as exc:
                outcomes[_reason(exc)] += 1
            else:
                outcomes["associated"] += 1

    await asyncio.gather(*(one(engine) for engine in engines))
    return outcomes


async def _close(engine: Engine) -> None:
    """Close one name's engine, telling P (an engine that never started has nothing to close)."""
    with contextlib.suppress(KVFlowError):
        await engine.aclose()


async def _stdin_closed() -> None:
    """Returns once stdin ends (the parent closed it, or exited)."""
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()

    def read() -> None:
        while os.read(sys.stdin.fileno(), 4096):
            pass
        loop.call_soon_threadsafe(ended.set)

    threading.Thread(target=read, daemon=True).start()
    await ended.wait()


async def _insider(address: str, target: str, names: int, prefix: str) -> None:
    start = time.monotonic()
    engines: list[Engine] = []
    try:
        for index in range(names):  # (one that fails to build leaves the others to close)
            engines.append(_engine(f"{prefix}-n{index}"))
        outcomes = await _associate(engines, target, address)
        opened = time.monotonic() - start
        associated = outcomes.pop("associated", 0)
        _emit(event="begin", associated=associated, refused=sum(outcomes.values()), reasons=dict(outcomes))
        await _stdin_closed()
    finally:
        await asyncio.gather(*(_close(engine) for engine in engines))
    _emit(event="end", sent=names, refused=names - associated, opened=opened, duration=time.monotonic() - start)


def _emit(**event: object) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """Associate `--names` engines with the target and hold them until stdin closes."""
    parser = argparse.ArgumentParser(prog="python -m kvflow_tools.testing.many_names")
    parser.add_argument("--address", required=True, help="the target's control address, tcp://host:port")
    parser.add_argument("--target", default="P", help="the target's engine id")
    parser.add_argument("--names", type=int, default=300, help="engines to associate, one name each")
    parser.add_argument("--prefix", default="insider", help="the names' common start (unique per run)")
    args = parser.parse_args(argv)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # each engine holds a few dozen
    run(_insider(args.address, args.target, args.names, args.prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
