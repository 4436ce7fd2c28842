"""The groups a process started are stopped when it is SIGKILLed: its warden sees the pipe end and
stops every group still watched (leader and children), and forgets the ones stopped before."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvflow_tools.children import import_path
from kvflow_tools.serve.processes import group_alive
from kvflow_tools.serve.warden import _watched

STARTER = """
import json, sys, time
from pathlib import Path
from kvflow_tools.serve.processes import WARDEN, Group

out = Path(sys.argv[1])
kept = Group("kept", ["sh", "-c", "sleep 300 & sleep 300"], {}, out / "kept.log")
stopped = Group("stopped", ["sleep", "300"], {}, out / "stopped.log")
kept.start()
stopped.start()
assert stopped.stop(grace=5.0)
print(json.dumps({"kept": kept.pid, "stopped": stopped.pid, "warden": WARDEN.pid}), flush=True)
time.sleep(300)
"""


def wait_for(done: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.1)
    return False


def test_a_starter_killed_with_sigkill_leaves_no_group_of_its_own_behind(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=import_path())
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(tmp_path)], stdout=subprocess.PIPE, env=env, start_new_session=True
    )
    kept = 0
    try:
        assert starter.stdout is not None
        pids = json.loads(starter.stdout.readline())
        kept, warden = pids["kept"], pids["warden"]
        assert group_alive(kept) and warden > 0 and not group_alive(pids["stopped"])
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(10)
        assert wait_for(lambda: not group_alive(kept), 20), "the kept group outlived its starter"
        assert wait_for(lambda: _gone(warden), 20), "the warden stayed"
    finally:
        starter.kill()
        starter.wait(10)
        if starter.stdout is not None:
            starter.stdout.close()
        if kept and group_alive(kept):
            os.killpg(kept, signal.SIGKILL)


def _gone(pid: int) -> bool:
    """No process `pid`, or only its zombie (its parent, the starter, is dead: init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_warden_watches_what_was_added_and_not_forgotten_and_ignores_other_lines() -> None:
    lines = ["+5\n", "+6\n", "-5\n", "junk\n", "+1\n", "+\n", "-7\n", "+8", "+9x\n"]
    assert _watched(lines) == {6, 8}
