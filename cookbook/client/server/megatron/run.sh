#!/usr/bin/env bash
# Start the Twinkle server from server_config.yaml (Megatron back-end: pip install 'twinkle-model[megatron]');
# arguments are `twinkle server` flags, e.g. `bash run.sh --port 8001 --state-dir /tmp/twinkle-server`.
# PYTHON picks the interpreter.
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/server.py" "$@"
