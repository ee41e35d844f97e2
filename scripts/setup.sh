#!/usr/bin/env bash
# Sets up a virtual environment with torch and builds the extension in place (editable install).
# VENV: where (default .venv). TORCH_SPEC: which torch (default torch==2.14.1, the CUDA 13.0 wheel).
# A second run reuses the build when nothing it depends on changed (csrc/, setup.py, the torch spec,
# the build's environment): it then takes seconds. COALESCED_BCAST_REBUILD=1 forces a build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
STAMP="$VENV/coalesced_bcast.build"
stamp() {  # what the build depends on, hashed
  {
    echo "$TORCH_SPEC ${COALESCED_BCAST_CPU_ONLY:-} ${TORCH_CUDA_ARCH_LIST:-} ${CXX:-} $("$VENV/bin/python" -V 2>&1)"
    cat setup.py csrc/*
  } | sha256sum | cut -d' ' -f1
}
if [ "${COALESCED_BCAST_REBUILD:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(stamp)" ] &&
   "$VENV/bin/python" -c "import coalesced_bcast._C" 2>/dev/null; then
  "$VENV/bin/python" -c "import coalesced_bcast._C as C; print('coalesced_bcast: build up to date, reused; with_cuda =', C.with_cuda)"
  exit 0
fi
rm -f "$STAMP"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH_SPEC" pybind11 ninja pytest hypothesis numpy
# The venv's ninja must be found by torch's build helper.
PATH="$(cd "$VENV/bin" && pwd):$PATH" "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
  --no-build-isolation -e .
"$VENV/bin/python" -c "import coalesced_bcast._C as C; print('coalesced_bcast built, with_cuda =', C.with_cuda)"
stamp > "$STAMP"
