"""`kvflow bench pd`: the step-time model, the open-loop workload, the stand-in engine paced by
the model, and a small run of the command writing the results' whole contract."""

from __future__ import annotations

import json
import math
import queue
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.errors import ConfigError
from kvflow_tools.bench.runner import obey, pending_commands
from kvflow_tools.cli import main as cli
from kvflow_tools.pd.workload import LengthDist, arrivals
from kvflow_tools.standin.pacing import Pacer
from kvflow_tools.standin.timing import GPUS, MODELS, Row, StepModel
from tests.vllm_pairs import dispatch, make_pair, settle

QWEN = StepModel.named("Qwen3-32B")

# ---------------------------------------------------------------- the step model


def test_calibration_one_short_request_decodes_in_the_articles_low_load_tpot() -> None:
    assert QWEN.step_ms([Row(1024, 1, decode=True)]) == pytest.approx(5.7, abs=0.01)
    # the weights term is what the bandwidth gives: 65.6 GB / 8 GPUs at 4.8 TB/s x 0.7
    weights_ms = 32.8e9 * 2 / 8 / (4.8e12 * 0.7) * 1e3
    assert QWEN.t_base_ms == pytest.approx(5.7 - weights_ms - 1024 * 262144 / 8 / (4.8e12 * 0.7) * 1e3)
    assert QWEN.model.kv_bytes_per_token == 262_144
    assert QWEN.step_ms([]) == 0.0


@settings(max_examples=50, deadline=None)
@given(
    contexts=st.lists(st.integers(1, 20_000), min_size=1, max_size=40),
    more=st.integers(1, 20_000),
)
def test_a_decode_step_grows_with_the_batch_and_the_context_it_reads(contexts: list[int], more: int) -> None:
    rows = [Row(c, 1, decode=True) for c in contexts]
    base = QWEN.step_ms(rows)
    assert QWEN.step_ms([*rows, Row(more, 1, decode=True)]) > base
    longer = [Row(contexts[0] + more, 1, decode=True), *rows[1:]]
    assert QWEN.step_ms(longer) > base
    # linear in the tokens read: each costs kv_bytes_per_token / TP at BW x eta
    per_token_ms = 262144 / 8 / (4.8e12 * 0.7) * 1e3
    assert QWEN.step_ms(longer) - base == pytest.approx(more * per_token_ms, rel=1e-6)


@settings(max_examples=50, deadline=None)
@given(cached=st.integers(0, 16384), new=st.integers(1, 8192))
def test_prefill_costs_the_flops_of_its_chunk(cached: int, new: int) -> None:
    flops = 2 * 32.8e9 * new + 4 * 64 * (64 * 128) * new * (cached + new / 2)
    assert QWEN.prefill_flops(cached, new) == pytest.approx(flops)
    expected = QWEN.t_base_ms + flops / (8 * 989e12 * 0.4) * 1e3
    assert QWEN.step_ms([Row(cached, new, decode=False)]) == pytest.approx(expected)
    # a mixed step pays both terms and one base
    decode = QWEN.step_ms([Row(1024, 1, decode=True)]) - QWEN.t_base_ms
    assert QWEN.step_ms([Row(cached, new, False), Row(1024, 1, True)]) == pytest.approx(expected + decode)


