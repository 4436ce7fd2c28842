"""A process that stops a deployment's process groups once the process that started them is gone.

Why: `kvflow serve` stops every group it started on SIGINT and SIGTERM, but SIGKILL (an OOM kill,
`kill -9`, a CI runner's timeout) ends it without a word, and each group, the leader of a session
of its own, was reparented to init with its ports, shared memory and gigabytes.  A parent-death
signal reaches the direct child only (not vLLM's engine core and workers), and fires when the
starting *thread* ends.  So the first group a process starts also starts one warden (this
module, in a session of its own so that a terminal's Ctrl-C does not reach it), which reads the
groups to watch from a pipe whose only writer is that process.  End of file on the pipe means the
starter is gone, however it ended: the warden then sends SIGCONT and SIGTERM to every group still
watched, SIGKILL after `--grace` seconds to what is left, and exits.  A group the starter stopped
itself is forgotten first.

The pipe's lines: ``+PGID`` (watch), ``-PGID`` (forget).  Anything else is ignored: the only writer
is the starter, but a line it did not mean to write must not end the watch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from kvflow_tools.serve.processes import stop_groups

__all__ = ("main",)

GRACE_S = 15.0  # as `Group.stop`'s default: vLLM's servers take seconds to shut their engines down
KILL_WAIT_S = 1.0  # how long after SIGKILL a group may take to be gone


def _reap_children() -> None:
    """Collect leaders that were this process's children (none, normally: it starts nothing)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _watched(lines: list[str]) -> set[int]:
    watched: set[int] = set()
    for line in lines:
        sign, number = line[:1], line[1:].strip()
        if sign not in "+-" or not number.isdigit() or int(number) <= 1:
            continue
        (watched.add if sign == "+" else watched.discard)(int(number))
    return watched


def main(argv: list[str] | None = None) -> int:
    """Read the pipe (stdin) to its end, then stop what is still watched.  0, or 1 when a group
    outlived its SIGKILL."""
    parser = argparse.ArgumentParser(prog="python -m kvflow_tools.serve.warden")
    parser.add_argument("--grace", type=float, default=GRACE_S, help="seconds between SIGTERM and SIGKILL")
    grace = parser.parse_args(argv).grace
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the starter's terminal is not ours to obey
    lines: list[str] = []
    with contextlib.suppress(OSError):  # a broken pipe ends the watch as its end does
        for line in sys.stdin:
            lines.append(line)
    left = stop_groups(_watched(lines), grace, KILL_WAIT_S, _reap_children)
    if left:
        sys.stderr.write(f"warden: process groups {sorted(left)} outlived SIGKILL\n")
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main())
