"""vLLM's CPU platform for the stand-in's engine processes, as a vLLM platform plugin.

Why: vLLM's own NIXL connectors read the platform's device type (``cpu``) when their workers
start, so the processes `kvflow bench vllm` runs them in need vLLM's CPU platform.  From vLLM
0.34 on, that platform refuses an x86 CPU without Triton ("requires Triton (triton-cpu)"): its
own CPU model runner runs Triton kernels.  The stand-in replaces that model runner and runs no
vLLM kernel, so `StandInCpuPlatform` is vLLM's CPU platform with that one refusal turned back
into what vLLM 0.33 does, a warning; everything else (config checks, device type, distributed
backend) is vLLM's (`kvflow_tools.standin.cpu_platform`; this module imports no vLLM, as
vLLM loads it while it chooses its platform).

vLLM finds it through its ``vllm.platform_plugins`` entry point (tools/pyproject.toml), in a
process started with ``KVFLOW_STANDIN_PLATFORM=cpu`` and without ``VLLM_TARGET_DEVICE=cpu``
(which would select vLLM's own CPU platform first): `platform_env` makes that environment.
Elsewhere the plugin stays out of the way, and the tests' in-process stand-ins run on the
platform vLLM detects (none here: the stand-in plays a GPU engine's model runner).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ("PLATFORM_ENV", "platform_env", "plugin")

PLATFORM_ENV = "KVFLOW_STANDIN_PLATFORM"


def plugin() -> str | None:
    """vLLM's platform-plugin hook: the stand-in's CPU platform where the environment asks for it."""
    if os.environ.get(PLATFORM_ENV) != "cpu":
        return None
    return "kvflow_tools.standin.cpu_platform.StandInCpuPlatform"  # imported by vLLM, once it chose it


def platform_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a process that runs a stand-in engine on the stand-in's CPU platform."""
    made = dict(env)
    made[PLATFORM_ENV] = "cpu"
    if made.get("VLLM_TARGET_DEVICE") == "cpu":
        del made["VLLM_TARGET_DEVICE"]  # it would pick vLLM's own CPU platform before any plugin
    return made
