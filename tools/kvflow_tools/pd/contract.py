"""The contract of `kvflow bench pd`'s results document, and the statistics both sides compute.

Why its own module: the emulation writes the document and the report reads it (maybe much later,
from a file, with `kvflow bench pd-report`); both hold to `SCHEMA`, and both compute percentiles
with `percentiles`, so a figure means the same thing on either side.  `validate` and `load`
refuse a document that lacks a key or holds the wrong kind of value there, naming the key
(``cells[2].ttft_ms.p90``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvflow.errors import ConfigError
from kvflow.runtime.meter import quantile

__all__ = (
    "BASELINES",
    "KNOWN_SYSTEMS",
    "OURS",
    "RESULTS_FILE",
    "SCHEMA",
    "SPLIT_PARTS",
    "cell",
    "load",
    "percentiles",
    "qps_points",
    "scale_text",
    "systems",
    "validate",
)

RESULTS_FILE = "results.json"
KNOWN_SYSTEMS = (
    "kvflow",
    "kvflow-pull",
    "vllm-pull",
    "vllm-push",
    "vllm-push-0.33",
)  # the order tables and legends use
OURS = "kvflow"
BASELINES = ("vllm-pull", "vllm-push", "vllm-push-0.33")
SPLIT_PARTS = ("p_queue", "prefill", "transfer_wait", "d_queue")

# Leaves: "str", "int", "num" (int or float), "num?" (a number or null: a statistic of no
# sample), "nums" (a list of numbers), "strs", "series" (a list of [t_s, value] pairs);
# a dict is an object with at least these keys, a one-element list a list of such items.
_STATS = {"p50": "num?", "p90": "num?", "p99": "num?", "mean": "num?"}
_PD_INT = {"p": "int", "d": "int"}
_DIST = {"dist": "str", "min": "num", "max": "num", "mean": "num"}
SCHEMA: dict[str, Any] = {
    "config": {
        "model": {
            "name": "str",
            "layers": "int",
            "kv_heads": "int",
            "head_dim": "int",
            "dtype": "str",
            "block_size": "int",
            "kv_bytes_per_token": "num",
            "emulated_bytes_per_token": "num",
            "scale": "num",  # a real GPU's KV bytes per token over the emulation's
        },
        "gpu": {"name": "str", "hbm_gb": "num", "bw_tb_s": "num", "tflops": "num", "tp": "int", "sources": "strs"},
        "step_model": {
            "t_base_ms": "num",
            "eta_mem": "num",
            "mfu": "num",
            "budget_tokens": "int",
            "sources": "strs",
            "notes": "str",
        },
        "capacity": {"p_blocks": "int", "d_blocks": "int", "tokens_per_block": "int", "real_tokens": "int"},
        "workload": {"qps": "nums", "requests_per_point": "int", "prompt": _DIST, "output": _DIST, "seed": "int"},
        "systems": "strs",
        "transport": "str",
        "machine": "str",
    },
    "cells": [
        {
            "system": "str",
            "qps": "num",
            "requests": "int",
            "completed": "int",
            "failed": "int",
            "bad_pages": "int",
            "duration_s": "num",
            "ttft_ms": _STATS,
            "ttft_from_p_ms": _STATS,
            "tpot_ms": _STATS,
            "e2e_ms": _STATS,
            "ttft_split_ms": dict.fromkeys(SPLIT_PARTS, "num?"),
            "blocks": {"p": "series", "d": "series"},
            "blocks_peak": _PD_INT,
            "admission_stall_s": {"p": "num", "d": "num"},
            "over_budget_steps": _PD_INT,
            "steps": _PD_INT,
            "per_request": [
                {
                    "id": "str",
                    "prompt": "int",
                    "output": "int",
                    "arrival_s": "num",
                    "ttft_ms": "num?",
                    "tpot_ms": "num?",
                    "e2e_ms": "num?",
                    "p_queue_ms": "num?",
                    "prefill_ms": "num?",
                    "transfer_wait_ms": "num?",
                    "d_queue_ms": "num?",
                    "ttft_from_p_ms": "num?",
                }
            ],
        }
    ],
}


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    """p50, p90, p99 (`kvflow.runtime.meter.quantile`, the one every figure uses) and mean.

    No sample gives ``None`` for each (JSON null, shown as "—"), never NaN, which JSON cannot hold.

    :raises ConfigError: a value is not a finite number.
    """
    ordered = sorted(float(v) for v in values)
    if not ordered:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = (quantile(ordered, q) for q in (0.5, 0.9, 0.99))
    return {"p50": p50, "p90": p90, "p99": p99, "mean": math.fsum(ordered) / len(ordered)}


def validate(results: object) -> dict[str, Any]:
    """`results` itself, once it holds every key of `SCHEMA` with the right kind of value.

    Keys beyond the schema are allowed (a newer driver may add figures).

    :raises ConfigError: a key is missing or holds the wrong kind of value; the message names it.
    """
    _check(results, SCHEMA, "")
    assert isinstance(results, dict)  # _check refused anything else
    if not results["cells"]:
        raise ConfigError("results: cells is empty: no figure to show")
    seen: dict[tuple[str, float], int] = {}
    for i, c in enumerate(results["cells"]):
        first = seen.setdefault((c["system"], float(c["qps"])), i)
        if first != i:
            raise ConfigError(f"results: cells[{i}] repeats cells[{first}]: {c['system']} at QPS {c['qps']:g}")
    return results


def load(path: str | Path) -> dict[str, Any]:
    """The results `write` (or the emulation) wrote: a results.json, or the folder holding it.

    :raises ConfigError: no such file, not JSON, or a key of the contract missing or wrong (named).
    """
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read results {path}: {error.strerror or error}") from error
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not JSON: {error}") from error
    try:
        return validate(document)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


def systems(results: Mapping[str, Any]) -> list[str]:
    """Every system of the results: the known ones in `KNOWN_SYSTEMS`' order, then the others as met."""
    met = [*results["config"]["systems"], *(c["system"] for c in results["cells"])]
    known = [s for s in KNOWN_SYSTEMS if s in met]
    return known + [s for s in dict.fromkeys(met) if s not in KNOWN_SYSTEMS]


