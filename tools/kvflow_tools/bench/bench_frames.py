"""`kvflow bench frames`: what the costliest control frames cost the engine loop to decode.

Why: a peer holding the secret can send frames as fast as the HMAC check passes them, so what
one frame costs to decode, per frame and per byte, is what bounds such a flood (the threat
model quotes these figures).  Each frame is the largest of its kind a peer may send, built and
decoded with `kvflow.control.wire` itself: best and median of `repeats` decodes, in turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from kvflow.control import wire
from kvflow.protocol.messages import (
    MAX_BLOCKS,
    MAX_HEARTBEAT_KEYS,
    MAX_TRANSFER_ID,
    ControlMessage,
    Heartbeat,
    Ready,
    Registration,
    TransferKey,
)

__all__ = ("add_arguments", "frames", "main")

LONG_ID = 240  # characters: as long as a heartbeat of the most keys can carry in one frame


def frames() -> dict[str, ControlMessage]:
    """The frames measured: the largest a peer may send of each kind, short and long ids."""
    key = TransferKey("t" * MAX_TRANSFER_ID, 1)
    blocks = tuple(range(MAX_BLOCKS))
    short = tuple(TransferKey(f"t{i}", i) for i in range(MAX_HEARTBEAT_KEYS))
    long = tuple(TransferKey(f"{i:0{LONG_ID}d}", i) for i in range(MAX_HEARTBEAT_KEYS))
    return {
        f"ready, {MAX_BLOCKS:,} block ids": Ready(key, blocks),
        f"registration, {MAX_BLOCKS:,} block ids": Registration(key, blocks, 1, 30.0),
        f"heartbeat, {MAX_HEARTBEAT_KEYS:,} keys of 2-5 characters": Heartbeat(short),
        f"heartbeat, {MAX_HEARTBEAT_KEYS:,} keys of {LONG_ID} characters": Heartbeat(long),
    }


def _time(frame: bytes) -> float:
    start = time.perf_counter()
    wire.decode(frame)
    return time.perf_counter() - start


def main(repeats: int = 15, json_path: str | None = None) -> int:
    """Print one row per frame: its bytes, best and median decode time, and ns per byte."""
    encoded = {name: wire.encode(wire.Envelope("P", 1, "D", 1, message)) for name, message in frames().items()}
    times: dict[str, list[float]] = {name: [] for name in encoded}
    for _ in range(repeats):  # in turns, so that a change of load shows in every row alike
        for name, frame in encoded.items():
            times[name].append(_time(frame))
    rows = [
        {
            "frame": name,
            "bytes": len(encoded[name]),
            "best_ms": min(samples) * 1e3,
            "median_ms": statistics.median(samples) * 1e3,
            "best_ns_per_byte": min(samples) * 1e9 / len(encoded[name]),
        }
        for name, samples in times.items()
    ]
    lines = [f"{'frame':52} {'bytes':>9} {'best ms':>8} {'median ms':>10} {'ns/byte':>8}"]
    for row in rows:
        lines.append(
            f"{row['frame']:52} {row['bytes']:>9,} {row['best_ms']:>8.2f} {row['median_ms']:>10.2f} "
            f"{row['best_ns_per_byte']:>8.1f}"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=15, help="decodes of each frame (default 15)")
    parser.add_argument("--json", help="also write the rows to this file")
