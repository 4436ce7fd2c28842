"""Scenarios of the compatibility matrix for what vLLM 0.34 adds for a connector: how it reaches
the KV cache (`kv-cache-access`) and the loads it may start while the batch is full
(`inflight-kv-loads`).

Why apart: these rows hold on vLLM 0.34 only (the matrix runs them where it is installed), and
their scenarios ask vLLM's own config resolution and scheduler, not only the stand-in's pair.
0.34's names are imported inside the scenarios, so that this module imports on 0.33 too.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvflow_tools.standin import EngineOptions
from kvflow_tools.standin.build import vllm_config
from tests.vllm_compat_registry import scenario
from tests.vllm_pairs import BLOCK_SIZE, dispatch, is_finished, make_pair, move_and_check, params, run, settle


@contextlib.contextmanager
def _gpu_host(imex: bool, rocm: bool = False) -> Iterator[None]:
    """vLLM's current platform reports a CUDA (or ROCm) device, with or without an IMEX channel
    (which FABRIC handles to driver-mapped memory need)."""
    import vllm.utils.vmm_driver as vmm
    from vllm.platforms import current_platform

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(current_platform, "is_cuda_alike", lambda: True)
        patch.setattr(current_platform, "is_rocm", lambda: rocm)
        patch.setattr(vmm, "imex_channel_available", lambda: imex)
        yield


def _extensible(
    connector: str,
    module_path: str | None,
    imex: bool,
    rocm: bool = False,
    asked: bool | None = None,
    export: str = "legacy-ipc",
) -> Any:
    """Whether vLLM 0.34's own resolution (`VllmConfig._resolve_extensible_kv_cache`) gives an
    engine with this connector (kvflow's with its ``gpu_export`` setting `export`) its extensible
    KV cache on a GPU host: True, False, or the error it raises when `asked` for one it cannot have."""
    role = "kv_consumer"
    extra = {"transport": "loopback", "port": 0, "gpu_export": export}
    options = EngineOptions("decode", role, extra, connector, module_path)
    config = vllm_config(options)
    cache = config.cache_config
    cache.num_gpu_blocks_override = None  # the stand-in's fixed size would rule the extensible cache out
    cache._extensible_kv_cache_resolved, cache.enable_extensible_kv_cache = False, asked
    with _gpu_host(imex, rocm):
        try:
            config._resolve_extensible_kv_cache()
        except ValueError as exc:
            return exc
    return cache.enable_extensible_kv_cache


@scenario("kv-cache-access")
def _kv_cache_access(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    from vllm.config.kv_transfer import KVCacheAccess, KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    transfer = KVTransferConfig(
        kv_connector="KVFlowConnector", kv_connector_module_path="kvflow.integrations.vllm", kv_role="kv_consumer"
    )
    host_memory = KVConnectorFactory.kv_cache_access(transfer)
    with _gpu_host(imex=False):
        gpu_memory = KVConnectorFactory.kv_cache_access(transfer)  # vLLM asks the class it loads
    assert host_memory == KVCacheAccess.IN_PROCESS
    assert gpu_memory == KVCacheAccess.REGISTERS | KVCacheAccess.LEGACY_IPC
    assert fragment == "REGISTERS" and KVCacheAccess[fragment] in gpu_memory  # the row names what is declared
    kvflow = ("KVFlowConnector", "kvflow.integrations.vllm")
    for imex in (False, True):
        assert _extensible(*kvflow, imex=imex) is False  # the plain cache, IMEX channel or not
        assert _extensible(*kvflow, imex=imex, rocm=True) is False
        assert _extensible("ExampleConnector", None, imex=imex) is True  # a connector that declares nothing
    assert _extensible("NixlConnector", None, imex=False) is False  # vLLM's own: REGISTERS | EXPORTS_FABRIC
    assert _extensible("NixlConnector", None, imex=True) is True
    refused = _extensible(*kvflow, imex=True, asked=True)  # --enable-extensible-kv-cache
    assert isinstance(refused, ValueError) and re.search("legacy CUDA IPC", str(refused)), refused
    # gpu_export "fd": the extensible cache, its chunks exported as descriptors to the engine process
    exported = KVTransferConfig(
        kv_connector="KVFlowConnector",
        kv_connector_module_path="kvflow.integrations.vllm",
        kv_role="kv_consumer",
        kv_connector_extra_config={"gpu_export": "fd"},
    )
    with _gpu_host(imex=False):
        assert KVConnectorFactory.kv_cache_access(exported) == KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FD
    assert KVConnectorFactory.kv_cache_access(exported) == KVCacheAccess.IN_PROCESS  # host memory: nothing asked
    for imex in (False, True):
        assert _extensible(*kvflow, imex=imex, export="fd") is True
    refused = _extensible(*kvflow, imex=False, asked=False, export="fd")  # --no-enable-extensible-kv-cache
    assert isinstance(refused, ValueError) and re.search("POSIX file descriptors", str(refused)), refused
    p, d = make_pair()
    try:
        move_and_check(p, d, "t-access", 3 * BLOCK_SIZE + 7)
    finally:
        d.close()
        p.close()


def _load_while_batch_full(inflight: int | None) -> tuple[float, float]:
    """D runs one request at a time and is decoding a first P/D request (120 tokens) when a
    second arrives; returns when D reported the second's KV loaded and when the first ended.
    D's pages of both are checked when each runs."""
    d_options: dict[str, Any] = {"max_num_seqs": 1, "max_num_inflight_kv_loads": inflight}
    p, d = make_pair(d_options=d_options)
    seen: dict[tuple[str, str], float] = {}

    def emit(**event: Any) -> None:
        if event.get("ev") in ("recving", "gone"):
            seen.setdefault((event["ev"], event["id"]), event["t"])

    d.emit = emit
    try:
        kv = params(p, d, "t-long")
        long_d = d.add("d-t-long", 2 * BLOCK_SIZE, 120, {"do_remote_prefill": True, "kvflow": kv}, tag="t-long")
        long_p = p.add("p-t-long", 2 * BLOCK_SIZE, 1, {"do_remote_decode": True, "kvflow": kv}, tag="t-long")
        run((p, d), lambda: long_d.status == RequestStatus.RUNNING and len(long_d.output_token_ids) > 2)
        p_req, d_req = dispatch(p, d, "t-inflight", 3 * BLOCK_SIZE + 7)
        settle((p, d), [long_p, long_d, p_req, d_req], limit=60.0)
        assert d.checked == {long_d.request_id: 0, d_req.request_id: 0}, d.checked
        assert is_finished(long_d) and len(long_d.output_token_ids) == 120
        assert d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(d_req.output_token_ids) == 4
        return seen[("recving", d_req.request_id)], seen[("gone", long_d.request_id)]
    finally:
        d.close()
        p.close()


@scenario("inflight-kv-loads")
def _inflight_kv_loads(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    loaded, local_ended = _load_while_batch_full(inflight=2)
    assert loaded < local_ended, "D loaded the request's KV only once its running batch had room"
    loaded, local_ended = _load_while_batch_full(inflight=None)  # vLLM's default: no early loads
    assert loaded > local_ended
