"""What differs between the vLLM releases kvflow's connector supports: 0.32, 0.33 and 0.34.

Why one module: kvflow reads what vLLM hands a connector, and each release changes a little of
it.  The rest of the connector reads as one release; each difference is absorbed here, by asking
the installed vLLM what it has where that is possible, named with the release that brought it:

- 0.33: sleep mode's hooks (`unregister_kv_caches` / `restore_kv_caches`).  Before them sleep
  mode frees the KV memory under the transport's registration, so kvflow refuses it.
- 0.34: `kv_cache_access`, how the workers reach the KV cache, which decides whether vLLM
  allocates a GPU cache as its extensible (driver-mapped) cache and how (`cache_access`;
  exportable as file descriptors only there, `check_gpu_export`);
  `may_load_async` for ``--max-num-inflight-kv-loads`` (answered by the scheduler's book);
  `supports_lookahead_block_hashes`; a request's ``skip_reading_external_kv`` in place of
  ``get_skip_reading_prefix_cache()``; and a shortened prompt must drop the block hashes of the
  blocks it no longer fills (`Request.truncate_block_hashes`; 0.32 and 0.33 have no such call,
  and kvflow drops them itself there: a hash left over would let P's prefix cache file the block
  under tokens it does not hold).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvflow.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = (
    "SLEEP_MODE_UNSUPPORTED",
    "SUPPORTED_VLLM",
    "cache_access",
    "check_gpu_export",
    "check_sleep_mode",
    "check_vllm_version",
    "drop_prompt_tail",
    "skips_external_kv",
)

SUPPORTED_VLLM = ">=0.32,<0.35"
# What a connector sees is the same in all three (factory, KV views and layouts, hook order,
# stats); the differences are listed above.
_SUPPORTED_RELEASES = ((0, 32), (0, 33), (0, 34))
SLEEP_MODE_UNSUPPORTED = (
    "kvflow's connector supports sleep mode from vLLM 0.33 on: vLLM 0.32 frees the KV memory without "
    "telling the connector, under the transport's registration (start the engine without --enable-sleep-mode)"
)


def _release(version: str) -> tuple[int, ...] | None:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release[:2]  # pre-releases and dev builds as their release
    except InvalidVersion:
        return None


def check_vllm_version(version: str) -> None:
    """kvflow reads what vLLM hands a connector (layouts, hook order) as vLLM 0.32, 0.33 and 0.34 do.

    :raises ConfigError: another vLLM release.
    """
    if _release(version) not in _SUPPORTED_RELEASES:
        raise ConfigError(f"kvflow's connector supports vLLM {SUPPORTED_VLLM}, not vLLM {version}")


def check_sleep_mode(vllm_config: VllmConfig, version: str) -> None:
    """Sleep mode frees the KV cache's memory between rollouts.  From vLLM 0.33 on, vLLM tells
    the connector first (`KVFlowConnector.unregister_kv_caches`) and after
    (`restore_kv_caches`); vLLM 0.32 does not, so with it kvflow refuses the combination.

    :raises ConfigError: sleep mode on, with a vLLM before 0.33.
    """
    model = getattr(vllm_config, "model_config", None)
    if model is None or not bool(getattr(model, "enable_sleep_mode", False)):
        return
    release = _release(version)
    if release is None or release < (0, 33):
        raise ConfigError(SLEEP_MODE_UNSUPPORTED)


def check_gpu_export(export: str, version: str) -> None:
    """GPU chunks exported as file descriptors (``gpu_export: "fd"``) are vLLM 0.34's
    extensible cache; before it vLLM allocates nothing exportable so.

    :raises ConfigError: ``fd`` with a vLLM before 0.34.
    """
    release = _release(version)
    if export == "fd" and (release is None or release < (0, 34)):
        raise ConfigError(
            f"kvflow gpu_export 'fd' exports vLLM 0.34's extensible KV cache, which vLLM {version} does not "
            "allocate: use 'legacy-ipc'"
        )


def cache_access(gpu: bool, export: str = "legacy-ipc") -> tuple[str, ...]:
    """The names of vLLM 0.34's `KVCacheAccess` flags that say how kvflow reaches the KV cache.

    GPU memory (`gpu`: vLLM allocates the cache on a CUDA or ROCm device): each rank's NIXL
    agent registers it for RDMA (``REGISTERS``: one physical allocation per segment), and a UCX
    peer on the same host imports it through UCX's cuda_ipc, which shares memory from CUDA's
    allocator by legacy CUDA IPC handles (``LEGACY_IPC``).  That keeps kvflow on the cache it
    is built and tested for: vLLM then allocates the plain cache, not its extensible one, whose
    driver-mapped per-layer storages kvflow has never moved, and refuses
    ``--enable-extensible-kv-cache`` at start-up.  Host memory: any allocation serves (NIXL
    registers host pages wherever they lie, and the engine process maps them by remapping them
    in place), so nothing is asked of vLLM's allocation (``IN_PROCESS``, no flag).

    With `export` ``fd`` (the ``gpu_export`` setting) a GPU cache is vLLM's extensible one,
    its chunks exported as file descriptors to the engine process (``EXPORTS_FD``), still one
    physical allocation per segment for NIXL (``REGISTERS``).  Without an IMEX channel its
    memory cannot travel between same-host UCX peers by cuda_ipc, which legacy handles can.
    """
    if not gpu:
        return ()
    return ("REGISTERS", "EXPORTS_FD") if export == "fd" else ("REGISTERS", "LEGACY_IPC")


def skips_external_kv(request: Any) -> bool:
    """Whether vLLM loads no external KV for `request` (prompt logprobs, or a client that asked
    not to read cached KV): D then computes the prompt past its local hit itself."""
    skips = getattr(request, "skip_reading_external_kv", None)  # vLLM 0.34
    if skips is None:
        skips = request.get_skip_reading_prefix_cache()  # vLLM 0.32 and 0.33
    return bool(skips)


def drop_prompt_tail(request: Any, tokens: int, hash_block_size: int, lookahead_tokens: int = 0) -> None:
    """Shorten `request`'s prompt by its last `tokens` (which D then computes itself), and drop
    the block hashes of the blocks the shortened request no longer fills: otherwise vLLM's
    prefix cache would file the block its first output token fills under the hash of the
    prompt's tokens.  P generates one token of it."""
    del request.prompt_token_ids[-tokens:]
    del request._all_token_ids[-tokens:]
    request.num_prompt_tokens -= tokens
    request.max_tokens = 1
    truncate = getattr(request, "truncate_block_hashes", None)  # vLLM 0.34
    if truncate is not None:
        truncate(hash_block_size, lookahead_tokens)
    else:
        del request.block_hashes[max(0, request.num_tokens - lookahead_tokens) // hash_block_size :]
