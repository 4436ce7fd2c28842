"""kvflow's settings in vLLM's ``kv_connector_extra_config``, read and checked once.

Why apart from the worker: the scheduler-side connector reads them too (where P's rank 0
binds, the layout to ask vLLM for), and a bad value must be refused at start-up with a message
naming the key, before any engine thread exists.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.params import PeerRef
from kvflow.layout import MAX_SPEC_TEXT
from kvflow.layout.groups import KVGroup
from kvflow.protocol.admission import DEFAULT_NETWORKS, PeerAllowList
from kvflow.runtime.process import SCHEDULING

__all__ = ("KV_CACHE_LAYOUTS", "Settings", "layer_groups", "push_units", "setting_arg")

ENGINE_PLACES = ("auto", "process", "thread")
MAX_IDLE_WAIT = 1.0  # seconds: a request that arrives meanwhile is scheduled at most this late
MAX_IDLE_SLEEP = 300.0  # seconds: what a rank's engine process that died can go unnoticed while D waits
KV_CACHE_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")  # vLLM 0.33's KVCacheLayout


def layer_groups(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """`groups` contiguous layer ranges covering the model, as even as possible."""
    groups = max(1, min(groups, num_layers))
    bounds = [round(i * num_layers / groups) for i in range(groups + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(groups)]


def push_units(
    run_order: Sequence[int], cache_groups: Sequence[KVGroup], segments: int
) -> list[tuple[int, tuple[int, int]]]:
    """The (KV cache group, layer range) parts a push chunk goes out in, one WRITE each, in the
    order the forward completes them: the forward's layers (kvflow layers in execution order,
    `run_order`) cut into `segments` even stretches, each stretch's layers of each group one
    part.  kvflow numbers a group's layers in execution order, so each part is a range."""
    position = {layer: index for index, layer in enumerate(run_order)}
    units: list[tuple[int, int, tuple[int, int]]] = []  # (when complete, group, layers)
    for start, stop in layer_groups(len(run_order), segments):
        for index, group in enumerate(cache_groups):
            mine = [layer for layer in range(*group.layers) if start <= position[layer] < stop]
            if mine:
                units.append((max(position[layer] for layer in mine), index, (mine[0], mine[-1] + 1)))
    units.sort()
    return [(index, layers) for _, index, layers in units]


