"""How many file descriptors this process has left, checked before a new peer is accepted.

Why: every association costs descriptors (its control connection, and the transport's files,
mappings and endpoints: about 11 with the shared-memory transport), and a process out of them
fails in whatever opens one next (an accept, a segment, a log file), far from the cause.  With
``ulimit -n 1024`` an engine ran out at 90 associations.  So a new peer is refused while fewer
than `reserve_for(limit)` remain (`DESCRIPTOR_RESERVE`, or a sixteenth of a lower limit but never
fewer than `RESERVE_FLOOR`, two associations' worth: below what the control channel
keeps free by closing idle connections, `kvflow.control.connections.keep_free`, so that a peer
that got in is not then refused for it), naming the limit, and the engine keeps serving the
peers it has.  Peers still being added count too (`PEER_DESCRIPTORS` each): their files are not
open yet, and Hellos arriving together all saw the same count (16 names at once took a process
at a limit of 256 to 6 descriptors left).  Reading the count is the driver's business (it reads
``/proc``), deciding on it is not.
"""

from __future__ import annotations

import resource

from kvflow.control.connections import open_descriptors

__all__ = (
    "DESCRIPTOR_RESERVE",
    "PEER_DESCRIPTORS",
    "RESERVE_FLOOR",
    "RESERVE_SHARE",
    "headroom_problem",
    "reserve_for",
)

DESCRIPTOR_RESERVE = 64  # a few associations' worth, and room for the engine's own files
RESERVE_SHARE = 16  # or a sixteenth of the limit, if less ...
RESERVE_FLOOR = 24  # ... but never less: an association takes about 11, and the engine opens files as it works
PEER_DESCRIPTORS = 11  # what one association opens (shared memory: 9 measured with one segment a peer)


def reserve_for(limit: int) -> int:
    """Descriptors a process under soft limit `limit` keeps for the work of the peers it has:
    `DESCRIPTOR_RESERVE`, a `RESERVE_SHARE`th of a lower limit, at least `RESERVE_FLOOR`.
    (At a limit of 128 a reserve of 8 let a peer in with fewer left than its association then
    took: the process failed in whatever opened a file next.)  Never raises."""
    return min(DESCRIPTOR_RESERVE, max(limit // RESERVE_SHARE, RESERVE_FLOOR))


def headroom_problem(reserve: int | None = None, adding: int = 0) -> str | None:
    """Why this process cannot take on another peer (fewer than `reserve` descriptors left
    under its soft ``RLIMIT_NOFILE``, by default `reserve_for` the limit, beyond what the
    `adding` peers still being added will open), or None; None too when it cannot tell (no
    ``/proc/self/fd``, or no limit).  Never raises."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if reserve is None:
        reserve = DESCRIPTOR_RESERVE if soft == resource.RLIM_INFINITY else reserve_for(soft)
    try:
        open_now = open_descriptors()
    except OSError:
        return None
    needed = reserve + adding * PEER_DESCRIPTORS
    if soft == resource.RLIM_INFINITY or soft - open_now >= needed:
        return None
    being_added = f", and {PEER_DESCRIPTORS} for each of the {adding} peers being added" if adding else ""
    return (
        f"only {soft - open_now} file descriptors left ({open_now} open of RLIMIT_NOFILE {soft}; "
        f"a peer is accepted with at least {reserve} left{being_added}): raise `ulimit -n`"
    )
