#!/usr/bin/env bash
# The prefill server (P) of a 1P1D pair: `vllm serve` with the kvflow connector as KV producer.
#
# Environment, with defaults: MODEL (Qwen/Qwen2.5-0.5B-Instruct); HOST (127.0.0.1) and PORT (8100)
# for HTTP; ENGINE_ID (prefill-0); KVFLOW_HOST (127.0.0.1), the address kvflow's control channel
# binds and announces to D, and KVFLOW_PORT (5700; tensor-parallel rank r uses KVFLOW_PORT + r);
# KVFLOW_SECRET or KVFLOW_SECRET_FILE, the same on P and D (required).
# Further arguments go to `vllm serve`, e.g. --tensor-parallel-size 2.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8100}
ENGINE_ID=${ENGINE_ID:-prefill-0}
KVFLOW_HOST=${KVFLOW_HOST:-127.0.0.1}
KVFLOW_PORT=${KVFLOW_PORT:-5700}

if [[ -z ${KVFLOW_SECRET:-} && -z ${KVFLOW_SECRET_FILE:-} ]]; then
    echo "$0: set KVFLOW_SECRET (16 bytes or more) or KVFLOW_SECRET_FILE, the same on P and D" >&2
    exit 2
fi
if [[ -n ${KVFLOW_SECRET:-} && -n ${KVFLOW_SECRET_FILE:-} ]]; then
    echo "$0: set KVFLOW_SECRET or KVFLOW_SECRET_FILE, not both" >&2
    exit 2
fi

connector='"kv_connector":"KVFlowConnector","kv_connector_module_path":"kvflow.integrations.vllm"'
extra=$(printf '{"host":"%s","port":%d}' "$KVFLOW_HOST" "$KVFLOW_PORT")
config=$(printf '{%s,"kv_role":"kv_producer","engine_id":"%s","kv_connector_extra_config":%s}' \
    "$connector" "$ENGINE_ID" "$extra")

# Prefix caching off on P: kvflow has been tested with it on D only.
exec vllm serve "$MODEL" --host "$HOST" --port "$PORT" --no-enable-prefix-caching \
    --kv-transfer-config "$config" "$@"
