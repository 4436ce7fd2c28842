"""The fuzzed soak's own checks: a window across a P restart counts what the new process counted,
never a negative; an attack that could not run, or neither sent anything nor was refused, fails the
fuzz; a recorded stream with no message past its handshake is not a replay."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from kvflow_tools.bench.soak_fuzz import Fuzzer, window_counts
from kvflow_tools.testing.fuzz import GREETING, carries_messages


def test_a_window_counts_growth_and_across_a_restart_what_the_new_process_counted() -> None:
    assert window_counts({"a": 5, "b": 2}, {"a": 9, "b": 2, "c": 1}) == ({"a": 4, "c": 1}, False)
    counted, restarted = window_counts({"a": 500, "b": 20}, {"a": 7, "b": 30})
    assert restarted and counted == {"a": 7, "b": 30}  # since the restart: a lower bound
    assert all(v >= 0 for v in counted.values())


def attacker(*events: dict[str, object]) -> list[str]:
    lines = [json.dumps(event) for event in events]
    return [sys.executable, "-c", f"print({chr(10).join(lines)!r})"]


async def no_stats() -> dict[str, object]:
    return {"control": {}}


@pytest.mark.parametrize(
    ("end", "failure"),
    [
        ({"event": "end", "attack": "replay", "sent": 0, "refused": 0}, "attack replay sent nothing"),
        ({"event": "end", "attack": "replay", "error": "ValueError: no message"}, "attack replay could not run"),
        ({"event": "end", "attack": "replay", "sent": 3, "refused": 0}, ""),
        ({"event": "end", "attack": "unfinished_multipart", "sent": 0, "refused": 1}, ""),  # CURVE said no
    ],
)
def test_an_attack_that_did_nothing_fails_the_fuzz(end: dict[str, object], failure: str) -> None:
    fuzzer = Fuzzer(attacker({"event": "begin", "attack": "replay"}, end), {}, no_stats)
    asyncio.run(fuzzer.run())
    assert len(fuzzer.attacks) == 1
    assert fuzzer.failure.startswith(failure) if failure else fuzzer.failure == ""


def test_a_stream_carries_messages_only_past_its_greeting_and_handshake() -> None:
    greeting = bytes(GREETING)
    ready = bytes([0x04, 5]) + b"READY"
    message = bytes([0x00, 3]) + b"abc"
    assert not carries_messages(greeting) and not carries_messages(greeting + ready)
    assert carries_messages(greeting + ready + message) and carries_messages(greeting + message)
