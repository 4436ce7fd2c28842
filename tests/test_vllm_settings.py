"""Unit tests of the vLLM connector's settings (``kv_connector_extra_config``) and layer groups.

Why here: a bad setting must stop vLLM at start-up with an error naming the key, never fail later
inside a worker, and layer groups decide which WRITEs D expects, so P and D must compute the same.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.kv_caches import describe_kv_caches, layer_position
from kvflow.integrations.vllm.settings import KV_CACHE_LAYOUTS, Settings, layer_groups


def test_settings_default_without_extra_config() -> None:
    assert Settings.from_extra(None) == Settings() == Settings.from_extra({})


def test_settings_read_known_keys() -> None:
    settings = Settings.from_extra(
        {"transport": "nixl", "port": 0, "push_layer_groups": 2, "nixl_backends": ["UCX", "GDS"]}
    )
    assert settings.transport == "nixl" and settings.port == 0 and settings.push_layer_groups == 2
    assert settings.nixl_backends == ("UCX", "GDS")


def test_settings_refuse_unknown_keys_by_name() -> None:
    with pytest.raises(ConfigError, match=r"\['bogus', 'prot'\]"):
        Settings.from_extra({"prot": 5700, "bogus": 1, "port": 1})


@pytest.mark.parametrize("value", [0, -1, "4", 2.0, True, None])
def test_settings_refuse_a_bad_push_layer_groups(value: Any) -> None:
    with pytest.raises(ConfigError, match="push_layer_groups"):
        Settings.from_extra({"push_layer_groups": value})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("port", "5700"),
        ("port", 5700.0),
        ("port", True),
        ("port", 70000),
        ("port", -1),
        ("host", 127),
        ("host", "0.0.0.0"),  # announced to the peer: a wildcard is no address
        ("host", "*"),
        ("host", ""),
        ("transfer_timeout", "60"),
        ("transfer_timeout", 0),
        ("lease", None),
        ("lease", -1.0),
        ("fence_timeout", True),
        ("fence_timeout", 0.0),
        ("nixl_backends", "UCX"),  # not a list: never read as ("U", "C", "X")
        ("nixl_backends", 5),
        ("nixl_backends", ["UCX", 1]),
        ("fabric", "default"),  # the stand-in's key, not the connector's
        ("transport", None),
        ("transport", "loopback"),  # a host injects another transport; it is not a setting
        ("engine_process", "yes"),
        ("engine_process", True),
        ("engine_cpus", [0, "1"]),
        ("engine_cpus", [-1]),
        ("engine_cpus", 3),
        ("engine_scheduling", "fifo"),  # a real-time policy could starve the host: not offered
        ("engine_scheduling", 1),
        ("push_posting", "forward"),
        ("gpu_export", "fabric"),
        ("gpu_export", 1),
        ("push_group_bytes", -1),
        ("push_group_bytes", 1.5),
        ("push_group_bytes", 1 << 41),
    ],
)
def test_settings_refuse_a_bad_value_naming_its_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=key):
        Settings.from_extra({key: value})


def test_settings_read_where_the_engine_runs() -> None:
    settings = Settings.from_extra(
        {"engine_process": "thread", "engine_cpus": [2, 3], "push_group_bytes": 0, "engine_scheduling": "normal"}
    )
    assert (settings.engine_process, settings.engine_cpus, settings.push_group_bytes) == ("thread", (2, 3), 0)
    assert settings.engine_scheduling == "normal"
    assert (Settings().engine_process, Settings().engine_scheduling) == ("auto", "batch")
    assert (Settings().gpu_export, Settings.from_extra({"gpu_export": "fd"}).gpu_export) == ("legacy-ipc", "fd")


def test_settings_take_json_integers_for_seconds() -> None:
    settings = Settings.from_extra({"transfer_timeout": 5, "lease": 2, "fence_timeout": 1.5})
    assert (settings.transfer_timeout, settings.lease, settings.fence_timeout) == (5.0, 2.0, 1.5)
    assert isinstance(settings.transfer_timeout, float)


@pytest.mark.parametrize("value", ["tcp", "NIXL", ""])
def test_settings_refuse_an_unknown_transport(value: str) -> None:
    with pytest.raises(ConfigError, match="transport"):
        Settings.from_extra({"transport": value})


@given(num_layers=st.integers(1, 200), requested=st.integers(1, 300))
def test_layer_groups_partition_the_layers_in_order(num_layers: int, requested: int) -> None:
    groups = layer_groups(num_layers, requested)
    assert len(groups) == min(requested, num_layers)
    assert groups[0][0] == 0 and groups[-1][1] == num_layers
    assert all(start < stop for start, stop in groups), "an empty layer group"
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:], strict=False)), "a gap or an overlap"
    sizes = [stop - start for start, stop in groups]
    assert max(sizes) - min(sizes) <= 1, f"uneven groups {sizes}"


@pytest.mark.parametrize("requested", [0, -3])
def test_layer_groups_of_a_non_positive_count_is_one_group(requested: int) -> None:
    assert layer_groups(12, requested) == [(0, 12)]


def test_the_layouts_kvflow_may_request_are_vllms() -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert sorted(KV_CACHE_LAYOUTS) == sorted(layout.name for layout in KVCacheLayout)
    assert Settings.from_extra({"kv_cache_layout": "BHLNC"}).kv_cache_layout == "BHLNC"
    for bad in ("HND", "lbhnc", "NHD"):
        with pytest.raises(ConfigError, match="kv_cache_layout"):
            Settings.from_extra({"kv_cache_layout": bad})
    with pytest.raises(ConfigError, match="model_id"):
        Settings.from_extra({"model_id": "m" * 300})


@pytest.mark.parametrize(
    ("name", "index"),
    [
        ("model.layers.7.self_attn.attn", (7, 0)),
        ("model.decoder.layers.0.self_attn.attn", (0, 0)),
        ("layers.61.mtp.attn", (61, 0)),
        ("model.layers.3.self_attn.1.attn", (3, 1)),  # LongCat-Flash: two attention modules a layer
    ],
)
def test_a_layer_is_known_by_the_indices_in_its_name(name: str, index: tuple[int, int]) -> None:
    assert layer_position(name) == index


@pytest.mark.parametrize("name", ["lm_head.attn", "model.layers.1.experts.3.attn.2", "model.layers.x.attn", "model.²"])
def test_a_layer_name_without_one_or_two_indices_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="which layer"):
        layer_position(name)


def test_views_that_are_not_what_vllms_config_says_are_refused() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    page = spec.page_size_bytes
    tensors = [KVCacheTensor(size=page * 4, layers=[name], layer_stride=0, block_stride=page) for name in names]
    config = KVCacheConfig(num_blocks=4, kv_cache_tensors=tensors, kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    good = torch.zeros(4, 2, 16, 16, dtype=torch.float16)

    def describe(views: dict[str, torch.Tensor]) -> None:
        describe_kv_caches(views, config, model="m", cache_dtype="auto", layout_name=None)

    describe({names[0]: good, names[1]: torch.zeros_like(good)})
    with pytest.raises(ConfigError, match="share one KV cache"):
        describe({names[0]: good, names[1]: good})
    with pytest.raises(ConfigError, match="vLLM's spec says 1024 bytes"):
        describe({names[0]: good, names[1]: torch.zeros(4, 2, 16, 8, dtype=torch.float16)})
    with pytest.raises(ConfigError, match="multiple of 4 blocks"):
        describe({names[0]: good, names[1]: torch.zeros(3, 2, 16, 16, dtype=torch.float16)})
    with pytest.raises(ConfigError, match="no KV caches"):
        describe({"model.layers.9.attn": good})


def test_layers_are_numbered_by_the_index_in_their_names_not_by_dict_order() -> None:
    """vLLM builds its kv_caches dict tensor by tensor (KV-sharing layers appended last), so its
    order need not be execution order; kvflow's layer numbers, and so its layer groups, follow
    the names."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    names = [f"model.layers.{i}.attn" for i in (2, 0, 10, 1)]
    page = spec.page_size_bytes
    tensors = [KVCacheTensor(size=page * 4, layers=[name], layer_stride=0, block_stride=page) for name in names]
    config = KVCacheConfig(num_blocks=4, kv_cache_tensors=tensors, kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    views = {name: torch.zeros(4, 2, 16, 16, dtype=torch.float16) for name in names}
    caches = describe_kv_caches(views, config, model="m", cache_dtype="auto", layout_name=None)
    assert caches.layer_of == {"model.layers.0.attn": 0, "model.layers.1.attn": 1, "model.layers.2.attn": 2,
                               "model.layers.10.attn": 3}  # fmt: skip
    starts = [caches.layout.regions[caches.layout.layer_arrays(k)[0].region].base for k in range(4)]
    assert starts == [int(views[f"model.layers.{i}.attn"].data_ptr()) for i in (0, 1, 2, 10)]
