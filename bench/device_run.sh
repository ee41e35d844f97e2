#!/usr/bin/env bash
# Everything that needs GPUs, in one call on the GPU machine (two GPUs unless a step says one):
#   bash bench/device_run.sh [OPTIONS] [STEP...]
# Steps:
#   env            the machine: GPUs, their links, torch, CUDA and NCCL versions
#   build          build the extension in place with the machine's torch, or take a carried prebuilt/ that
#                  scripts/prebuild_device.sh made for these sources and this torch
#   gputest        the 2-GPU tests (NCCL) and the one-GPU tests
#   gpusingle      the one-GPU tests only (what a one-GPU machine can run)
#   refittest      the refit GPU tests
#   bench          bench/bench.py: sync against every baseline              -> bench.md, bench.json
#   init           bench/init_bench.py: FSDP1 / DDP init with install()     -> init.jsonl
#   fsdp2          bench/fsdp2_load.py: FSDP2 loads against DCP              -> fsdp2_load.jsonl
#   refit          bench/refit_bench.py: weight refit (3 processes on 2 GPUs) -> refit.jsonl
#   perf           bench/perf: the C++ core alone, nccl-tests style          -> perf_*.jsonl
#   soak gpuchecks timeout   bench/soak.py's modes               -> soak.jsonl, soak-gpu-checks.jsonl, soak-timeout.jsonl
#   sanitize       bench/sanitize.sh: compute-sanitizer over a sync          -> sanitize/
#   loadcheck      compute-sanitizer memcheck over the GPU load tests
#   torchsuite torchsuite_meta torchsuite_ddp   PyTorch's own FSDP1 / DDP tests without and with install()
#                  (scripts/torch_suite; the caller puts torch's test/ tree in torch_tests/, carried along)
# Default steps: env build gputest refittest refit bench init fsdp2 soak gpuchecks timeout sanitize perf.
# Options:
#   --out DIR                 where the archive goes (default $OUT, else ./out)
#   --logs DIR                logs and results (default /tmp/device_run)
#   --python PY               the interpreter (default python3)
#   --bench-cases LIST        bench.py's --cases (default: all)
#   --ddp-file-timeout S      torchsuite_ddp's time per test file and mode (default 280)
# Logs and results go to the logs folder and, after every step, into one archive OUT/device_run.tgz, so that
# a run cut short by its time limit still returns what finished. A failing step is reported and the next
# one still runs; the exit status is non-zero if any failed.
set -uo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$SELF")/.."
OUT=${OUT:-$PWD/out}
LOGS=/tmp/device_run
PY=python3
BENCH_CASES=
DDP_FILE_TIMEOUT=280
steps=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT=$2; shift 2 ;;
    --logs) LOGS=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --bench-cases) BENCH_CASES=$2; shift 2 ;;
    --ddp-file-timeout) DDP_FILE_TIMEOUT=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$SELF"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) steps+=("$1"); shift ;;
  esac
