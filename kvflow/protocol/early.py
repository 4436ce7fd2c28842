"""Messages about transfers not started here yet, and how a pool every peer shares is split.

Why apart from the store: a peer may legitimately be ahead (pull: P is ready before D
allocates; either side gave up before the other started), so such messages are kept until the
transfer starts here or `retention` passes.  Every peer draws on the same memory for them (and
on the same registrations pool, see the inbox), so the rule that splits a full pool lives here:
the heaviest holder gives way (`heaviest`, "longest queue drop" of shared-buffer switches).  A
peer that holds less than the heaviest always gets in, by pushing out the heaviest's oldest;
the heaviest itself is refused.  A fixed quota per peer cannot promise that: four peers at their
quota filled what was kept for everyone, and the oldest message, a genuine one, went first.

Weight is counted in block ids as well as in messages: 200 ready messages of 131,072 block ids
each, counted as messages, held about 1 GiB.  Pure: time is an input.
"""

from __future__ import annotations

from kvflow.protocol.messages import Claim, Heartbeat, Message, Notice, Ready, Registration, TransferKey

__all__ = ("EarlyMessages", "heaviest", "message_blocks")

Entry = tuple[str, Message, float]  # (peer, message, kept until)


def heaviest(loads: dict[str, int], mine: int, weight: int) -> str | None:
    """Who gives way when a full pool is asked for `weight` more by a holder of `mine`: the
    peer holding most, if it would still hold more than the asker (else None: the asker is, or
    would become, the heaviest itself, and is refused)."""
    if not loads:
        return None
    peer = max(loads, key=loads.__getitem__)
    return peer if loads[peer] > mine + weight else None


def message_blocks(message: object) -> int:
    """The block ids (or transfer keys) a message carries: what keeping it costs beyond the
    message itself."""
    if isinstance(message, Ready | Registration):
        return len(message.block_ids)
    return len(message.keys) if isinstance(message, Heartbeat) else 0


class EarlyMessages:
    """Per transfer key, what peers said about it before it started here, in arrival order;
    bounded per peer (`per_peer` messages) and in total (`capacity` messages, `block_capacity`
    block ids), shared by `within_share`."""

    def __init__(self, retention: float, capacity: int, per_peer: int, block_capacity: int) -> None:
        self.retention = retention
        self.capacity = capacity
        self.per_peer = per_peer
        self.block_capacity = block_capacity
        self._held: dict[TransferKey, list[Entry]] = {}
        self._by_peer: dict[str, tuple[int, int]] = {}  # (messages, block ids) each peer has held
        self._messages = 0
        self._blocks = 0
        self.pushed_out = 0  # messages forgotten to make room for a lighter peer's

    def hold(self, peer: str, message: Message, now: float) -> bool:
        """Keep `message` from `peer` for `retention` seconds, or refuse it (False) when it
        would go beyond the peer's `per_peer` messages, or a pool is full and `peer` is its
        heaviest holder.  Messages whose time is up go first, then the heaviest holder's oldest."""
        self._expire(now)
        held = self._held.get(message.key, [])
        if isinstance(message, Notice):
            # The peer withdrew: a ready message kept before it names blocks it may now reuse,
            # a claim kept before it asks for a read that will not come, and this side has
            # answered (or will answer) that nothing of it is in flight.  So they go even when
            # the notice itself is refused.
            self._uncount([entry for entry in held if isinstance(entry[1], Ready | Claim)])
            held[:] = [entry for entry in held if not isinstance(entry[1], Ready | Claim)]
            if not held:
                self._held.pop(message.key, None)
        messages, blocks = self._by_peer.get(peer, (0, 0))
        weight = message_blocks(message)
        if messages >= self.per_peer or weight > self.block_capacity // 2:
            return False
        while self._messages + 1 > self.capacity or self._blocks + weight > self.block_capacity:
            by_blocks = self._blocks + weight > self.block_capacity
            loads = {p: load[1 if by_blocks else 0] for p, load in self._by_peer.items()}
            victim = heaviest(loads, blocks if by_blocks else messages, weight if by_blocks else 1)
            if victim is None:
                return False
            self._push_out(victim)
        self._held.setdefault(message.key, []).append((peer, message, now + self.retention))
        self._count(peer, 1, weight)
        return True

    def has(self, key: TransferKey) -> bool:
        return key in self._held

    def count_from(self, peer: str) -> tuple[int, int]:
        """(messages, block ids) of `peer` held now."""
        return self._by_peer.get(peer, (0, 0))

    def totals(self) -> tuple[int, int]:
        """(messages, block ids) held now, of every peer."""
        return self._messages, self._blocks

    def pop(self, key: TransferKey, now: float) -> list[tuple[str, Message]]:
        """Take what peers said about `key` before it started here and is still fresh, in order."""
        held = self._held.pop(key, [])
        self._uncount(held)
        return [(peer, message) for peer, message, until in held if until > now]

    def drop_from(self, peer: str) -> None:
        """Forget what `peer` said about transfers not started here (it was torn down)."""
        for key in [key for key, held in self._held.items() if held[0][0] == peer]:
            self._uncount(self._held.pop(key))

    def _push_out(self, victim: str) -> None:
        """Forget the oldest message `victim` holds (and it holds one: it has a load)."""
        for key, held in self._held.items():
            for entry in held:
                if entry[0] == victim:
                    held.remove(entry)
                    self._uncount([entry])
                    if not held:
                        del self._held[key]
                    self.pushed_out += 1
                    return

    def _expire(self, now: float) -> None:
        # keys are in the order their first message came, and every message is kept equally
        # long: the oldest first entry is the first to go
        while self._held:
            key, held = next(iter(self._held.items()))
            if held[0][2] > now:
                return
            self._uncount(self._held.pop(key))

    def _count(self, peer: str, messages: int, blocks: int) -> None:
        held_messages, held_blocks = self._by_peer.get(peer, (0, 0))
        after = (held_messages + messages, held_blocks + blocks)
        if after == (0, 0):
            self._by_peer.pop(peer, None)
        else:
            self._by_peer[peer] = after
        self._messages += messages
        self._blocks += blocks

    def _uncount(self, entries: list[Entry]) -> None:
        for peer, message, _ in entries:
            self._count(peer, -1, -message_blocks(message))
