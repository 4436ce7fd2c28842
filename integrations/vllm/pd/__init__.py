"""`kvflow bench pd`: an open-loop prefill/decode emulation on vLLM's schedulers, and its report."""
