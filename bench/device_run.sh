#!/usr/bin/env bash
# Everything that needs GPUs, in one call on the device machine (nvidia-h200-x2):
#   bash bench/device_run.sh [STEP...]     steps: env build gputest bench init fsdp2 soak gpuchecks timeout sanitize perf (default: all)
# Builds the extension in place with the machine's own torch, then runs each step; logs and
# results go under $OUT (or ./out). A failing step is reported and the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-32}
PY=${PY:-python3}
RUN="$PY -m torch.distributed.run --standalone --nproc-per-node 2"
steps=${*:-env build gputest bench init fsdp2 soak gpuchecks timeout sanitize perf}
status=0

step() {  # step NAME TIMEOUT COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"
  tail -n 25 "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
}

for s in $steps; do
  case $s in
    env) step env 60 bash -c "nvidia-smi; nvidia-smi topo -m; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), torch.cuda.device_count())'" ;;
    build) step build 400 $PY setup.py build_ext --inplace ;;
    gputest) step gputest 400 $PY -m pytest -x -q -s tests/test_gpu_nccl.py ;;
    bench) step bench 500 $RUN bench/bench.py --out "$OUT/bench" ;;
    init) step init 300 $RUN bench/init_bench.py --out "$OUT/init.jsonl" ;;
    fsdp2) step fsdp2 300 $RUN bench/fsdp2_load.py --out "$OUT/fsdp2.jsonl" ;;
    soak) step soak 200 $RUN bench/soak.py --out "$OUT/soak.jsonl" ;;
    gpuchecks) step gpuchecks 200 $RUN bench/soak.py --mode gpu-checks --out "$OUT/soak-gpu-checks.jsonl" ;;
    timeout) step timeout 300 $PY bench/soak.py --mode timeout --out "$OUT/soak-timeout.jsonl" ;;
    sanitize) step sanitize 400 bash bench/sanitize.sh ;;
    perf) step perf 480 bash -c '
        set -e; bash bench/perf/build.sh
        R="'"$PY"' -m torch.distributed.run --standalone --nproc-per-node 2 --no-python build/perf/coalesced_bcast_perf"
        $R -d llama -b 1G -e 16G -f 2 -n 20 -w 5 -c 1 -J "$OUT/perf_llama.jsonl"
        $R -d llama -b 16060522496 -e 16060522496 -n 20 -w 5 -c 1 -J "$OUT/perf_llama8b.jsonl"
        $R -d small -b 1G -e 4G -f 2 -n 20 -w 5 -c 1 -J "$OUT/perf_small.jsonl"
        $R -d mixed -b 64M -e 1G -f 4 -n 5 -w 2 -c 1 --bucket-bytes 1M --inplace-min-bytes 4M
        if $R -d llama -b 1G -e 1G -n 2 -w 1 --inject-fault; then echo "fault run exited 0: the check is broken"; exit 1; fi
        echo "fault run failed as it must"' ;;
    *) echo "unknown step $s"; status=1 ;;
  esac
done
exit $status
