"""The router and stand-in OpenAI servers as real processes, for the router tests.

Why a helper module: four router test modules start the same processes and stop them the same
way (no traceback, no unclosed resource in their output).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from kvflow_tools.children import Collected

ROOT = Path(__file__).resolve().parent.parent
ROUTER_MODULE = "kvflow_tools.routing.router"
WAIT = 20.0  # the most any one wait in these tests may take
BAD_OUTPUT = ("Traceback", "ResourceWarning", "Unclosed", "never retrieved", "Error handling request")


class Process(Collected):
    """A child Python process, ResourceWarnings shown, whose output lines a thread collects."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        super().__init__([sys.executable, "-W", "default::ResourceWarning", *args], env=env, cwd=ROOT)

    def wait_for(self, pattern: str, timeout: float = WAIT) -> re.Match[str]:
        """:raises AssertionError: no line matched within `timeout` seconds."""
        match = super().wait_for(pattern, timeout)
        if match is None:
            raise AssertionError(f"no line matching {pattern!r}; output: {''.join(self.output)}")
        return match

    def stop(self, timeout: float = WAIT) -> str:
        return super().stop(timeout)


def start_fake(name: str) -> tuple[Process, str]:
    process = Process("-m", "tests.fake_openai_server", "--name", name)
    port = process.wait_for(r'"port": (\d+)').group(1)
    return process, f"http://127.0.0.1:{port}"


def start_router(prefill: str, decode: str, *extra: str) -> tuple[Process, str]:
    process = Process(
        "-m",
        ROUTER_MODULE,
        "--port",
        "0",
        "--prefill",
        prefill,
        "--prefill-engine",
        "prefill-0",
        "--prefill-kvflow",
        "tcp://127.0.0.1:5700",
        "--decode",
        decode,
        "--decode-engine",
        "decode-0",
        "--decode-kvflow",
        "tcp://127.0.0.1:5800",
        *extra,
    )
    return process, process.wait_for(r"router listening on (http://\S+)").group(1)


def stop_clean(process: Process) -> None:
    output = process.stop()
    for marker in BAD_OUTPUT:
        assert marker not in output, output
