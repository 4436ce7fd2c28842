"""`kvflow_tools.children.spawn` on uvloop and on the standard loop: piped stdin and stdout,
an exit status awaited, a killed child's signal, pipes closed once it has exited (a transport
left open is a ResourceWarning, an error here, and keeps uvloop from closing)."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable

import pytest

from kvflow.runtime.loop import new_event_loop
from kvflow_tools.children import PIPE, spawn

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": new_event_loop,
    "asyncio": asyncio.new_event_loop,
}
ECHO = """import sys
for line in sys.stdin:
    print(line.strip().upper(), flush=True)
sys.stderr.write('bye')
sys.exit(3)"""


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_child_answers_on_its_pipes_and_its_exit_status_comes_back(loop: str) -> None:
    async def main() -> tuple[bytes, bytes, bytes, int]:
        child = await spawn([sys.executable, "-c", ECHO], stdin=True, stdout=True, stderr=PIPE)
        assert child.stdout is not None and child.stderr is not None
        child.write(b"one\n")
        first = await asyncio.wait_for(child.stdout.readline(), 30)
        child.write(b"two\n")
        second = await asyncio.wait_for(child.stdout.readline(), 30)
        child.close_stdin()
        error = await asyncio.wait_for(child.stderr.read(), 30)
        return first, second, error, await asyncio.wait_for(child.wait(), 30)

    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        assert runner.run(main()) == (b"ONE\n", b"TWO\n", b"bye", 3)


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_killed_child_reports_its_signal_and_writing_to_it_then_fails(loop: str) -> None:
    async def main() -> tuple[int | None, int, int | None]:
        child = await spawn([sys.executable, "-c", "import time; time.sleep(600)"], stdin=True)
        running = child.returncode
        child.kill()
        status = await asyncio.wait_for(child.wait(), 30)
        with pytest.raises(ConnectionError, match="stdin is closed"):
            child.write(b"late\n")
        child.kill()  # nothing, once it has exited
        return running, status, child.returncode

    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        assert runner.run(main()) == (None, -signal.SIGKILL, -signal.SIGKILL)
