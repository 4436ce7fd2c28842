"""Everything one engine keeps about one peer's association, in one record.

Why one record: what an engine knows of a peer (its phase, the layout and run of the live
association, the addition the transport works on, a Hello waiting for it, messages that came
early, where the peer was last routed, each side's number for the association, additions given
up) changes together, input by input.  Kept as parallel dicts keyed by peer, every input had
to touch several of them in step and a test had to check that they agreed; one record per peer
makes "what is kept about P" one lookup, and a peer that keeps nothing has no record at all.
Pure data: `kvflow.protocol.association` decides what goes in and when a record goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.layout import KVLayout
from kvflow.protocol.messages import ControlMessage, Hello
from kvflow.protocol.peer_actions import PendingHello
from kvflow.protocol.phases import Phase

__all__ = ("PeerRecord",)


@dataclass(slots=True)
class PeerRecord:
    """One peer, as its associations keep it; the defaults are a peer of which nothing is kept.

    In `Phase.NONE` a record keeps only what outlives an association attempt: the address and
    our number of a handshake we started (bounded over all peers, live ones first) and additions
    given up before the transport answered."""

    phase: Phase = Phase.NONE
    # the association in place (phase `ANSWERING` or `ASSOCIATED`): the layout the peer announced,
    # the run it came from, and the peer's number for it
    layout: KVLayout | None = None
    incarnation: int | None = None
    theirs: int | None = None
    # phase `ADDING`: the Hello the transport is adding the peer for, and the newest Hello the
    # peer sent meanwhile (with its run), decided once the transport is done
    adding: PendingHello | None = None
    deferred: tuple[int, Hello] | None = None
    # messages the peer sent once associated with us, before our side was in place: delivered,
    # in order, once it is (bounded by `association.EARLY_MESSAGES_KEPT`)
    early: list[ControlMessage] = field(default_factory=list)
    address: str = ""  # the control address the peer was last routed at ("": none)
    ours: int | None = None  # our number for the association held or attempted
    # additions torn down before the transport answered about them: its answer changes nothing
    given_up: list[PendingHello] = field(default_factory=list)

    @property
    def engaged(self) -> bool:
        """Associated or being added (not in `Phase.NONE`): the peer counts toward the limit of
        peers, and its control connection stays open."""
        return self.phase is not Phase.NONE

    def keeps_nothing(self) -> bool:
        """Whether nothing of the peer is kept (the record can go)."""
        return (
            self.phase is Phase.NONE
            and self.layout is None
            and self.incarnation is None
            and self.theirs is None
            and self.adding is None
            and self.deferred is None
            and not self.early
            and not self.address
            and self.ours is None
            and not self.given_up
        )
