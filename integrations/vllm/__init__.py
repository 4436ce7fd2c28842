"""vLLM integration: `KVFlowConnector`, a push (or pull) KV connector for vLLM.

On vLLM's KV-connector V1 API, for vLLM 0.32.x, 0.33.x and 0.34.x.

vLLM loads it with ``kv_connector_module_path="kvflow.integrations.vllm"`` and
``kv_connector="KVFlowConnector"``.  The connector (which imports vLLM) is loaded on first
access, so `kvflow.integrations.vllm.mapping` stays importable without vLLM.  D also loads
`kvflow.integrations.vllm.logits` (``--logits-processors``) to continue from P's first token.
"""

from __future__ import annotations

from typing import Any

__all__ = ("KVFlowConnector",)


def __getattr__(name: str) -> Any:
    if name == "KVFlowConnector":
        from kvflow.integrations.vllm.connector import KVFlowConnector

        return KVFlowConnector
    raise AttributeError(name)
