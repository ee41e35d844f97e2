#!/usr/bin/env bash
# A/B of an environment switch on one GPU, in one device call and one build: bench/load_calls.py with VAR=A
# and VAR=B in alternating processes, ROUNDS (default 2) times each, then fsdp2_load.py's 16k-key rows from
# pinned memory for each. Results under $OUT.
#   bash bench/ab_env.sh COALESCED_BCAST_LOAD_FEED 1 0
# GPUTEST=1 runs the one-GPU tests first.
set -u
VAR=${1:?usage: bench/ab_env.sh VAR A B} A=${2:?} B=${3:?}
export NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
t0=$SECONDS
MAX_JOBS=16 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
echo "built in $((SECONDS - t0)) s"
run() {  # run VALUE ARGS...
  local v=$1; shift
  env "$VAR=$v" PYTHONPATH=$PWD/python:$PWD/tests:$PWD/bench python3 -m torch.distributed.run --standalone \
    --nproc-per-node 1 "$@" 2>&1 | grep -v -i warn
}
if [ "${GPUTEST:-0}" = 1 ]; then
  echo "--- GPU tests ($(date +%T))"
  PYTHONPATH=$PWD/python:$PWD/tests timeout 300 python3 -m pytest -q tests/test_gpu_single.py tests/test_copy_buckets.py \
    tests/test_module_walk.py tests/test_host_stage.py 2>&1 | tail -4
fi
for i in $(seq "${ROUNDS:-2}"); do
  for v in "$A" "$B"; do
    echo "--- fine $VAR=$v $i ($(date +%T))"; run "$v" bench/load_calls.py | tee -a "$OUT/fine_$v.txt" | tail -11
  done
done
for v in "$A" "$B"; do
  echo "--- fsdp2_load $VAR=$v ($(date +%T))"
  run "$v" bench/fsdp2_load.py --states small16k --sources pinned --phases --no-dcp --reps 4 --out "$OUT/load_$v.jsonl" | tail -8
done
