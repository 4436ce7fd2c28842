"""What the pure core asks its driver to do, as frozen data.

Why data: the core never performs I/O.  It returns these, and the asyncio engine (or a test)
executes them.  A test can therefore assert on exactly what would have been sent, submitted or
released, without sockets or threads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvflow.protocol.messages import Message, TransferKey
from kvflow.protocol.state import Outcome, Role

__all__ = (
    "Action",
    "DeclarePeerLost",
    "OpKind",
    "ReleaseBlocks",
    "Resolve",
    "SendMessage",
    "SubmitOp",
)


class OpKind(enum.Enum):
    WRITE = "WRITE"  # local blocks -> remote blocks (push, on P)
    READ = "READ"  # remote blocks -> local blocks (pull, on D)


@dataclass(frozen=True, slots=True)
class SendMessage:
    peer: str
    message: Message


@dataclass(frozen=True, slots=True)
class SubmitOp:
    """Move `local_blocks[i]` <-> `remote_blocks[i]` for `layers` (None: all) in one op.

    The driver plans descriptors from the two layouts and submits them off the event loop; the
    op's completion comes back as `TransferCore.op_finished(op_id, ...)`.  When one side's
    blocks hold several of the other's, `fine_start` is where the first smaller block lands in
    the first larger one (in smaller blocks): a chunk of P's may end inside a block of D's.
    """

    op_id: int
    key: TransferKey
    peer: str
    kind: OpKind
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    layers: tuple[int, int] | None
    notification: bytes
    fine_start: int = 0


@dataclass(frozen=True, slots=True)
class ReleaseBlocks:
    """These blocks go back to their owner; no op of this transfer can touch them any more."""

    key: TransferKey
    role: Role
    block_ids: tuple[int, ...]
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class Resolve:
    """The transfer's outcome is decided (its blocks may still be quarantined)."""

    key: TransferKey
    role: Role
    outcome: Outcome
    reason: str


@dataclass(frozen=True, slots=True)
class DeclarePeerLost:
    """Tear the peer down (so nothing of it can land), then feed `TransferCore.peer_lost`."""

    peer: str
    reason: str


Action = SendMessage | SubmitOp | ReleaseBlocks | Resolve | DeclarePeerLost
