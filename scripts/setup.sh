#!/usr/bin/env bash
# Sets up a virtual environment with torch and builds the extension in place (editable install).
# VENV: where (default .venv). TORCH_SPEC: which torch (default torch==2.14.1, the CUDA 13.0 wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH_SPEC" pybind11 ninja pytest hypothesis numpy
# The venv's ninja must be found by torch's build helper.
PATH="$(cd "$VENV/bin" && pwd):$PATH" "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
  --no-build-isolation -e .
"$VENV/bin/python" -c "import coalesced_bcast._C as C; print('coalesced_bcast built, with_cuda =', C.with_cuda)"
