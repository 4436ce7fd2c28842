"""The systems the engine benchmarks run, and the Python that runs each.

Why a table of its own: a system is more than a connector's name.  vLLM 0.34 runs its push
connector as ``NixlConnector`` with ``transfer_mode: "push"`` while 0.33 names the class
``NixlPushConnector``, and the two releases cannot share an environment, so a system says which
vLLM release its engine processes need and `python_for` finds the environment that has it
(scripts/setup makes ``.venv`` with vLLM 0.34 and ``.venv-vllm-033`` with 0.33).  kvflow's
systems run on the vLLM of the environment the benchmark runs in.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from kvflow_tools.errors import BenchError

__all__ = ("CONNECTORS", "ENVIRONMENTS", "Connector", "installed_release", "python_for")

ROOT = Path(__file__).resolve().parents[3]  # the checkout: tools/kvflow_tools/bench/ is three below
ENVIRONMENTS = {"0.34": ".venv", "0.33": ".venv-vllm-033"}  # what scripts/setup makes


@dataclass(frozen=True)
class Connector:
    """One system: the vLLM connector class its engines load ("": none), kvflow's module path,
    what vLLM's own connector is configured with, and the vLLM release it needs (None: the one
    installed here)."""

    vllm_class: str
    module_path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    release: str | None = None
    push_proxy: bool = False  # dispatched as vLLM's push proxy does: both legs at once, D told P's coordinates


_KVFLOW = "kvflow.integrations.vllm"
CONNECTORS: dict[str, Connector] = {
    "kvflow": Connector("KVFlowConnector", _KVFLOW),
    "kvflow-pull": Connector("KVFlowConnector", _KVFLOW),
    # kvflow push with each rank's engine on a thread of the worker's process, not a process of its own
    "kvflow-thread": Connector("KVFlowConnector", _KVFLOW),
    # kvflow push with the end-to-end integrity check on both sides (every transfer checked)
    "kvflow-integrity": Connector("KVFlowConnector", _KVFLOW),
    # as vLLM's toy proxy: P with vLLM's own params, then D with P's answer (D pulls)
    "kvflow-sequential": Connector("KVFlowConnector", _KVFLOW),
    # the newest release's push: vLLM 0.34's NixlConnector in push mode (its NixlPushConnector)
    "vllm-push": Connector("NixlConnector", extra={"transfer_mode": "push"}, release="0.34", push_proxy=True),
    "vllm-pull": Connector("NixlConnector", release="0.34"),
    # vLLM 0.33's NixlPushConnector, as its users run it today
    "vllm-push-0.33": Connector("NixlPushConnector", release="0.33", push_proxy=True),
    # no KV connector: P and D each compute the prompt (`kvflow bench host`'s baseline)
    "alone": Connector(""),
}


def installed_release() -> str:
    """The vLLM release of this environment ("0.34"), or "" without vLLM."""
    try:
        return ".".join(version("vllm").split(".")[:2])
    except PackageNotFoundError:
        return ""


def python_for(connector: Connector) -> str:
    """The Python whose environment holds the vLLM release `connector` needs: this one, or the
    environment scripts/setup makes for it (``KVFLOW_VLLM_<release digits>_PYTHON``, e.g.
    ``KVFLOW_VLLM_033_PYTHON``, names another).

    :raises BenchError: no environment holds that release.
    """
    release = connector.release
    if release is None or release == installed_release():
        return sys.executable
    variable = "KVFLOW_VLLM_" + release.replace(".", "").zfill(3) + "_PYTHON"
    named = os.environ.get(variable)
    python = Path(named) if named else ROOT / ENVIRONMENTS.get(release, f".venv-vllm-{release}") / "bin" / "python"
    if not python.exists():
        raise BenchError(
            f"{connector.vllm_class} of vLLM {release} runs in another environment, and {python} does not exist: "
            f"`bash scripts/setup` makes it, or name one with {variable}"
        )
    return str(python)
