#!/usr/bin/env bash
# Everything that needs GPUs, in one call on the device machine (nvidia-h200-x2):
#   bash bench/device_run.sh [STEP...]     steps: env build gputest gpusingle loadcalls hostread refittest refit bench trace keptab init agree fsdp2 loadcheck loadphases loadtimeline modulewalk soak gpuchecks timeout sanitize perf torchsuite torchsuite_meta torchsuite_ddp accelerate planhost copykernels (default: all but the torchsuite ones)
# Builds the extension in place with the machine's own torch (or takes prebuilt/, carried, made here by
# scripts/prebuild_device.sh for these sources and that torch), then runs each step. Logs and results
# go to $LOGS (default /tmp/device_run) and, after every step, into one archive $OUT/device_run.tgz
# (the device tool returns at most 8 files, and a run cut short by its time limit still returns
# what finished). A failing step is reported and the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
export LOGS=${LOGS:-/tmp/device_run}
mkdir -p "$OUT" "$LOGS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-32}
export PY=${PY:-python3}
RUN="$PY -m torch.distributed.run --standalone --nproc-per-node 2"
steps=${*:-env build gputest refittest refit bench init agree fsdp2 soak gpuchecks timeout sanitize perf}
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

prebuilt() {  # the build that scripts/prebuild_device.sh made (carry prebuilt/), if it is of these sources and this torch
  [ -f prebuilt/STAMP ] || return 1
  local want
  want="$(bash scripts/source_stamp.sh) $($PY -c 'import torch; print(torch.__version__, torch.version.git_version)')"
  if [ "$(cat prebuilt/STAMP)" != "$want" ]; then
    echo "prebuilt/ is of other sources or another torch: building here"
    return 1
  fi
  cp prebuilt/_C.*.so prebuilt/_build_info.py python/coalesced_bcast/ && $PY bench/probe_errors.py &&
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
  $PY bench/probe_errors.py && return 0
  echo "--- errors crash this build; where:"
  GDB=$(command -v gdb || echo /usr/local/cuda/bin/cuda-gdb)
  "$GDB" -batch -ex run -ex bt --args "$PY" bench/probe_errors.py 2>&1 | grep -E "^#[0-9] " | cut -c1-200
  echo "--- rebuilding with /usr/bin/g++"
  rm -rf build/temp.* python/coalesced_bcast/_C*.so
  CXX=/usr/bin/g++ CC=/usr/bin/gcc COALESCED_BCAST_KEEP_CXX=1 $PY setup.py build_ext --inplace && $PY bench/probe_errors.py
}
export -f build