done
[ ${#steps[@]} -gt 0 ] || steps=(env build gputest refittest refit bench init fsdp2 soak gpuchecks timeout sanitize perf)
export LOGS PY
mkdir -p "$OUT" "$LOGS"
# NVLink multicast (NVLS) off, as the GPU machines this runs on are to be used.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-32}
RUN="$PY -m torch.distributed.run --standalone --nproc-per-node 2"
status=0

step() {  # step NAME TIMEOUT COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"
  tail -n 25 "$LOGS/$name.log"
  [ $rc -eq 0 ] || status=1
  tar czf "$OUT/device_run.tgz" -C "$LOGS" .
}

errors_raise() {  # an error thrown in C++ must reach Python as an exception, not crash the process
  $PY - <<'EOF'
import torch
from coalesced_bcast import _C
try:
    _C.hash_words(torch.zeros(4))  # float words: refused in C++
except RuntimeError as e:
    print(f"a C++ error arrives as {type(e).__name__}")
else:
    raise SystemExit("hash_words took float words: the check is broken")
EOF
}
export -f errors_raise

prebuilt() {  # the build that scripts/prebuild_device.sh made (carry prebuilt/), if it is of these sources and this torch
  [ -f prebuilt/STAMP ] || return 1
  local want
  want="$(bash scripts/source_stamp.sh) $($PY -c 'import torch; print(torch.__version__, torch.version.git_version)')"
  if [ "$(cat prebuilt/STAMP)" != "$want" ]; then
    echo "prebuilt/ is of other sources or another torch: building here"
    return 1
  fi
  cp prebuilt/_C.*.so prebuilt/_build_info.py python/coalesced_bcast/ && errors_raise &&
    echo "using prebuilt/ ($want)" && return 0
  echo "prebuilt/ does not load or crashes on errors here: building"
  rm -f python/coalesced_bcast/_C.*.so
  return 1
}
export -f prebuilt

build() {  # build, then make sure errors from C++ arrive as Python exceptions (see setup.py's pick_host_compiler)
  prebuilt && return 0
  echo "CC=${CC:-} CXX=${CXX:-}"
  $PY setup.py build_ext --inplace || return 1
  errors_raise && return 0
  echo "--- errors crash this build: rebuilding with /usr/bin/g++"
  rm -rf build/temp.* python/coalesced_bcast/_C*.so
  CXX=/usr/bin/g++ CC=/usr/bin/gcc COALESCED_BCAST_KEEP_CXX=1 $PY setup.py build_ext --inplace && errors_raise
}
export -f build

torch_suite() {  # torch_suite NAME FILE_TIMEOUT TEST...: scripts/torch_suite/run.sh over torch_tests/
  local name=$1 limit=$2; shift 2
  step "$name" 590 env PYTHONPATH="$PWD/torch_tests/site:$PYTHONPATH" OUT="$LOGS/torch_suite" FILE_TIMEOUT="$limit" \
    bash scripts/torch_suite/run.sh torch_tests/test "$PY" "$@"
}

for s in "${steps[@]}"; do
  case $s in
    env) step env 60 bash -c "nvidia-smi; nvidia-smi topo -m; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), torch.cuda.device_count())'" ;;
    build) step build 500 bash -c build ;;
    gputest) step gputest 400 $PY -m pytest -q -s tests/test_gpu_nccl.py tests/test_gpu_single.py tests/test_copy_buckets.py ;;
    gpusingle) step gpusingle 400 $PY -m pytest -q -s tests/test_gpu_single.py tests/test_copy_buckets.py \
        tests/test_module_walk.py tests/test_host_stage.py tests/test_refit_tables.py ;;
    refittest) step refittest 300 $PY -m pytest -q -s tests/test_gpu_refit.py ;;
    refit) step refit 560 $PY -m torch.distributed.run --standalone --nproc-per-node 3 bench/refit_bench.py --out "$LOGS/refit.jsonl" ;;
    bench) step bench 500 $RUN bench/bench.py --out "$LOGS/bench" ${BENCH_CASES:+--cases $BENCH_CASES} ;;
    init) step init 300 $RUN bench/init_bench.py --out "$LOGS/init.jsonl" ;;
    fsdp2) step fsdp2 540 $RUN bench/fsdp2_load.py --extra-buckets 128 --out "$LOGS/fsdp2_load.jsonl" ;;
    loadcheck) step loadcheck 400 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 --report-api-errors no \
        $PY -m pytest -q -s tests/test_gpu_nccl.py -k "load_full_state_dict" ;;
    soak) step soak 200 $RUN bench/soak.py --out "$LOGS/soak.jsonl" ;;
    gpuchecks) step gpuchecks 200 $RUN bench/soak.py --mode gpu-checks --out "$LOGS/soak-gpu-checks.jsonl" ;;
    timeout) step timeout 300 $PY bench/soak.py --mode timeout --out "$LOGS/soak-timeout.jsonl" ;;
    sanitize) step sanitize 400 env OUT="$LOGS" bash bench/sanitize.sh ;;
    # FSDP1's misc tests (CPU init, same model across ranks, ...) and HSDP; then meta-device init
    torchsuite) torch_suite torchsuite 240 distributed/fsdp/test_fsdp_misc.py distributed/fsdp/test_hsdp_sync_module_states.py ;;
    torchsuite_meta) torch_suite torchsuite_meta 280 distributed/fsdp/test_fsdp_meta.py ;;
    # DDP over NCCL on the 2 GPUs: test_c10d_nccl's DistributedDataParallelTest, the subset that covers the init
    # sync's cases (dtypes, tied and complex parameters, channels_last, layouts, refusals)
    torchsuite_ddp) torch_suite torchsuite_ddp "$DDP_FILE_TIMEOUT" \
        "distributed/test_c10d_nccl.py|DistributedDataParallelTest and (fp16 or weight_sharing or complex_params or channels_last or grad_layout or param_layout or lazy_parameters or pass_default_pg or nccl_backend or multi_device_module_config or packed_sequence)" ;;
    perf) step perf 480 bash -c '
        set -e; bash bench/perf/build.sh
        R="'"$PY"' -m torch.distributed.run --standalone --nproc-per-node 2 --no-python build/perf/coalesced_bcast_perf"
        $R -d llama -b 1G -e 16G -f 2 -n 20 -w 5 -c 1 -J "$LOGS/perf_llama.jsonl"
        $R -d llama -b 16060522496 -e 16060522496 -n 20 -w 5 -c 1 -J "$LOGS/perf_llama8b.jsonl"
        $R -d small -b 1G -e 4G -f 2 -n 20 -w 5 -c 1 -J "$LOGS/perf_small.jsonl"
        $R -d mixed -b 64M -e 1G -f 4 -n 5 -w 2 -c 1 --bucket-bytes 1M --inplace-min-bytes 4M
        if $R -d llama -b 1G -e 1G -n 2 -w 1 --inject-fault; then echo "fault run exited 0: the check is broken"; exit 1; fi
        echo "fault run failed as it must"' ;;
    *) echo "unknown step $s"; status=1 ;;
  esac
done
exit $status
