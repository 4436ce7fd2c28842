"""The open-loop workload of `kvflow bench pd`: Poisson arrivals and length distributions.

Why pure and seeded: every system must see the same requests at a given request rate (the
same arrival times, prompts and outputs), and a run must be repeatable; nothing here reads a
clock (arrival times are offsets from a point's start).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvflow.errors import ConfigError

__all__ = ("Arrival", "LengthDist", "arrivals")

KINDS = ("uniform", "lognormal", "fixed")


@dataclass(frozen=True)
class LengthDist:
    """Token counts within ``[low, high]``: uniform, lognormal (median `median`, sigma `sigma`,
    clipped to the bounds) or fixed (always `high`)."""

    kind: str
    low: int
    high: int
    median: int = 0  # lognormal; 0: the geometric mean of the bounds
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"length distribution: kind must be one of {KINDS}, not {self.kind!r}")
        if not 1 <= self.low <= self.high:
            raise ConfigError(f"length distribution: need 1 <= low <= high, not low={self.low} high={self.high}")
        if self.median < 0 or self.sigma <= 0:
            raise ConfigError(f"length distribution: bad median {self.median} or sigma {self.sigma}")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """``uniform:LOW:HIGH``, ``lognormal:LOW:HIGH[:MEDIAN[:SIGMA]]`` or ``fixed:N``.

        :raises ConfigError: a malformed description.
        """
        parts = text.split(":")
        try:
            if parts[0] == "fixed" and len(parts) == 2:
                return cls("fixed", int(parts[1]), int(parts[1]))
            if len(parts) < 3:
                raise ValueError("too few fields")
            extra = [float(p) for p in parts[3:5]]
            median, sigma = (int(extra[0]) if extra else 0), (extra[1] if len(extra) > 1 else 1.0)
            return cls(parts[0], int(parts[1]), int(parts[2]), median, sigma)
        except ValueError as error:
            forms = "uniform:LOW:HIGH, lognormal:LOW:HIGH[:MEDIAN[:SIGMA]], fixed:N"
            raise ConfigError(f"length distribution {text!r}: {error} ({forms})") from None

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.high
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        median = self.median or math.sqrt(self.low * self.high)
        return min(self.high, max(self.low, round(rng.lognormvariate(math.log(median), self.sigma))))

    def describe(self) -> dict[str, object]:
        """What the results print: kind, bounds and the distribution's mean (estimated for a
        clipped lognormal from a fixed sample)."""
        if self.kind == "fixed":
            mean = float(self.high)
        elif self.kind == "uniform":
            mean = (self.low + self.high) / 2
        else:
            rng = random.Random(0)
            mean = sum(self.sample(rng) for _ in range(20_000)) / 20_000
        return {"dist": self.kind, "min": self.low, "max": self.high, "mean": round(mean, 1)}


@dataclass(frozen=True)
class Arrival:
    """One request: its arrival (seconds after the point's start), prompt and output tokens."""

    id: str
    arrival_s: float
    prompt: int
    output: int


def arrivals(qps: float, count: int, prompt: LengthDist, output: LengthDist, seed: int) -> list[Arrival]:
    """`count` requests arriving as a Poisson process of rate `qps` (exponential gaps; the first
    arrives after one gap), the same for every call with the same arguments.

    :raises ConfigError: a non-positive rate or count.
    """
    if not qps > 0 or count < 1:
        raise ConfigError(f"workload: need qps > 0 and requests >= 1, not qps={qps} requests={count}")
    rng = random.Random(f"{seed}/{qps!r}")
    t = 0.0
    out = []
    for i in range(count):
        t += rng.expovariate(qps)
        out.append(Arrival(f"q{qps:g}-{i}", t, prompt.sample(rng), output.sample(rng)))
    return out
