"""Mamba / linear-attention state pages between ranks of different tensor parallelism.

Why its own module: a state page is not tokens of heads, so `kvflow.layout.plan`'s head and
token slicing does not apply.  A rank's page holds its shard of each of the layer's states side
by side, padded up to the attention page: the conv state, whose columns are the sub-projections
(x, B, C for Mamba2; Q, K, V for gated delta nets; x for Mamba1) each sharded over the ranks,
then the temporal (SSM) state, sharded by heads.  Between ranks of different tensor parallelism
each P rank moves the parts of every sub-projection and of the temporal state that the D rank
holds too, so that D's page ends up the one D would have computed, whichever side has more
ranks.  The conv state is (columns, rows) per page in vLLM's "DS" layout (a column's rows are
one run of bytes, so a shard of a sub-projection is one run) or (rows, columns) in "SD" (one run
per row and sub-projection); both can be sliced.

`StateSplit` is what both sides must agree on, model-wide: the orientation, the conv rows, and
the bytes of one row of each sub-projection and of the temporal state *over all ranks*
(`text` / `parse_split` carry it in the layout fingerprint).  `state_runs` is pure arithmetic
on those and each side's (rank, ranks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvflow.errors import ConfigError, InvalidBatch, LayoutMismatch

__all__ = ("StateRun", "StateSplit", "parse_split", "state_runs")

_TEXT = re.compile(
    r"(?P<orient>ds|sd):(?P<rows>[0-9]{1,6}):(?P<parts>[0-9]{1,15}(\+[0-9]{1,15}){0,7}):(?P<ssm>[0-9]{1,15})"
)


@dataclass(frozen=True, slots=True)
class StateSplit:
    """How a state page splits over tensor-parallel ranks, in bytes summed over all ranks.

    `orientation`: "ds" (each conv column's `rows` values together) or "sd" (each row's columns
    together); `parts`: the bytes of one conv row of each sub-projection; `temporal`: the
    temporal state's bytes.  A rank of ``tp`` holds ``1/tp`` of each, at its rank's position."""

    orientation: str
    rows: int
    parts: tuple[int, ...]
    temporal: int

    def __post_init__(self) -> None:
        if self.orientation not in ("ds", "sd") or self.rows <= 0 or not self.parts or len(self.parts) > 8:
            raise ConfigError(f"state split {self!r}: orientation ds or sd, rows > 0, 1..8 parts")
        if any(part <= 0 for part in self.parts) or self.temporal < 0:
            raise ConfigError(f"state split {self!r}: parts > 0 bytes, temporal >= 0 bytes")

    def text(self) -> str:
        return f"{self.orientation}:{self.rows}:{'+'.join(map(str, self.parts))}:{self.temporal}"

    def rank_bytes(self, ranks: int) -> int:
        """The state bytes of one rank of `ranks` (conv then temporal; the page's padding after).

        :raises LayoutMismatch: a part or the temporal state does not split over `ranks`.
        """
        _check_divides(self, ranks)
        return (self.rows * sum(self.parts) + self.temporal) // ranks


def parse_split(text: str) -> StateSplit | None:
    """The split `StateSplit.text` wrote; None for "" (a state kvflow cannot slice: moved only
    between equal tensor parallelism).

    :raises ConfigError: the text is malformed.
    """
    if text == "":
        return None
    match = _TEXT.fullmatch(text)
    if match is None:
        raise ConfigError(f"state split {text[:80]!r} is not ORIENTATION:ROWS:PART+PART...:TEMPORAL")
    parts = tuple(int(part) for part in match["parts"].split("+"))
    return StateSplit(match["orient"], int(match["rows"]), parts, int(match["ssm"]))


@dataclass(frozen=True, slots=True)
class StateRun:
    """A run of bytes of one page that moves: at `local` in this side's page, `remote` in the
    other's, `length` bytes."""

    local: int
    remote: int
    length: int


def _check_divides(split: StateSplit, ranks: int) -> None:
    if ranks <= 0 or any(part % ranks for part in split.parts) or split.temporal % ranks:
        raise LayoutMismatch(
            "state_split",
            split.text(),
            ranks,
            detail=f"the Mamba state's sub-projections and temporal state do not split over {ranks} ranks",
        )


def _overlap(extent: int, here: tuple[int, int], there: tuple[int, int]) -> tuple[int, int, int] | None:
    """Where the shards of a segment of `extent` bytes that rank here[0] of here[1] and rank
    there[0] of there[1] hold overlap: (offset in here's shard, in there's, length), or None."""
    size_here, size_there = extent // here[1], extent // there[1]
    start_here, start_there = here[0] * size_here, there[0] * size_there
    low, high = max(start_here, start_there), min(start_here + size_here, start_there + size_there)
    if low >= high:
        return None
    return low - start_here, low - start_there, high - low


def state_runs(split: StateSplit, local: tuple[int, int], remote: tuple[int, int]) -> tuple[StateRun, ...]:
    """The runs of a state page that rank ``local[0]`` of ``local[1]`` and rank ``remote[0]`` of
    ``remote[1]`` both hold, in page order of the local side (none: they share no shard).

    :raises LayoutMismatch: a part or the temporal state does not split over a side's ranks.
    :raises InvalidBatch: a rank outside its side's ranks.
    """
    for rank, ranks in (local, remote):
        _check_divides(split, ranks)
        if not 0 <= rank < ranks:
            raise InvalidBatch(f"rank {rank} of {ranks} ranks does not exist")
    runs: list[StateRun] = []
    local_row, remote_row = sum(split.parts) // local[1], sum(split.parts) // remote[1]
    offsets = [0, 0]  # where the current sub-projection starts in one row of each side's conv state
    for part in split.parts:
        shared = _overlap(part, local, remote)
        if shared is not None:
            here, there, length = shared
            if split.orientation == "ds":  # a shard's columns are one run of rows each, side by side
                runs.append(
                    StateRun(split.rows * (offsets[0] + here), split.rows * (offsets[1] + there), split.rows * length)
                )
            else:  # one run per row
                runs += [
                    StateRun(row * local_row + offsets[0] + here, row * remote_row + offsets[1] + there, length)
                    for row in range(split.rows)
                ]
        offsets[0] += part // local[1]
        offsets[1] += part // remote[1]
    shared = _overlap(split.temporal, local, remote) if split.temporal else None
    if shared is not None:
        here, there, length = shared
        runs.append(StateRun(split.rows * local_row + here, split.rows * remote_row + there, length))
    if split.orientation == "sd":
        runs.sort(key=lambda run: run.local)
    return tuple(runs)
