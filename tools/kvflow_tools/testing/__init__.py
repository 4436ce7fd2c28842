"""Helpers for tests and simulations, public so embedders can test their own integration.

`pair`: `EnginePair` joins a P and a D engine over loopback with real KV buffers, `ManualClock`
drives time by hand.  `peer_process` runs one engine in a child process driven by JSON lines
(used by the cross-process tests and usable from any language).  `fuzz` and `fuzz_process`
attack a live control plane, for the attack tests and soak runs, and `many_names` is an insider
speaking as many engines; `router_fuzz` the router's
process, `params_fuzz` and `params_soak` the connector with hostile ``kv_transfer_params``.
"""

from __future__ import annotations

from kvflow_tools.testing.pair import SMALL_SPEC, EnginePair, KVBuffers, ManualClock, same_kv

__all__ = ("SMALL_SPEC", "EnginePair", "KVBuffers", "ManualClock", "same_kv")
