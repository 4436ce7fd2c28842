#!/usr/bin/env bash
# The router in front of serve_prefill.sh and serve_decode.sh, with the same defaults.
#
# Environment, with defaults: PYTHON (the checkout's .venv, where scripts/setup installs the
# router, if it is there; else python3, which must have aiohttp, kvflow and kvflow-tools);
# ROUTER_HOST (127.0.0.1) and ROUTER_PORT (8000); PREFILL_URL (http://127.0.0.1:8100),
# PREFILL_ENGINE (prefill-0), PREFILL_KVFLOW (tcp://127.0.0.1:5700); DECODE_URL
# (http://127.0.0.1:8200), DECODE_ENGINE (decode-0), DECODE_KVFLOW (tcp://127.0.0.1:5800);
# MODE (push, pull, or sequential: P then D with P's answer); TIMEOUT (600 s, the bound on any one wait).
# Further arguments go to the router (python -m kvflow_tools.routing.router --help).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    [[ -x $ROOT/.venv/bin/python ]] && PYTHON=$ROOT/.venv/bin/python
fi

exec "$PYTHON" -m kvflow_tools.routing.router \
    --host "${ROUTER_HOST:-127.0.0.1}" --port "${ROUTER_PORT:-8000}" \
    --prefill "${PREFILL_URL:-http://127.0.0.1:8100}" \
    --prefill-engine "${PREFILL_ENGINE:-prefill-0}" \
    --prefill-kvflow "${PREFILL_KVFLOW:-tcp://127.0.0.1:5700}" \
    --decode "${DECODE_URL:-http://127.0.0.1:8200}" \
    --decode-engine "${DECODE_ENGINE:-decode-0}" \
    --decode-kvflow "${DECODE_KVFLOW:-tcp://127.0.0.1:5800}" \
    --mode "${MODE:-push}" --timeout "${TIMEOUT:-600}" "$@"
