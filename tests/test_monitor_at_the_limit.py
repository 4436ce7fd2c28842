"""A socket monitor made with the process one or two descriptors short of its limit leaves the
context working: either the monitor and its reader both exist, or neither does.

pyzmq's `get_monitor_socket` enabled the monitor before it made the reader; one descriptor short,
the reader failed and libzmq's I/O thread blocked for good on the first event it sent to a PAIR
with no peer: no connection, handshake timer or close of the context moved again (an engine at
its descriptor limit under a connection flood, refusing a peer, wedged that way).  Each case runs
in a child process with its limit set just above what it holds, since the old failure hangs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvflow_tools.children import import_path

PROBE = """
import asyncio, os, resource, sys
import zmq, zmq.asyncio
from kvflow.control.connections import ConnectionWatch
from kvflow.control.monitor import LinkMonitors

kind, spare = sys.argv[1], int(sys.argv[2])
ctx = zmq.asyncio.Context()
router = zmq.Socket(ctx, zmq.ROUTER)
router.setsockopt(zmq.LINGER, 0)
router.bind("tcp://127.0.0.1:*")
dealer = zmq.Socket(ctx, zmq.DEALER)
dealer.setsockopt(zmq.LINGER, 0)
links = LinkMonitors()
links.listener = lambda peer, up: None
loop = asyncio.new_event_loop()
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
open_now = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + spare, hard))
made = "monitored"
try:
    if kind == "link":
        links.watch(dealer, "peer", loop)
        made = "monitored" if links.watching() else "unmonitored"
    else:
        ConnectionWatch.start(router, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED, "P")
except zmq.ZMQError:
    made = "refused"
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
dealer.send(b"hello")
moved = router.poll(5000) and router.recv_multipart()[-1] == b"hello"
print(made, "moved" if moved else "stuck", flush=True)
os._exit(0)  # a wedged context would hang its termination
"""


@pytest.mark.parametrize("kind", ["link", "connections"])
@pytest.mark.parametrize("spare", [0, 1, 2, 3])
def test_a_monitor_made_at_the_descriptor_limit_never_wedges_the_context(kind: str, spare: int) -> None:
    env = dict(os.environ, PYTHONPATH=import_path())
    run = subprocess.run(
        [sys.executable, "-c", PROBE, kind, str(spare)], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    made, moved = run.stdout.split()
    assert moved == "moved", f"{kind} monitor {made} with {spare} descriptors to spare wedged the context"
