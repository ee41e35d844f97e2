#!/usr/bin/env bash
# Build the extension here for the GPU machine's image (Python 3.12, torch 2.11.0+cu130, sm_90), so that a
# device call skips its own build (60-90 s of device time each). Result in prebuilt/ (git-ignored; name it in
# the device call's carry): the debug-stripped _C .so, its _build_info.py and STAMP (scripts/source_stamp.sh
# plus the torch version and commit it was built against). bench/device_run.sh's build step uses it when the
# STAMP matches the checkout and the machine's torch, and builds there otherwise.
#   bash scripts/prebuild_device.sh
# First run: a Python 3.12 venv (.venv-device) with that torch (its CUDA libraries from pip); then ~4-8 min
# a build on 2 cores. DEVICE_TORCH / DEVICE_PYTHON / TORCH_CUDA_ARCH_LIST override the target.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
TORCH_SPEC=${DEVICE_TORCH:-torch==2.11.0}
PYBIN=${DEVICE_PYTHON:-}
for c in python3.12 /root/.pyenv/versions/3.12*/bin/python; do
  [ -n "$PYBIN" ] || ! "$c" -V > /dev/null 2>&1 || PYBIN=$c
done
[ -n "$PYBIN" ] || { echo "no Python 3.12 here (DEVICE_PYTHON=...)"; exit 1; }
VENV=.venv-device
if [ ! -x "$VENV/bin/python" ]; then
  "$PYBIN" -m venv "$VENV"
fi
empty=$(mktemp)
PIP_CONSTRAINT=$empty "$VENV/bin/python" -m pip install -q "$TORCH_SPEC" "setuptools<82" wheel ninja
rm -f "$empty"
torch_id=$("$VENV/bin/python" -c 'import torch; print(torch.__version__, torch.version.git_version)')
want="$(bash scripts/source_stamp.sh) $torch_id"
if [ -f prebuilt/STAMP ] && [ "$(cat prebuilt/STAMP)" = "$want" ] && ls prebuilt/_C.*.so > /dev/null 2>&1; then
  echo "prebuilt/ is up to date ($want)"
  exit 0
fi
# A copy of the sources, so that this checkout's own build (another torch) stays as it is; kept with its
# objects between runs, modification times preserved, so that a second run compiles only what changed.
src=${PREBUILD_DIR:-/tmp/coalesced_bcast_prebuild}
mkdir -p "$src/csrc" "$src/python"
rm -f "$src"/csrc/* && cp -p csrc/* "$src/csrc/" && cp -p setup.py "$src/"
cp -rp python/coalesced_bcast "$src/python/"
rm -f "$src"/python/coalesced_bcast/_C.*.so "$src"/python/coalesced_bcast/_build_info.py
(cd "$src" && PATH="$root/$VENV/bin:$PATH" TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
  MAX_JOBS=${MAX_JOBS:-2} "$root/$VENV/bin/python" setup.py build_ext --inplace --build-temp "$src/bt" > "$src/build.log" 2>&1) ||
  { tail -30 "$src/build.log"; exit 1; }
rm -rf prebuilt && mkdir prebuilt
so=$(ls "$src"/python/coalesced_bcast/_C.*.so)
strip --strip-debug -o "prebuilt/$(basename "$so")" "$so"
cp "$src/python/coalesced_bcast/_build_info.py" prebuilt/
echo "$want" > prebuilt/STAMP
ls -la prebuilt
