"""Installed into the vLLM CPU environment: every interpreter there asks Linux for AMX tile state.

Why: Linux lets a process use AMX only after it asks (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``); vLLM's CPU attention kernel uses AMX for bf16 without asking, and the
process dies of SIGILL when its first forward is small.  vLLM spawns its engine and worker
processes, so the request has to be made at every interpreter's start.  Elsewhere (no AMX, not
x86-64 Linux) the call fails or is skipped, and nothing changes.
"""

import contextlib
import ctypes
import platform
import sys

SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

if sys.platform == "linux" and platform.machine() == "x86_64":
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