@pytest.mark.parametrize(
    ("options", "field"),
    [({"tp": 0}, "tp"), ({"eta_mem": 1.5}, "eta_mem"), ({"mfu": 0}, "mfu"), ({"budget_tokens": 0}, "budget_tokens")],
)
def test_a_bad_model_field_is_refused_by_name(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        StepModel.named("Qwen3-32B", **options)


def test_unknown_names_and_negative_rows_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown model"):
        StepModel.named("GPT-5")
    with pytest.raises(ConfigError, match="unknown gpu"):
        StepModel.named("Qwen3-32B", gpu="TPU")
    with pytest.raises(ConfigError, match="negative"):
        QWEN.step_ms([Row(-1, 1, False)])
    with pytest.raises(ConfigError, match="t_base_ms would be negative"):
        StepModel(MODELS["Qwen3-32B"], GPUS["H200"], tp=1)  # 65 GB of weights at 3.4 TB/s: > 5.7 ms


def test_the_model_crosses_the_process_boundary_unchanged() -> None:
    again = StepModel.from_json(json.loads(json.dumps(QWEN.to_json())))
    assert again == QWEN
    with pytest.raises(ConfigError, match="bad description"):
        StepModel.from_json({"gpu": {}})


def test_capacity_is_the_gpus_memory_left_over_the_kv_of_a_token_on_one_gpu() -> None:
    free = 141e9 * 0.9 - 32.8e9 * 2 / 8 - 4e9
    assert QWEN.capacity_blocks(0.9, 4.0, 16) == int(free // (262144 / 8 * 16))


# ---------------------------------------------------------------- the workload


def test_arrivals_are_seeded_poisson_at_the_rate_asked() -> None:
    prompt, output = LengthDist("uniform", 100, 16384), LengthDist("uniform", 64, 512)
    one = arrivals(4.0, 20_000, prompt, output, seed=3)
    assert one == arrivals(4.0, 20_000, prompt, output, seed=3)  # the same list for every system
    assert one != arrivals(4.0, 20_000, prompt, output, seed=4)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(one, one[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 4.0, rel=0.03)
    # exponential gaps: their standard deviation is their mean
    mean = sum(gaps) / len(gaps)
    assert math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) == pytest.approx(mean, rel=0.05)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["uniform", "lognormal"]),
    low=st.integers(1, 4000),
    span=st.integers(0, 12000),
    seed=st.integers(0, 2**16),
)
def test_lengths_stay_within_their_bounds(kind: str, low: int, span: int, seed: int) -> None:
    dist = LengthDist(kind, low, low + span)
    for a in arrivals(2.0, 50, dist, dist, seed):
        assert low <= a.prompt <= low + span and low <= a.output <= low + span


@pytest.mark.parametrize("text", ["uniform:10", "gamma:1:2", "uniform:9:3", "uniform:a:b", "lognormal:1:9:5:0"])
def test_a_bad_length_distribution_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="length distribution"):
        LengthDist.parse(text)


def test_a_bad_rate_is_refused() -> None:
    with pytest.raises(ConfigError, match="qps"):
        arrivals(0.0, 3, LengthDist.parse("fixed:8"), LengthDist.parse("fixed:8"), 1)


# ---------------------------------------------------------------- the engine paced by the model


def test_the_runner_takes_every_waiting_command_before_a_step() -> None:
    commands: queue.Queue[dict[str, Any] | None] = queue.Queue()
    for i in range(3):
        commands.put({"op": "pace", "step_ms": i})
    assert len(pending_commands(commands, wait=False)) == 3  # as vLLM's engine core drains its input queue
    assert pending_commands(commands, wait=False) == []
    assert not obey(None, [{"op": "stop"}])


def test_the_engine_lasts_each_step_as_the_model_says_and_reports_it() -> None:
    model = StepModel.named("Llama-3.1-8B")
    p, d = make_pair(num_blocks=64, max_num_batched_tokens=64)  # a 100-token prompt: two chunks on P
    events: dict[str, list[dict[str, Any]]] = {"P": [], "D": []}
    try:
        for name, engine in (("P", p), ("D", d)):
            engine.pacer = Pacer(model, 64, engine.config.cache_config.block_size)
            engine.emit = lambda _name=name, **event: events[_name].append(event)
        p_req, d_req = dispatch(p, d, "t1", 100)
        settle((p, d), [p_req, d_req])
    finally:
        p.close()
        d.close()
    p_steps = [e for e in events["P"] if e["ev"] == "step"]
    first, second = p_steps[0], p_steps[1]
    assert first["model_ms"] == pytest.approx(model.step_ms([Row(0, 64, False)]), abs=1e-3)
    assert second["model_ms"] == pytest.approx(model.step_ms([Row(64, 36, False)]), abs=1e-3)
    assert first["used"] == 2 and first["total"] == 63 and first["running"] == 1  # 64 tokens: 2 blocks
    d_steps = [e for e in events["D"] if e["ev"] == "step" and e["model_ms"] > 0]
    assert any(e["model_ms"] == pytest.approx(model.step_ms([Row(100, 1, True)]), abs=1e-3) for e in d_steps)

    def at(name: str, kind: str) -> float:
        return float(next(e["t"] for e in events[name] if e["ev"] == kind))

    order = [at("P", "scheduled"), at("P", "computed"), at("D", "recving"), at("D", "first"), at("D", "params")]
    assert order == sorted(order)
    assert at("P", "scheduled") == first["t"]


# ---------------------------------------------------------------- the command


