#!/usr/bin/env bash
# Configures and builds coalesced_bcast_perf against the current python's torch.
#   bash bench/perf/build.sh [BUILD_DIR]      (default: build/perf under the repository)
# Env: PYTHON (default: python3 on PATH), CUDA_HOME / CUDAToolkit_ROOT (default /usr/local/cuda),
#      TORCH_CUDA_ARCH_LIST (default 9.0), COALESCED_BCAST_PERF_CUDA=ON|OFF|AUTO (default AUTO),
#      JOBS (default: all cores).
# Re-running reuses the build directory: only what changed is rebuilt.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BUILD="${1:-$ROOT/build/perf}"
PYTHON="${PYTHON:-$(command -v python3)}"
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
if [ -n "${CUDA_HOME:-}" ]; then
  export CUDAToolkit_ROOT="${CUDAToolkit_ROOT:-$CUDA_HOME}"
fi
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
# A compiler that copies libstdc++'s code into what it links (CXX=/opt/gcc/bin/g++ on the GPU image)
# crashes against the libstdc++.so.6 torch loads: the same probe and choice as setup.py's pick_host_compiler.
if [ -n "${CXX:-}" ] && [ "${COALESCED_BCAST_KEEP_CXX:-0}" != 1 ] && [ -x /usr/bin/g++ ]; then
  probe=$(mktemp -d)
  printf '#include <sstream>\n#include <string>\nstd::string f(long x) { std::ostringstream s; s << x; return s.str(); }\n' > "$probe/p.cpp"
  if "$CXX" -shared -fPIC -O1 "$probe/p.cpp" -o "$probe/p.so" 2>/dev/null \
     && nm -C --defined-only "$probe/p.so" | grep -q "_M_insert<long>"; then
    echo "building with /usr/bin/g++ instead of CXX=$CXX (it links libstdc++ code in)"
    export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++
  fi
  rm -rf "$probe"
fi

GEN=()
if command -v ninja >/dev/null 2>&1; then
  GEN=(-G Ninja)
elif [ -x "$(dirname "$PYTHON")/ninja" ]; then
  GEN=(-G Ninja -DCMAKE_MAKE_PROGRAM="$(dirname "$PYTHON")/ninja")
fi
# A directory configured with another generator cannot be reconfigured with this one.
if [ -f "$BUILD/CMakeCache.txt" ] && [ ${#GEN[@]} -gt 0 ] && ! grep -q "CMAKE_GENERATOR:INTERNAL=Ninja" "$BUILD/CMakeCache.txt"; then
  rm -rf "$BUILD"
fi
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  cmake -S "$ROOT/bench/perf" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$PYTHON" -DCOALESCED_BCAST_PERF_CUDA="${COALESCED_BCAST_PERF_CUDA:-AUTO}"
fi
cmake --build "$BUILD" --parallel "${JOBS:-$(nproc)}"
echo "built $BUILD/coalesced_bcast_perf"
