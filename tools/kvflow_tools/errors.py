"""The tools' exceptions: benchmarks, the router and the launcher of real vLLM servers.

Why not in `kvflow.errors`: the library does not raise these, and the `kvflow` distribution
ships none of the tools.  Each still derives from `KVFlowError`, so a caller (the `kvflow`
command line) that catches `KVFlowError` catches every failure either reports.  At the router's
edge, aiohttp's `ClientError`, or no answer in time, on one of its legs becomes `LegFailed`.
"""

from __future__ import annotations

from kvflow.errors import KVFlowError

__all__ = (
    "BenchError",
    "Diverged",
    "GpuCheckError",
    "GpuChildFailed",
    "GpuPhaseTimeout",
    "LegFailed",
    "NoBackend",
    "RequestRefused",
    "ServerFailed",
)


class BenchError(KVFlowError):
    """A benchmark could not finish: an engine process died, or a request or an op failed or
    did not complete in time."""


class Diverged(KVFlowError):
    """D's stream contradicts the first token the router already sent from P's answer (D drew
    another token), or is not the stream it should be; the client's answer is cut short."""


class GpuCheckError(KVFlowError):
    """The GPU check (`kvflow_tools.gpu`) failed on its own account, not a finding of the check:
    a wheel it carries could not be fetched, stripped or installed, or what it carries is over
    the size that can travel; its subclasses, a child or a phase."""


class GpuChildFailed(GpuCheckError):
    """A child process of the GPU check (P, D or phase A's environment child) exited, could not
    start, or answered a command with an error."""


class GpuPhaseTimeout(GpuCheckError):
    """A phase of the GPU check reached its deadline waiting for a child's reply."""


class LegFailed(KVFlowError):
    """The router's prefill or decode leg (`leg`) got no answer, or an HTTP error, from its server."""

    def __init__(self, leg: str, reason: str) -> None:
        self.leg = leg
        super().__init__(f"{leg} leg failed: {reason}")


class RequestRefused(KVFlowError):
    """The router refused a client's request at one of its limits (`limit`: the option that
    sets it) before the request was dispatched; `status` is the HTTP status the client gets."""

    def __init__(self, status: int, limit: str, message: str) -> None:
        self.status = status
        self.limit = limit
        super().__init__(message)


class NoBackend(KVFlowError):
    """The router has no healthy backend for `role` (prefill or decode)."""

    def __init__(self, role: str, message: str) -> None:
        self.role = role
        super().__init__(message)


class ServerFailed(KVFlowError):
    """A process that kvflow's launcher started (a vLLM server, the router) exited, or did not
    become healthy by its deadline."""
