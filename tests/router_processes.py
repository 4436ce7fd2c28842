"""The router and stand-in OpenAI servers as real processes, for the router tests.

Why a helper module: four router test modules start the same processes and stop them the same
way (no traceback, no unclosed resource in their output).
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROUTER_MODULE = "kvflow_tools.routing.router"
WAIT = 20.0  # the most any one wait in these tests may take
BAD_OUTPUT = ("Traceback", "ResourceWarning", "Unclosed", "never retrieved", "Error handling request")


class Process:
    """A child process; a thread collects its output lines (stdout and stderr together)."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.popen = subprocess.Popen(
            [sys.executable, "-W", "default::ResourceWarning", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.output.append(line)
            self._lines.put(line)

    def wait_for(self, pattern: str) -> re.Match[str]:
        while True:
            try:
                line = self._lines.get(timeout=WAIT)
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r}; output: {''.join(self.output)}") from None
            if match := re.search(pattern, line):
                return match

    def stop(self) -> str:
        """Terminate, wait (then kill), and return everything it wrote."""
        self.popen.terminate()
        try:
            self.popen.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=WAIT)
        self._reader.join(timeout=WAIT)
        assert self.popen.stdout is not None
        self.popen.stdout.close()
        return "".join(self.output)


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
