"""Real vLLM servers with kvflow: what a deployment needs that vLLM itself does not load.

Nothing here is imported by the connector (`kvflow.integrations.vllm`): vLLM's processes load
only the connector's modules.
"""

__all__ = ()
