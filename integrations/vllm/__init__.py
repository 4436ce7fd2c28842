"""vLLM integration: a push KV connector on vLLM's KV-connector V1 API (vLLM 0.33.x).

Loaded by vLLM with ``kv_connector_module_path="kvflow.integrations.vllm"``.  The connector
itself is not part of this release yet; the package exists so that the import path is stable.
"""
