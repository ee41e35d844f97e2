#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite. CPU tests run over gloo; GPU tests skip without 2 GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VENV:-.venv}
exec "$VENV/bin/python" -m pytest -q -ra tests "$@"