def qps_points(results: Mapping[str, Any]) -> list[float]:
    """The QPS points that have at least one cell, ascending."""
    return sorted({float(c["qps"]) for c in results["cells"]})


def cell(results: Mapping[str, Any], system: str, qps: float) -> dict[str, Any] | None:
    """The cell of `system` at `qps`, or None if the run has none."""
    return next((c for c in results["cells"] if c["system"] == system and float(c["qps"]) == qps), None)


def scale_text(scale: float) -> str:
    """The model's ``scale`` (a real GPU's KV bytes per token over the emulation's) as a division."""
    return f"÷{scale:g}"


def _check(value: object, spec: object, path: str) -> None:
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"results: {path or 'the document'} must be an object, got {type(value).__name__}")
        for key, inner in spec.items():
            where = f"{path}.{key}" if path else key
            if key not in value:
                raise ConfigError(f"results: missing key {where}")
            _check(value[key], inner, where)
    elif isinstance(spec, list):
        if not isinstance(value, list):
            raise ConfigError(f"results: {path} must be a list, got {type(value).__name__}")
        for i, item in enumerate(value):
            _check(item, spec[0], f"{path}[{i}]")
    elif not _leaf_ok(value, str(spec)):
        raise ConfigError(f"results: {path} must be {_LEAVES[str(spec)]}, got {value!r:.60}")


_LEAVES = {
    "str": "a string",
    "int": "an integer",
    "num": "a finite number",
    "num?": "a finite number or null",
    "nums": "a list of finite numbers",
    "strs": "a list of strings",
    "series": "a list of [t_s, value] pairs",
}


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _leaf_ok(value: object, kind: str) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "num":
        return _number(value)
    if kind == "num?":
        return value is None or _number(value)
    if kind == "nums":
        return isinstance(value, list) and all(_number(v) for v in value)
    if kind == "strs":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "series":
        return isinstance(value, list) and all(_pair(v) for v in value)
    raise AssertionError(f"unknown schema leaf {kind}")


def _pair(value: object) -> bool:
    return isinstance(value, list | tuple) and len(value) == 2 and all(_number(v) for v in value)
