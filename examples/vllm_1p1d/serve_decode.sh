#!/usr/bin/env bash
# The decode server (D) of a 1P1D pair: `vllm serve` with the kvflow connector as KV consumer.
#
# Environment, with defaults: MODEL (Qwen/Qwen2.5-0.5B-Instruct); HOST (127.0.0.1) and PORT (8200)
# for HTTP; ENGINE_ID (decode-0); KVFLOW_HOST (127.0.0.1), the address kvflow's control channel
# binds and announces to P, and KVFLOW_PORT (5800; tensor-parallel rank r uses KVFLOW_PORT + r);
# KVFLOW_SECRET or KVFLOW_SECRET_FILE, the same on P and D (required); KV_LOAD_FAILURE_POLICY
# (vLLM's own default, "fail"; "recompute" prefills locally when the KV does not arrive).
# Further arguments go to `vllm serve`, e.g. --tensor-parallel-size 2.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8200}
ENGINE_ID=${ENGINE_ID:-decode-0}
KVFLOW_HOST=${KVFLOW_HOST:-127.0.0.1}
KVFLOW_PORT=${KVFLOW_PORT:-5800}
KV_LOAD_FAILURE_POLICY=${KV_LOAD_FAILURE_POLICY:-fail}

if [[ -z ${KVFLOW_SECRET:-} && -z ${KVFLOW_SECRET_FILE:-} ]]; then
    echo "$0: set KVFLOW_SECRET (16 bytes or more) or KVFLOW_SECRET_FILE, the same on P and D" >&2
    exit 2
fi
if [[ -n ${KVFLOW_SECRET:-} && -n ${KVFLOW_SECRET_FILE:-} ]]; then
    echo "$0: set KVFLOW_SECRET or KVFLOW_SECRET_FILE, not both" >&2
    exit 2
fi
if [[ $KV_LOAD_FAILURE_POLICY != fail && $KV_LOAD_FAILURE_POLICY != recompute ]]; then
    echo "$0: KV_LOAD_FAILURE_POLICY must be fail or recompute" >&2
    exit 2
fi

connector='"kv_connector":"KVFlowConnector","kv_connector_module_path":"kvflow.integrations.vllm"'
extra=$(printf '{"host":"%s","port":%d}' "$KVFLOW_HOST" "$KVFLOW_PORT")
config=$(printf '{%s,"kv_role":"kv_consumer","engine_id":"%s","kv_load_failure_policy":"%s","kv_connector_extra_config":%s}' \
    "$connector" "$ENGINE_ID" "$KV_LOAD_FAILURE_POLICY" "$extra")

# Prefix caching on (vLLM's default): D receives only the blocks after a request's local hit.
exec vllm serve "$MODEL" --host "$HOST" --port "$PORT" \
    --kv-transfer-config "$config" "$@"