@pytest.mark.system
def test_a_small_run_of_the_command_writes_the_whole_contract(tmp_path: Path) -> None:
    folder = tmp_path / "pd"
    code = cli(
        ["bench", "pd", "--systems", "kvflow,vllm-pull", "--qps", "8", "--requests", "3", "--model", "Llama-3.1-8B",
         "--scale", "32", "--prompt-dist", "uniform:40:200", "--output-dist", "uniform:2:5", "--results", str(folder)]
    )  # fmt: skip
    assert code == 0
    results = json.loads((folder / "results.json").read_text())
    config = results["config"]
    contract = {
        "model": {"name", "layers", "kv_heads", "head_dim", "dtype", "block_size", "kv_bytes_per_token",
                  "emulated_bytes_per_token", "scale"},
        "gpu": {"name", "hbm_gb", "bw_tb_s", "tflops", "tp", "sources"},
        "step_model": {"t_base_ms", "eta_mem", "mfu", "budget_tokens", "sources", "notes"},
        "capacity": {"p_blocks", "d_blocks", "tokens_per_block", "real_tokens"},
        "workload": {"qps", "requests_per_point", "prompt", "output", "seed"},
    }  # fmt: skip
    for key, fields in contract.items():
        assert fields <= set(config[key]), key
    assert {"dist", "min", "max", "mean"} <= set(config["workload"]["prompt"])
    assert config["systems"] == ["kvflow", "vllm-pull"] and config["transport"] in ("nixl-ucx", "shm")
    assert "machine" in config
    import vllm

    assert config["vllm"] == {"kvflow": vllm.__version__, "vllm-pull": vllm.__version__}  # 0.34: this environment's
    assert config["nixl_progress_delay_us"] == 1000  # vLLM's NIXL agents at their best here, not spinning
    from kvflow_tools.pd.report import header_lines

    said = f"vLLM: kvflow {vllm.__version__}, vllm-pull {vllm.__version__}; vLLM's NIXL progress threads sleeping 1000"
    assert any(line.startswith(said) for line in header_lines(results)), header_lines(results)
    assert [c["system"] for c in results["cells"]] == ["kvflow", "vllm-pull"]
    for cell in results["cells"]:
        assert cell["failed"] == 0 and cell["bad_pages"] == 0 and cell["completed"] == cell["requests"] == 3
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            assert set(cell[key]) == {"p50", "p90", "p99", "mean"}
        assert set(cell["ttft_split_ms"]) == {"p_queue", "prefill", "transfer_wait", "d_queue"}
        for key in ("blocks", "blocks_peak", "admission_stall_s", "over_budget_steps", "steps"):
            assert set(cell[key]) == {"p", "d"}, key
        assert cell["steps"]["p"] > 0 and cell["blocks_peak"]["d"] > 0 and cell["duration_s"] > 0
        for row in cell["per_request"]:
            assert set(row) == {"id", "prompt", "output", "arrival_s", "ttft_ms", "tpot_ms", "e2e_ms",
                                "p_queue_ms", "prefill_ms", "transfer_wait_ms", "d_queue_ms",
                                "ttft_from_p_ms"}  # fmt: skip
            assert 40 <= row["prompt"] <= 200 and 2 <= row["output"] <= 5
            parts = [row[k] for k in ("p_queue_ms", "prefill_ms", "transfer_wait_ms", "d_queue_ms")]
            assert min(parts) >= 0 and sum(parts) == pytest.approx(row["ttft_ms"], abs=0.01)
            # the first token from P: P's queue and prefill only, the transfer and D's queue left out
            assert row["ttft_from_p_ms"] == pytest.approx(parts[0] + parts[1], abs=0.01)
            assert row["ttft_from_p_ms"] <= row["ttft_ms"]
    # the same requests for every system
    kv, pull = ([(r["prompt"], r["output"]) for r in c["per_request"]] for c in results["cells"])
    assert kv == pull


def test_the_command_refuses_an_unknown_system_before_starting_anything(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--systems"):
        cli(["bench", "pd", "--systems", "sglang", "--results", str(tmp_path)])


@pytest.mark.parametrize("delay", ["-2", "1000001"])
def test_the_command_refuses_a_bad_nixl_delay_before_starting_anything(tmp_path: Path, delay: str) -> None:
    folder = tmp_path / "pd"
    with pytest.raises(ConfigError, match="nixl_progress_delay_us"):
        cli(["bench", "pd", "--systems", "vllm-pull", "--nixl-progress-delay-us", delay, "--results", str(folder)])
    assert not folder.exists()
