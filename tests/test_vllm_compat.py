"""The compatibility matrix (docs/vllm-compatibility.md), row by row, against the code.

Each row of the document's table names an outcome; the scenario of the same id below builds
that case with vLLM's own scheduler, KV cache planning and allocation (the stand-in), and
asserts the outcome: the request's KV arrives byte for byte on every rank ("moves"), the engine
refuses to start with the quoted message, or the first transfer fails at once on D with the
quoted field named.
"""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.config import ParallelConfig
from vllm.v1.request import RequestStatus

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.kv_caches import check_supported
from kvflow.integrations.vllm.releases import check_vllm_version
from kvflow_tools.standin import EngineOptions, ModelShape, StandInEngine
from kvflow_tools.standin.build import vllm_config
from tests.vllm_compat_hetero import HND
from tests.vllm_compat_hybrid import GEMMA2
from tests.vllm_compat_mamba import OPTIONS as MAMBA_OPTIONS
from tests.vllm_compat_registry import (
    OUTCOMES,
    RELEASES,
    SCENARIOS,
    STAND_INS,
    areas,
    bound,
    checked_with_faults,
    integrity_probe,
    moves,
    refused_at_handshake,
    releases,
    rows,
    rows_here,
    scenario,
    stand_in_here,
)
from tests.vllm_pairs import BLOCK_SIZE, dispatch, kvflow_engine, make_pair, move_and_check, settle

# ---------------------------------------------------------------- vLLM


def _installed_release(release: str) -> None:
    """The vLLM this process runs is `release`, and kvflow's connector accepts it, its
    pre-releases and dev builds."""
    import vllm

    assert vllm.__version__.startswith(f"{release}."), vllm.__version__
    for version in (vllm.__version__, f"{release}.0", f"{release}.2", f"{release}.1rc1", f"{release}.1.dev7+g1234abc"):
        check_vllm_version(version)


SCENARIOS["vllm-0.34"] = bound(_installed_release, release="0.34")
SCENARIOS["vllm-0.33"] = bound(_installed_release, release="0.33")


