"""KV cache groups: which layers share a block table, and which block positions each keeps.

Why: with vLLM's hybrid KV cache manager a model's layers fall into groups, each with a block
table of its own drawn from one shared pool: full-attention groups keep a block for every
block position of a request, sliding-window groups free the blocks that fell out of the
window (their entries become vLLM's null block), and Mamba / linear-attention groups keep a
request's recurrent state, of which only the running state (one block) moves.  A transfer moves
one group's layers with that group's blocks, and only the positions the group still keeps.  kvflow numbers layers
group by group, so that each group is one range of layers ``[start, stop)``.

Both sides of a transfer must agree on the groups (the fingerprint carries `groups_text`);
where a sliding-window group's window starts is the same pure rule on both
(`KVGroup.kept_from`, vLLM's ``SlidingWindowManager.get_num_skipped_tokens``).  Pure code.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.errors import ConfigError

__all__ = ("MAX_GROUPS", "KVGroup", "check_groups", "group_of", "groups_text", "parse_groups")

MAX_GROUPS = 64  # KV cache groups one model may have (Gemma-3-27B has 7; vLLM makes one per kind and size)
_ENTRY = re.compile(r"(full|ssm|sw(?P<retained>[0-9]{1,9}))\*(?P<layers>[0-9]{1,6})")


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers ``[layers[0], layers[1])`` share one block table.  `retained`: None for a group
    that keeps the KV of every token (full attention); for a sliding-window group, how many
    tokens before the next one it keeps (vLLM's ``num_retained_tokens``: window - 1, plus the
    tokens multi-module speculative decoding re-prefills).  `state`: a Mamba / linear-attention
    group, whose one running-state block is what moves (its page is the state, padded to the
    attention page); `scratch`: the speculative-decoding blocks vLLM keeps after that state in
    the group's table (a local setting: not in `text`, and each side reads its own)."""

    layers: tuple[int, int]
    retained: int | None = None
    state: bool = False
    scratch: int = 0

    @property
    def count(self) -> int:
        """Layers in the group."""
        return self.layers[1] - self.layers[0]

    @property
    def sliding(self) -> bool:
        return self.retained is not None

    def kept_from(self, tokens: int, block_size: int) -> int:
        """The first block position whose KV the group still holds once `tokens` tokens are
        computed: 0 for full attention (and a state group, which moves its state block alone,
        `state_block`); for a sliding window, the blocks wholly before the retained tokens are
        freed (vLLM frees ``skipped // block_size`` blocks, ``skipped = max(0, tokens -
        retained)``)."""
        if self.retained is None:
            return 0
        return max(0, tokens - self.retained) // block_size

    def state_block(self, table: Sequence[int | None]) -> int | None:
        """A state group's running-state block in a request's table: the last entry before the
        speculative scratch blocks (vLLM's NIXL connector reads the same one); None if that
        entry is vLLM's null block or the table is empty."""
        if not table:
            return None
        return table[len(table) - 1 - min(self.scratch, len(table) - 1)]

    def text(self) -> str:
        kind = "ssm" if self.state else "full" if self.retained is None else f"sw{self.retained}"
        return f"{kind}*{self.count}"


def groups_text(groups: Sequence[KVGroup]) -> str:
    """The groups as the fingerprint carries them (``full*10,sw1023*52``); "" for one group of
    full attention, a model without vLLM's hybrid KV cache manager."""
    if len(groups) == 1 and groups[0].retained is None and not groups[0].state:
        return ""
    return ",".join(group.text() for group in groups)


def parse_groups(text: str, num_layers: int) -> tuple[KVGroup, ...]:
    """The groups `groups_text` wrote, for a model of `num_layers` layers, numbered in order.

    :raises ConfigError: the text is malformed, names more than `MAX_GROUPS` groups, a group
        without layers, or layers that do not add up to `num_layers`.
    """
    if text == "":
        return (KVGroup((0, num_layers)),)
    entries = text.split(",")
    if len(entries) > MAX_GROUPS:
        raise ConfigError(f"kv groups {text[:80]!r}: more than {MAX_GROUPS} groups")
    groups: list[KVGroup] = []
    start = 0
    for entry in entries:
        match = _ENTRY.fullmatch(entry)
        if match is None or int(match["layers"]) == 0:
            raise ConfigError(f"kv groups entry {entry[:40]!r} is not full*LAYERS or swRETAINED*LAYERS (LAYERS > 0)")
        retained = None if match["retained"] is None else int(match["retained"])
        stop = start + int(match["layers"])
        groups.append(KVGroup((start, stop), retained, state=entry.startswith("ssm")))
        start = stop
    if start != num_layers:
        raise ConfigError(f"kv groups {text[:80]!r} hold {start} layers, the model has {num_layers}")
    return tuple(groups)


def group_of(groups: Sequence[KVGroup], layers: tuple[int, int]) -> KVGroup | None:
    """The group whose layers hold all of `layers` (a non-empty range), or None when none does
    (the range crosses groups, or lies outside the model)."""
    start, stop = layers
    for group in groups:
        if group.layers[0] <= start < stop <= group.layers[1]:
            return group
    return None


def check_groups(groups: Sequence[KVGroup], num_layers: int) -> tuple[KVGroup, ...]:
    """`groups`, checked to cover layers ``0..num_layers`` in order, each with a layer; none:
    one group of every layer.

    :raises ConfigError: they do not.
    """
    groups = tuple(groups) or (KVGroup((0, num_layers)),)
    start = 0
    for group in groups:
        if group.layers[0] != start or group.layers[1] <= start:
            break
        start = group.layers[1]
    else:
        if start == num_layers and len(groups) <= MAX_GROUPS:
            return groups
    spans = [group.layers for group in groups]
    raise ConfigError(f"KV cache groups {spans[:8]} do not cover layers 0..{num_layers} in order")
