"""The locally written model directory: Hugging Face's own loaders take it whole, its greedy
output is fixed by its seed, and the same model writes the same bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvflow.errors import ConfigError
from kvflow_tools.serve.tiny_model import TinyModel, write_model
from tests.hf_reference import greedy

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def test_the_directory_loads_whole_and_its_seed_fixes_the_output(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first = write_model(tmp_path / "a")
    assert sorted(p.name for p in first.iterdir()) == sorted(FILES)
    loaded: Any = AutoModelForCausalLM.from_pretrained(first, output_loading_info=True)
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.num_hidden_layers == 2 and model.config.num_key_value_heads == 2
    tokenizer = AutoTokenizer.from_pretrained(first)
    assert tokenizer("<5> <17> <1023>")["input_ids"] == [5, 17, 1023]
    assert tokenizer.decode([5, 17]) == "<5> <17>"
    prompt = [3, 141, 59, 265, 358, 979]
    tokens = greedy(first, prompt, 8)
    assert len(tokens) == 8 and len(set(tokens)) > 1  # not one repeated token, as dummy weights give
    assert greedy(first, [7, 7, 7], 8) != tokens  # the output depends on the prompt
    # another directory, the same model: the same bytes; another seed: other weights
    second = write_model(tmp_path / "b")
    for name in FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other = write_model(tmp_path / "c", TinyModel(seed=1))
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    assert greedy(second, prompt, 8) == tokens


def test_bad_geometry_and_a_file_in_the_way_are_refused(tmp_path: Path) -> None:
    for bad in ({"num_layers": 0}, {"num_heads": 3}, {"num_kv_heads": 3}, {"seed": -1}, {"vocab_size": 1.5}):
        with pytest.raises(ConfigError, match="tiny model"):
            TinyModel(**bad)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        write_model(blocker)
    assert blocker.read_text() == "x"