@dataclass(frozen=True)
class Settings:
    """`kv_connector_extra_config` keys (all optional)."""

    transport: str = "nixl"  # the one transport between vLLM's engines (a host may inject another)
    host: str = "127.0.0.1"  # where this rank's control channel binds
    port: int = 5700  # rank r binds port + r; 0: any free port
    transfer_timeout: float = 60.0
    lease: float = 30.0
    fence_timeout: float = 10.0
    nixl_backends: tuple[str, ...] = ("UCX",)
    push_layer_groups: int = 4  # push: WRITEs per prefill chunk, at most, each posted once its layers are saved
    push_group_bytes: int = 4 << 20  # ... each moving at least this much (0: always push_layer_groups)
    # when P's hooks hand a push chunk's parts over: "layer" (as the forward saves each part's last
    # layer) or "step" (all at once when the forward has been enqueued, each part still waiting for
    # the device event recorded at its last layer: on a GPU the WRITEs start as early)
    push_posting: str = "layer"
    kv_cache_layout: str = ""  # a vLLM KVCacheLayout for kvflow to request; "": the backend's choice
    model_id: str = ""  # the model's identity in the handshake; "": vLLM's model name or path
    # where each rank's engine runs: "process" (its own, so that its Python never runs in the
    # host's interpreter), "thread" (of the worker's process), "auto" (a process when it can serve)
    engine_process: str = "auto"
    # the CPUs each rank's engine process runs on (Linux CPU numbers); empty: the worker's own
    engine_cpus: tuple[int, ...] = ()
    # how Linux schedules each rank's engine process: "batch" (SCHED_BATCH: a wake-up of it
    # never preempts the model runner mid-step; it runs on an idle core at once, else when the
    # running task's slice ends) or "normal" (SCHED_OTHER)
    engine_scheduling: str = "batch"
    # how GPU KV caches reach a rank's engine process, and so how kvflow asks vLLM 0.34 to
    # allocate them: "legacy-ipc" (vLLM's plain cache, legacy CUDA IPC handles; same-host UCX
    # peers keep cuda_ipc) or "fd" (vLLM 0.34's extensible cache, its chunks exported as file
    # descriptors; needs vLLM 0.34)
    gpu_export: str = "legacy-ipc"
    # the engines this one may transfer with (shell-style patterns of engine ids) and the
    # networks of the control addresses it may dial, whatever a request's params name
    allowed_peers: tuple[str, ...] = ("*",)
    allowed_networks: tuple[str, ...] = DEFAULT_NETWORKS
    # the end-to-end check (`kvflow.runtime.integrity`): P seals each WRITE with digests of its KV,
    # D checks what landed before the request decodes (off by default: both sides hash every
    # byte; host memory only, for now); turn it on on both sides
    integrity: bool = False
    integrity_sample: int = 1  # D checks one request in this many, picked by a secret of its own
    # seconds a worker's step that schedules nothing, while transfers are outstanding, may sleep
    # until its engine says something (KV landed, blocks given back) instead of returning at once:
    # vLLM's engine core steps without pause while a request waits for remote KV; 0: no sleep
    idle_wait: float = 0.02
    # seconds vLLM's engine core may sleep, at most, in the scheduler's hook while every request
    # it holds waits for KV, woken at once by kvflow's news or vLLM's input (idle_sleep.py); 0:
    # it steps without pause, as vLLM does
    idle_sleep: float = 30.0

    def allow_list(self, ranks: bool = False) -> PeerAllowList:
        """The allow-list of vLLM engine ids, or (`ranks`) of the kvflow engines of their
        ranks (`ranks.rank_name`).  Never raises: `from_extra` checked both."""
        patterns = tuple(f"{p}-tp[0-9]*" for p in self.allowed_peers) if ranks else self.allowed_peers
        return PeerAllowList(patterns, self.allowed_networks)

    def producer(self, engine_id: str, tp_size: int = 1, dp_rank: int = 0) -> PeerRef | None:
        """This engine as the prefill side names itself to a decode engine it does not know:
        its id, where its rank-0 worker binds (past the ports of the DP ranks before it) and
        its tensor parallelism; None with port 0 (any free port, known only once the worker
        has bound it, in another process)."""
        if not self.port:
            return None
        return PeerRef(engine_id, f"tcp://{self.host}:{self.port + dp_rank * tp_size}", tp_size)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> Settings:
        """:raises ConfigError: an unknown key or a value of the wrong type."""
        extra = dict(extra or {})
        fields = cls.__dataclass_fields__
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ConfigError(f"unknown kvflow settings in kv_connector_extra_config: {unknown}")
        for key, value in extra.items():
            extra[key] = _setting_value(key, value, fields[key].default)
        settings = cls(**extra)
        if settings.engine_process not in ENGINE_PLACES:
            raise ConfigError(
                f"kvflow engine_process must be one of {list(ENGINE_PLACES)}, not {settings.engine_process!r}"
            )
        if settings.push_posting not in ("layer", "step"):
            raise ConfigError(f"kvflow push_posting must be 'layer' or 'step', not {settings.push_posting!r}")
        if settings.engine_scheduling not in SCHEDULING:
            raise ConfigError(
                f"kvflow engine_scheduling must be one of {list(SCHEDULING)}, not {settings.engine_scheduling!r}"
            )
        if settings.gpu_export not in ("legacy-ipc", "fd"):
            raise ConfigError(f"kvflow gpu_export must be 'legacy-ipc' or 'fd', not {settings.gpu_export!r}")
        if settings.transport != "nixl":
            raise ConfigError(f"kvflow transport must be 'nixl', not {settings.transport!r}")
        if settings.host in ("", "*", "0.0.0.0", "::", "[::]"):
            raise ConfigError(
                f"kvflow host must be an address the peer can reach, not the wildcard {settings.host!r}: "
                "it is announced to the peer"
            )
        if not 0 <= settings.port <= 65535:
            raise ConfigError(f"kvflow port must be 0..65535, not {settings.port}")
        for key in ("transfer_timeout", "lease", "fence_timeout", "push_layer_groups"):
            if getattr(settings, key) <= 0:
                raise ConfigError(f"kvflow {key} must be positive, not {getattr(settings, key)!r}")
        if not 0 <= settings.idle_wait <= MAX_IDLE_WAIT:
            raise ConfigError(f"kvflow idle_wait must be 0..{MAX_IDLE_WAIT} seconds, not {settings.idle_wait!r}")
        if not 0 <= settings.idle_sleep <= MAX_IDLE_SLEEP:
            raise ConfigError(f"kvflow idle_sleep must be 0..{MAX_IDLE_SLEEP} seconds, not {settings.idle_sleep!r}")
        if not 0 <= settings.push_group_bytes <= 1 << 40:
            raise ConfigError(f"kvflow push_group_bytes must be 0..2**40, not {settings.push_group_bytes!r}")
        if settings.kv_cache_layout and settings.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ConfigError(
                f"kvflow kv_cache_layout must be one of {list(KV_CACHE_LAYOUTS)} or empty, "
                f"not {settings.kv_cache_layout!r}"
            )
        settings.allow_list(ranks=True)  # raises ConfigError, naming the entry
        if len(settings.model_id) > MAX_SPEC_TEXT:
            raise ConfigError(f"kvflow model_id must be at most {MAX_SPEC_TEXT} characters")
        return settings


def _setting_value(key: str, value: Any, default: Any) -> Any:
    """`value` in the type of the setting's default (JSON gives ints for floats, lists for tuples).

    :raises ConfigError: a value of another type, naming the key.
    """
    if key == "engine_cpus":
        if isinstance(value, list | tuple) and all(type(item) is int and 0 <= item < 65536 for item in value):
            return tuple(value)
        raise ConfigError(f"kvflow {key} must be a list of CPU numbers, not {value!r:.80}")
    if isinstance(default, tuple):
        if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
            return tuple(value)
        raise ConfigError(f"kvflow {key} must be a list of strings, not {value!r}")
    if isinstance(default, float) and type(value) in (int, float):
        return float(value)
    if type(value) is not type(default):
        kind = {int: "an integer", float: "a number", str: "a string"}.get(type(default), type(default).__name__)
        raise ConfigError(f"kvflow {key} must be {kind}, not {value!r}")
    return value


def setting_arg(text: str) -> tuple[str, object]:
    """One `kv_connector_extra_config` entry given on a command line as ``KEY=JSON`` (a bare
    string when the value is not JSON), as argparse's `type`.

    Raises argparse.ArgumentTypeError when there is no ``KEY=``.
    """
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=JSON, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string
