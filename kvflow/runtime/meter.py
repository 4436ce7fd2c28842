"""Per-transfer figures for an embedder's metrics.

How long each transfer this engine moved took, its bytes and descriptors, and how transfers
ended.

Why apart from the engine: the engine only feeds a `TransferMeter` from its loop (an op is asked
for, an op was posted, blocks come back, a transfer's outcome is decided); an embedder's metrics (vLLM's connector
stats) take what accumulated from any thread with `take`, which holds a lock for a list swap and
never waits for the engine's loop.

What a sample is: the side that posts a transfer's data ops (P when pushing, D when pulling, as
vLLM's NIXL connectors count the side that posts) records, once its ops all completed without
error (its blocks come back with a successful outcome, or the transfer succeeded), the seconds
from its first op being asked for to then, the seconds spent planning and posting its ops, and
the bytes and descriptors of those ops.  A pushing P's blocks come back when its WRITEs
completed, before D's verdict: the sample is taken then, so it reaches the host engine in the
step that hands the blocks back; the verdict is counted in `outcomes` when it comes (both
sides).  Samples nobody takes are bounded: the oldest are dropped (and counted) past
`max_samples`.

`quantile` is the one percentile every figure kvflow reports uses (metrics and benchmarks
alike), so that a p90 means the same thing in every table.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvflow.errors import ConfigError
from kvflow.protocol.messages import TransferKey
from kvflow.protocol.state import Outcome, Role

__all__ = ("QUANTILE_METHOD", "MeterReading", "TransferMeter", "TransferSample", "quantile")

QUANTILE_METHOD = "linear interpolation between closest ranks (numpy's default)"


def quantile(values: Iterable[float], q: float) -> float:
    """The `q`-quantile of `values` (0 <= q <= 1), by `QUANTILE_METHOD`: for the samples
    1..10, p50 is 5.5, p90 9.1 and p99 9.91.  NaN when there are no values.

    :raises ConfigError: `q` is outside [0, 1], or a value is not a finite number.
    """
    if not 0.0 <= q <= 1.0:
        raise ConfigError(f"a quantile is between 0 and 1, not {q!r}")
    ordered = sorted(float(v) for v in values)
    if any(not math.isfinite(v) for v in ordered):
        raise ConfigError(f"the quantile of a non-finite value: {next(v for v in ordered if not math.isfinite(v))}")
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class TransferSample:
    """One successful transfer, as the side that posted its data ops saw it."""

    seconds: float  # first op asked for -> every op completed
    post_seconds: float  # planning and posting its ops (summed over ops)
    nbytes: int
    descriptors: int


@dataclass(frozen=True)
class MeterReading:
    """What accumulated since the previous `TransferMeter.take`."""

    samples: list[TransferSample] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)  # Outcome value -> transfers, both sides
    dropped: int = 0  # samples dropped because nobody took them in time


@dataclass
class _Open:
    first_asked: float
    asked: int = 0  # ops asked for
    reported: int = 0  # ops whose posting (or failure to post) was reported
    post_seconds: float = 0.0
    nbytes: int = 0
    descriptors: int = 0
    decided: tuple[Outcome, float] | None = None  # the outcome, once decided, and when


class TransferMeter:
    """Fed on the engine's loop (`op_asked`, `op_posted`, `released`, `resolved`); read from
    any thread (`take`).  A transfer's sample is made once its ops are known to have completed
    (or it failed) and every op it asked for was reported posted (the report of the last op may
    come after that)."""

    def __init__(self, max_samples: int = 10_000) -> None:
        self._open: dict[tuple[TransferKey, Role], _Open] = {}  # loop thread only
        self._lock = threading.Lock()
        self._samples: deque[TransferSample] = deque(maxlen=max_samples)
        self._outcomes: Counter[str] = Counter()
        self._dropped = 0

    def op_asked(self, key: TransferKey, role: Role, now: float) -> None:
        """The core asked for a data op of this transfer (the first one starts its clock)."""
        self._open.setdefault((key, role), _Open(now)).asked += 1

    def op_posted(self, key: TransferKey, role: Role, nbytes: int, descriptors: int, post_seconds: float) -> None:
        """An op of this transfer was posted to the transport (`nbytes` 0: it could not be)."""
        record = self._open.get((key, role))
        if record is None:
            return
        record.reported += 1
        record.nbytes += nbytes
        record.descriptors += descriptors
        record.post_seconds += post_seconds
        if record.decided is not None and record.reported >= record.asked:
            self._close(key, role, record)

    def released(self, key: TransferKey, role: Role, outcome: Outcome, now: float) -> None:
        """Blocks of the transfer came back; with a successful outcome its ops all completed."""
        if outcome is Outcome.SUCCEEDED:
            self._decide(key, role, outcome, now)

    def resolved(self, key: TransferKey, role: Role, outcome: Outcome, now: float) -> None:
        """The transfer's outcome is decided: counted now, and sampled (if it succeeded after
        ops were posted here) once its ops are all reported."""
        with self._lock:
            self._outcomes[outcome.value] += 1
        self._decide(key, role, outcome, now)

    def take(self) -> MeterReading:
        """Everything since the previous call, a reading of the caller's own (a new one each
        time, even when empty); never blocks on the engine's loop."""
        if not (self._samples or self._outcomes or self._dropped):
            return MeterReading()  # nothing to swap (what the loop adds meanwhile waits for the next call)
        with self._lock:
            reading = MeterReading(list(self._samples), dict(self._outcomes), self._dropped)
            self._samples.clear()
            self._outcomes.clear()
            self._dropped = 0
        return reading

    def _decide(self, key: TransferKey, role: Role, outcome: Outcome, now: float) -> None:
        record = self._open.get((key, role))
        if record is None or record.decided is not None:
            return
        record.decided = (outcome, now)
        if record.reported >= record.asked:
            self._close(key, role, record)

    def _close(self, key: TransferKey, role: Role, record: _Open) -> None:
        del self._open[(key, role)]
        assert record.decided is not None
        outcome, when = record.decided
        if outcome is not Outcome.SUCCEEDED or not record.nbytes:
            return
        sample = TransferSample(when - record.first_asked, record.post_seconds, record.nbytes, record.descriptors)
        with self._lock:
            if len(self._samples) == self._samples.maxlen:
                self._dropped += 1
            self._samples.append(sample)