@scenario("vllm-0.32")
def _vllm_032(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    # the real 0.32 engines of tests/test_vllm_real_pd.py load the connector; here: the range
    for version in ("0.32.0", "0.32.4", "0.32.1rc2"):
        check_vllm_version(version)


@scenario("vllm-other")
def _vllm_other(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    for version in ("0.31.9", "0.35.0", "0.35.0rc1", "1.0.0", "not-a-version"):
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            check_vllm_version(version)


@scenario("sleep-mode")
def _sleep_mode(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    from kvflow.integrations.vllm.connector import KVFlowConnector
    from kvflow.integrations.vllm.releases import check_sleep_mode

    options = EngineOptions("prefill", "kv_producer", {"transport": "loopback", "port": 0}, num_blocks=64)
    config = vllm_config(options)
    config.model_config.enable_sleep_mode = True  # (vLLM refuses it on a CPU platform before this point)
    assert KVFlowConnector.supports_sleep_mode(config.kv_transfer_config)
    config._verify_kv_transfer_compat()  # vLLM asks the connector (from 0.33 on): accepted
    check_sleep_mode(config, "0.33.0")
    with pytest.raises(ConfigError, match=re.escape(fragment)):  # 0.32 has no sleep hooks: refused
        check_sleep_mode(config, "0.32.0")

    def hooks(*engines: StandInEngine, asleep: bool) -> None:
        for engine in engines:
            for rank in engine.ranks:
                for _ in range(2):  # twice in a row: harmless
                    if asleep:
                        rank.worker.unregister_kv_caches()
                    else:
                        rank.worker.restore_kv_caches()

    def refused(p: StandInEngine, d: StandInEngine, tid: str) -> None:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            p_req, d_req = dispatch(p, d, tid, 2 * BLOCK_SIZE)
            settle((p, d), [p_req, d_req])
        assert d_req.status == RequestStatus.FINISHED_ERROR
        assert "asleep" in caplog.text, caplog.text

    p, d = make_pair()
    try:
        move_and_check(p, d, "before-sleep", 3 * BLOCK_SIZE + 7)
        hooks(p, d, asleep=True)
        assert kvflow_engine(p).peers() == kvflow_engine(d).peers() == []  # Goodbyes: nobody holds our keys
        refused(p, d, "both-asleep")  # D's registration fails at once: its engine is asleep
        hooks(d, asleep=False)
        refused(p, d, "p-asleep")  # D's handshake is refused: P's engine is asleep
        hooks(p, asleep=False)
        d.checked.clear()  # the first request's pages were checked before the sleep
        move_and_check(p, d, "after-wake", 3 * BLOCK_SIZE + 7)
        for engine in (p, d):
            stats = kvflow_engine(engine).stats()
            assert stats["held_blocks"] == stats["live_transfers"] == 0, stats
    finally:
        d.close()
        p.close()


# ---------------------------------------------------------------- layouts


def _in_layout(name: str) -> None:
    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        spec = kvflow_engine(p).layout.spec
        assert p.layout.name == spec.kv_layout == name
        assert spec.arrays_per_layer == (4 if name in ("LHBNC", "BHLNC") else 1)  # 4 KV heads

    moves(f"t-{name}", inspect=inspect, kv_cache_layout=name)  # as a user's VLLM_KV_CACHE_LAYOUT


for _name in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"):
    SCENARIOS[f"layout-{_name}"] = bound(_in_layout, name=_name)


@scenario("layout-default")
def _layout_default(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        assert p.layout.name == "LBNHC"  # FLASH_ATTN declares no preference: vLLM's default order
        assert type(p.connector).get_required_kvcache_layout(p.config) is None

    moves("t-default", inspect=inspect)


@scenario("layout-requested")
def _layout_requested(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        assert p.layout.name == "BHLNC"
        assert type(p.connector).get_required_kvcache_layout(p.config) == "BHLNC"

    moves("t-requested", inspect=inspect, extra={"kv_cache_layout": "BHLNC"})


@scenario("layout-mismatch")
def _layout_mismatch(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    refused_at_handshake(
        fragment, caplog, p_options={"kv_cache_layout": "LBHNC"}, d_options={"kv_cache_layout": "LBNHC"}
    )


@scenario("kernel-blocks")
def _kernel_blocks(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        view = next(iter(p.ranks[0].kv_caches.values()))
        assert view.shape[0] == 2 * p.kv_cache_config.num_blocks  # FlashMLA runs 64-token kernel blocks

    mla = ModelShape(family="deepseek_v3")
    moves("t-kernel", 300, inspect, model=mla, backend="FLASHMLA", block_size=128, num_blocks=16)


# ---------------------------------------------------------------- attention


@scenario("gqa-tp1")
def _gqa_tp1(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        assert kvflow_engine(p).layout.spec.num_kv_heads == 4

    moves("t-gqa", inspect=inspect)


@scenario("gqa-tp2")
def _gqa_tp2(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        assert [kvflow_engine(d, r).layout.spec.num_kv_heads for r in (0, 1)] == [2, 2]
        assert [p.ranks[r].pages.heads for r in (0, 1)] == [range(2), range(2, 4)]  # each rank its own heads

    moves("t-gqa2", inspect=inspect, tensor_parallel=2)


@scenario("mla")
def _mla(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        spec = kvflow_engine(p).layout.spec
        assert (spec.num_kv_heads, spec.head_dim, spec.value_dim, spec.page_bytes) == (1, 576, 0, 576 * 2 * BLOCK_SIZE)

    moves("t-mla", inspect=inspect, model=ModelShape(family="deepseek_v3"), backend="TRITON_MLA")


@scenario("mla-two-modules")
def _mla_two_modules(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        names = [f"model.layers.{layer}.self_attn.{module}.attn" for layer in range(3) for module in range(2)]
        for engine in (p, d):  # in execution order, as vLLM's extract_layer_index numbers them
            assert engine.ranks[0].worker._worker.layer_of == {name: k for k, name in enumerate(names)}

    longcat = ModelShape(family="deepseek_v3", layers=3, attention_modules=2)
    moves("t-longcat", inspect=inspect, model=longcat, backend="TRITON_MLA")


@scenario("mla-tp2")
def _mla_tp2(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        assert p.kv_cache_config.kv_tp_replicas == 2 and [r.pages.heads for r in d.ranks] == [range(1)] * 2  # one cache
        for rank in (0, 1):  # each D rank from the P rank of its index
            assert f"prefill-tp{rank}" in kvflow_engine(d, rank).peers()

    mla = ModelShape(family="deepseek_v3")
    moves("t-mla2", inspect=inspect, model=mla, backend="TRITON_MLA", tensor_parallel=2)


# ---------------------------------------------------------------- dtypes and identity


def _moves_in(model_dtype: str, cache_dtype: str, stored: str, encoding: str, d_cache_dtype: str = "") -> None:
    """P's cache in `cache_dtype`, D's in `d_cache_dtype` (the same when not given): both are
    stored as `stored`, the fingerprint names `encoding`, and the KV moves."""

    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        for engine in (p, d):
            spec = kvflow_engine(engine).layout.spec
            assert (spec.dtype, spec.cache_dtype) == (stored, encoding)

    p_options, d_options = {"cache_dtype": cache_dtype}, {"cache_dtype": d_cache_dtype or cache_dtype}
    model = ModelShape(dtype=model_dtype)
    moves(f"t-{cache_dtype}", inspect=inspect, model=model, p_options=p_options, d_options=d_options)


SCENARIOS["dtype-bf16"] = bound(_moves_in, model_dtype="bfloat16", cache_dtype="auto", stored="bfloat16", encoding="")
SCENARIOS["dtype-fp16"] = bound(_moves_in, model_dtype="float16", cache_dtype="auto", stored="float16", encoding="")
for _dtype, _stored in (("fp8_e4m3", "uint8"), ("fp8_e5m2", "uint8"), ("fp8_inc", "float8_e4m3fn")):
    SCENARIOS[f"dtype-{_dtype}"] = bound(
        _moves_in, model_dtype="bfloat16", cache_dtype=_dtype, stored=_stored, encoding=_dtype
    )
SCENARIOS["dtype-fp8-alias"] = bound(
    _moves_in, model_dtype="bfloat16", cache_dtype="fp8", d_cache_dtype="fp8_e4m3", stored="uint8", encoding="fp8_e4m3"
)
SCENARIOS["dtype-auto-named"] = bound(
    _moves_in, model_dtype="bfloat16", cache_dtype="auto", d_cache_dtype="bfloat16", stored="bfloat16", encoding=""
)


@scenario("fp8-mismatch")
def _fp8_mismatch(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    refused_at_handshake(fragment, caplog, p_options={"cache_dtype": "fp8_e4m3"}, d_options={"cache_dtype": "fp8_e5m2"})


@scenario("model-mismatch")
def _model_mismatch(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    refused_at_handshake(fragment, caplog, p_extra={"model_id": "org/model-a"}, d_extra={"model_id": "org/model-b"})


# ---------------------------------------------------------------- model runners


def _speculative(order: str) -> None:
    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        assert kvflow_engine(p).layout.spec.num_layers == 5  # the draft layer's KV moves too

    moves(f"t-spec-{order}", inspect=inspect, hook_order=order, model=ModelShape(draft_layers=1))


for _order in ("v1", "v2"):
    SCENARIOS[f"runner-{_order}"] = bound(moves, tid=f"t-{_order}", hook_order=_order)
    SCENARIOS[f"speculative-{_order}"] = bound(_speculative, order=_order)


@scenario("full-cudagraph")
def _full_cudagraph(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    moves("t-graph", full_cudagraph=True, hook_order="v2")


@scenario("kv-sharing")
def _kv_sharing(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        assert list(p.ranks[0].kv_caches)[-1] == "model.layers.2.self_attn.attn"  # appended last, as vLLM does
        layer_of = p.ranks[0].worker._worker.layer_of
        assert layer_of == {f"model.layers.{i}.self_attn.attn": k for k, i in enumerate((0, 1, 3, 4))}

    model = ModelShape(layers=5, shared=((2, 1),))
    moves("t-sharing", inspect=inspect, model=model, extra={"push_layer_groups": 2})


@scenario("async-scheduling")
def _async(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        assert p.most_in_flight == d.most_in_flight == 2

    moves("t-async", inspect=inspect, async_scheduling=True, hook_order="v2")


@scenario("lagging-device")
def _lagging(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    def inspect(p: StandInEngine, d: StandInEngine) -> None:
        assert p.ranks[0].device is not None and p.ranks[0].device.launched > 0  # KV written by "kernels"

    moves("t-lag", inspect=inspect, device_lag=0.05, hook_order="v2")


# ---------------------------------------------------------------- parallelism


@scenario("pipeline-parallel", "decode-context-parallel")
def _parallelism(fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    if "pipeline" in fragment:
        parallel = ParallelConfig(pipeline_parallel_size=2)
    else:
        parallel = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        check_supported(SimpleNamespace(parallel_config=parallel), None)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the matrix


def test_every_row_has_a_scenario_and_every_scenario_a_row() -> None:
    table = rows()
    assert len(table) >= 40
    assert sorted(table) == sorted(SCENARIOS)
    assert {outcome for outcome, _ in table.values()} == OUTCOMES
    for row_id, (outcome, fragment) in table.items():
        assert outcome == "moves" or fragment, f"row {row_id} is a refusal that quotes no message"


def test_each_row_says_where_it_holds_and_the_real_engine_rows_are_what_its_tests_run() -> None:
    from tests.vllm_real import REAL_ENGINE_ROWS

    where = releases()
    assert sorted(where) == sorted(rows())
    for row_id, shown in where.items():
        assert shown and shown <= RELEASES, f"row {row_id}: holds on {shown}"
    assert {row_id for row_id, shown in where.items() if "0.32 engine" in shown} == set(REAL_ENGINE_ROWS)
    modules = ("test_vllm_real_pd", "test_vllm_real_hybrid", "test_vllm_real_nixl")
    real_tests = {name for module in modules for name in _tests_of(module)}
    for row_id, tests in REAL_ENGINE_ROWS.items():
        assert tests and set(tests) <= real_tests, f"row {row_id} names tests that do not exist: {tests}"


def _tests_of(module: str) -> set[str]:
    loaded = importlib.import_module(f"tests.{module}")
    return {name for name in dir(loaded) if name.startswith("test_")}


for _module in sorted(Path(__file__).parent.glob("vllm_compat_*.py")):
    importlib.import_module(f"tests.{_module.stem}")  # each registers its area's scenarios


def test_this_vllm_is_a_stand_in_the_matrix_names_and_ci_runs_the_matrix_on_each() -> None:
    assert stand_in_here() in STAND_INS
    script = (Path(__file__).resolve().parents[1] / "scripts" / "test").read_text()
    for venv in (".venv/bin/python -m pytest", ".venv-vllm-033/bin/python -m pytest"):  # 0.34, 0.33
        assert venv in script, f"scripts/test no longer runs the quick tests with {venv}"
    assert "tests/test_vllm_*.py" in script


def test_a_row_this_vllm_does_not_check_is_shown_on_another_stand_in() -> None:
    here = set(rows_here())
    for row_id, shown in releases().items():
        assert row_id in here or shown & (STAND_INS - {stand_in_here()}), f"row {row_id} is checked nowhere"


@pytest.mark.parametrize("row_id", rows_here())
def test_the_row_holds(row_id: str, caplog: pytest.LogCaptureFixture) -> None:
    outcome, fragment = rows()[row_id]
    SCENARIOS[row_id](fragment, caplog)


def integrity_rows() -> list[str]:
    """The layout and attention rows where KV moves, and D's block size a multiple of P's in chunks."""
    every, here = rows(), set(rows_here())
    chosen = [
        row
        for row, area in areas().items()
        if area in ("KV layout", "attention") and every[row][0] == "moves" and row in here
    ]
    return [*sorted(chosen), "chunked-block-multiple"]


@pytest.mark.parametrize("row_id", integrity_rows())
def test_the_integrity_check_catches_a_flipped_byte_and_a_wrong_block_mapping_in_the_row(
    row_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    with integrity_probe() as probed:
        SCENARIOS[row_id](rows()[row_id][1], caplog)
    assert probed, f"row {row_id}'s scenario moved no KV through `moves`: the check was not probed"


def _tp(p_tp: int, d_tp: int, **options: Any) -> dict[str, Any]:
    return {**options, "p_options": {"tensor_parallel": p_tp}, "d_options": {"tensor_parallel": d_tp}}


# Rows of other areas whose WRITEs carry another rank's heads or state shards, with the
# options of their scenarios (which make pairs of their own, not through `moves`).
INTEGRITY_ELSEWHERE: dict[str, tuple[str, dict[str, Any]]] = {
    "hybrid-tp-1-to-2": ("hybrid-tp", _tp(1, 2, model=GEMMA2, num_blocks=256, kv_cache_layout=HND)),
    **{f"mamba-tp-{p}-to-{d}": ("mamba-tp", _tp(p, d, **MAMBA_OPTIONS)) for p, d in ((1, 2), (2, 1), (2, 4))},
}


@pytest.mark.parametrize(("row_id", "options"), list(INTEGRITY_ELSEWHERE.values()), ids=list(INTEGRITY_ELSEWHERE))
def test_the_integrity_check_catches_both_faults_in_rows_of_other_areas(row_id: str, options: dict[str, Any]) -> None:
    assert rows()[row_id][0] == "moves"
    checked_with_faults(f"t-{row_id}", 300, None, dict(options))
