"""How many file descriptors this process has left, checked before a new peer is accepted.

Why: every association costs descriptors (its control connection, and the transport's files,
mappings and endpoints: about 11 with the shared-memory transport), and a process out of them
fails in whatever opens one next (an accept, a segment, a log file), far from the cause.  With
``ulimit -n 1024`` an engine ran out at 90 associations.  So a new peer is refused while fewer
than `DESCRIPTOR_RESERVE` remain, naming the limit, and the engine keeps serving the peers it
has.  Reading the count is the driver's business (it reads ``/proc``), deciding on it is not.
"""

from __future__ import annotations

import os
import resource

__all__ = ("DESCRIPTOR_RESERVE", "headroom_problem")

DESCRIPTOR_RESERVE = 64  # a few associations' worth, and room for the engine's own files


def headroom_problem(reserve: int = DESCRIPTOR_RESERVE) -> str | None:
    """Why this process cannot take on another peer (fewer than `reserve` descriptors left
    under its soft ``RLIMIT_NOFILE``), or None; None too when it cannot tell (no
    ``/proc/self/fd``, or no limit).  Never raises."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        return None
    if soft == resource.RLIM_INFINITY or soft - open_now >= reserve:
        return None
    return (
        f"only {soft - open_now} file descriptors left ({open_now} open of RLIMIT_NOFILE {soft}; "
        f"a peer is accepted with at least {reserve} left): raise `ulimit -n`"
    )
