#!/usr/bin/env bash
# Sets up a virtual environment with torch and builds the extension in place (editable install).
# VENV: where (default .venv). TORCH_SPEC: which torch (default torch==2.14.1, the CUDA 13.0 wheel).
# A second run reuses the build when nothing it depends on changed (csrc/, setup.py, pyproject.toml,
# the version, the torch spec, the build's environment): it then takes seconds.
# COALESCED_BCAST_REBUILD=1 forces a build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
STAMP="$VENV/coalesced_bcast.build"
# The editable install builds _C*.so (and _build_info.py) into python/coalesced_bcast/, one file name
# for every venv of the same Python: a venv's own copies are kept in the venv and put back when
# another venv's build is in the tree, so that each venv of a version matrix reuses its build.
SAVED="$VENV/coalesced_bcast.build.d"
PKG=python/coalesced_bcast
stamp() {  # what the build depends on, hashed
  {
    echo "$TORCH_SPEC ${COALESCED_BCAST_CPU_ONLY:-} ${TORCH_CUDA_ARCH_LIST:-} ${CXX:-} $("$VENV/bin/python" -V 2>&1)"
    cat setup.py pyproject.toml python/coalesced_bcast/_version.py csrc/*
  } | sha256sum | cut -d' ' -f1
}
restore() {
  local f
  for f in "$SAVED"/*; do
    [ -f "$f" ] || return 1
    cmp -s "$f" "$PKG/$(basename "$f")" || cp "$f" "$PKG/"
  done
}
if [ "${COALESCED_BCAST_REBUILD:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(stamp)" ] &&
   restore && "$VENV/bin/python" -c "import coalesced_bcast._C" 2>/dev/null; then
  "$VENV/bin/python" -c "import coalesced_bcast._C as C; print('coalesced_bcast: build up to date, reused; with_cuda =', C.with_cuda)"
  exit 0
fi
rm -f "$STAMP"
# A fresh venv's own setuptools (65.5 with Python 3.11) has no bdist_wheel, which the editable install
# below needs (`invalid command 'bdist_wheel'`): bring setuptools and wheel up first. --use-pep517 keeps
# pip on the PEP 660 editable build with this venv's torch: with wheel present, the venv's pip 23 would
# otherwise run `setup.py develop`, which recent setuptools hands to an isolated pip without torch.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -U setuptools wheel
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH_SPEC" pybind11 ninja pytest hypothesis numpy accelerate
# The venv's ninja must be found by torch's build helper.
PATH="$(cd "$VENV/bin" && pwd):$PATH" "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
  --no-build-isolation --use-pep517 -e .
"$VENV/bin/python" -c "import coalesced_bcast._C as C; print('coalesced_bcast built, with_cuda =', C.with_cuda)"
rm -rf "$SAVED" && mkdir -p "$SAVED" && cp "$PKG"/_C*.so "$PKG/_build_info.py" "$SAVED/"
stamp > "$STAMP"