for s in $steps; do
  case $s in
    env) step env 60 bash -c "nvidia-smi; nvidia-smi topo -m; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), torch.cuda.device_count())'" ;;
    build) step build 500 bash -c build ;;
    gputest) step gputest 400 $PY -m pytest -q -s tests/test_gpu_nccl.py tests/test_gpu_single.py tests/test_copy_buckets.py ;;
    # gpusingle, loadcalls: what the one-GPU kind (nvidia-h200) can run: the tests that need one GPU, and where a
    # 16k-key FSDP2 load's host time goes on a 1-rank mesh (bench/load_calls.py).
    gpusingle) step gpusingle 400 $PY -m pytest -q -s tests/test_gpu_single.py tests/test_copy_buckets.py \
        tests/test_module_walk.py tests/test_host_stage.py tests/test_refit_tables.py ;;
    loadcalls) step loadcalls 200 $PY -m torch.distributed.run --standalone --nproc-per-node 1 bench/load_calls.py ;;
    # hostread: how small pinned runs go up: bench/perf/h2d_small.cu (a copy each, one batch, a kernel reading
    # over the bus), then a 16k-key load (load_calls.py, host_read_probe.py) with each of the engine's ways
    # (COALESCED_BCAST_HOST_READ), alternating, HOSTREAD_ROUNDS times (default 2; the probe in the first only;
    # HOSTREAD_PROBE_ONLY=1: no load_calls.py; HOSTREAD_MODES: the ways, default "kernel stage").
    hostread) step hostread 520 bash -c '
        /usr/local/cuda/bin/nvcc -O2 -std=c++17 -arch=sm_90 bench/perf/h2d_small.cu -o /tmp/h2d_small && /tmp/h2d_small -n 5
        for round in $(seq ${HOSTREAD_ROUNDS:-2}); do for mode in ${HOSTREAD_MODES:-kernel stage}; do
          echo "--- COALESCED_BCAST_HOST_READ=$mode (round $round)"
          [ -n "${HOSTREAD_PROBE_ONLY:-}" ] || COALESCED_BCAST_HOST_READ=$mode $PY -m torch.distributed.run \
              --standalone --nproc-per-node 1 bench/load_calls.py 2>&1 | grep -E "^load [1-5]|H2D"
          [ $round != 1 ] || COALESCED_BCAST_HOST_READ=$mode $PY -m torch.distributed.run --standalone --nproc-per-node 1 \
              bench/host_read_probe.py 2>&1 | grep -E "^load from"
        done; done' ;;
    refittest) step refittest 300 $PY -m pytest -q -s tests/test_gpu_refit.py ;;
    refit) step refit 560 $PY -m torch.distributed.run --standalone --nproc-per-node 3 bench/refit_bench.py --out "$LOGS/refit.jsonl" ;;
    bench) step bench 500 $RUN bench/bench.py --out "$LOGS/bench" ${BENCH_CASES:+--cases $BENCH_CASES} ;;
    trace) step trace 400 $RUN bench/trace_pipeline.py --out "$LOGS/trace" ;;
    # keptab: the 16k state (1 GiB) with a kept plan against the same with speculate=True, alternating
    keptab) step keptab 200 $RUN bench/kept_ab.py 16384 32768 $((128 << 20)) ;;
    init) step init 300 $RUN bench/init_bench.py --out "$LOGS/init.jsonl" ;;
    agree) step agree 120 $RUN bench/agree_probe.py --out "$LOGS/agree_probe.jsonl" ;;
    fsdp2) step fsdp2 540 $RUN bench/fsdp2_load.py --extra-buckets 128 --out "$LOGS/fsdp2.jsonl" ;;
    loadcheck) step loadcheck 400 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 --report-api-errors no \
        $PY -m pytest -q -s tests/test_gpu_nccl.py -k "load_full_state_dict" ;;
    soak) step soak 200 $RUN bench/soak.py --out "$LOGS/soak.jsonl" ;;
    modulewalk) step modulewalk 200 $RUN bench/module_walk.py ;;
    loadphases) step loadphases 200 $RUN bench/profile_load.py --phases --out "$LOGS/load_phases.txt" ;;
    # loadtimeline: both ranks' phases of one 16k-key load on one clock (which rank the agreement waits for)
    loadtimeline) step loadtimeline 200 $RUN bench/profile_load.py --timeline --out "$LOGS/load_timeline.txt" ;;
    gpuchecks) step gpuchecks 200 $RUN bench/soak.py --mode gpu-checks --out "$LOGS/soak-gpu-checks.jsonl" ;;
    timeout) step timeout 300 $PY bench/soak.py --mode timeout --out "$LOGS/soak-timeout.jsonl" ;;
    planhost) step planhost 300 bash -c '
        $PY bench/plan_host.py --label current --out "$LOGS/plan_host.jsonl" || exit 1
        $PY bench/plan_host.py --label "current, 1 inter-op thread" --interop 1 --out "$LOGS/plan_host.jsonl" || exit 1
        # A one-shot sync plans tensors the caches no longer hold: the planning pass cold, in chunks of 8192 and 2048.
        for g in 8192 2048; do COALESCED_BCAST_PLAN_GRAIN=$g $PY bench/plan_host.py --cold --counts 16384,65536 \
            --label "current, cold, grain $g" --out "$LOGS/plan_host.jsonl" || exit 1; done
        # AB_BASE: a tree of another revision (git archive), carried along; built and timed the same way.
        [ -n "${AB_BASE:-}" ] || exit 0
        (cd "$AB_BASE" && $PY setup.py build_ext --inplace > "$LOGS/planhost_base_build.log" 2>&1) || exit 1
        PYTHONPATH="$PWD/$AB_BASE/python" $PY bench/plan_host.py --label "base $AB_BASE" --out "$LOGS/plan_host.jsonl"' ;;
    # copykernels: pack and unpack kernels on one GPU (bench/copy_kernels.py); with AB_BASE, the same for that
    # tree's build, run between two runs of this one.
    copykernels) step copykernels 400 bash -c '
        $PY bench/copy_kernels.py --label current --out "$LOGS/copy_kernels.jsonl" || exit 1
        [ -n "${AB_BASE:-}" ] || exit 0
        (cd "$AB_BASE" && $PY setup.py build_ext --inplace > "$LOGS/copykernels_base_build.log" 2>&1) || exit 1
        PYTHONPATH="$PWD/$AB_BASE/python:$PWD/tests" $PY bench/copy_kernels.py --label "base $AB_BASE" \
            --out "$LOGS/copy_kernels.jsonl" || exit 1
        $PY bench/copy_kernels.py --label "current, again" --out "$LOGS/copy_kernels.jsonl"' ;;
    sanitize) step sanitize 400 env OUT="$LOGS" bash bench/sanitize.sh ;;
    # PyTorch's own FSDP1 tests without and with install() (scripts/torch_suite). The device has no network
    # and torch's wheel ships no test/ tree: the caller puts one (and expecttest) in torch_tests/ (git-ignored;
    # the device call carries it).
    # torchsuite: FSDP1's misc tests (CPU init, same model across ranks, ...) and HSDP; torchsuite_meta: meta-device init.
    torchsuite) step torchsuite 590 env PYTHONPATH="$PWD/torch_tests/site:$PYTHONPATH" OUT="$LOGS/torch_suite" \
        FILE_TIMEOUT=240 bash scripts/torch_suite/run.sh torch_tests/test "$PY" distributed/fsdp/test_fsdp_misc.py \
        distributed/fsdp/test_hsdp_sync_module_states.py ;;
    torchsuite_meta) step torchsuite_meta 590 env PYTHONPATH="$PWD/torch_tests/site:$PYTHONPATH" \
        OUT="$LOGS/torch_suite" FILE_TIMEOUT=280 bash scripts/torch_suite/run.sh torch_tests/test "$PY" \
        distributed/fsdp/test_fsdp_meta.py ;;
    # torchsuite_ddp: DDP over NCCL on the 2 GPUs (test_c10d_nccl's DistributedDataParallelTest, a subset that
    # covers the init sync's cases: dtypes, tied and complex parameters, channels_last, layouts, refusals).
    # DDP_FILE_TIMEOUT: the subset takes ~250 s a mode; with MODES=with (one half) it can have ~550.
    torchsuite_ddp) step torchsuite_ddp 590 env PYTHONPATH="$PWD/torch_tests/site:$PYTHONPATH" \
        OUT="$LOGS/torch_suite" FILE_TIMEOUT=${DDP_FILE_TIMEOUT:-280} bash scripts/torch_suite/run.sh torch_tests/test "$PY" \
        "distributed/test_c10d_nccl.py|DistributedDataParallelTest and (fp16 or weight_sharing or complex_params or channels_last or grad_layout or param_layout or lazy_parameters or pass_default_pg or nccl_backend or multi_device_module_config or packed_sequence)" ;;
    # accelerate's FSDP1 plugin (sync_module_states, cpu_ram_efficient_loading, a tied Llama) without and with install().
    accelerate) step accelerate 300 bash -c "$RUN bench/accelerate_fsdp1.py --mode torch --out $LOGS/accelerate.jsonl; \
        $RUN bench/accelerate_fsdp1.py --mode install --out $LOGS/accelerate.jsonl" ;;
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
