#!/usr/bin/env bash
# A/B on one GPU, in one device call: bench/load_calls.py for arm A and arm B in alternating processes, ROUNDS
# times, then fsdp2_load.py's 16k-key rows for each. Results under $OUT (build logs, fine_<arm>.txt, load_<arm>.jsonl).
#   bash bench/ab.sh env VAR A B   one build; the arms run with VAR=A and VAR=B
#   bash bench/ab.sh patch PATCH   the tree as it is (arm new) against it with PATCH reversed (arm base), built side
#                                  by side (one build where PATCH changes no csrc/ or setup.py); make PATCH with:
#                                  git add -N <new files> && git diff HEAD -- csrc python > PATCH
# Knobs: GPUTEST=1 runs the one-GPU tests on the tree as it is first; ROUNDS (default 2) load_calls.py rounds;
# SOURCES (default pinned) fsdp2_load.py's sources (FSDP2=0: none of its rows); OFFLOAD=1 adds its rows with shards
# offloaded to pinned memory.
# bench/ab_env.sh and bench/ab_patch.sh (results of 2026-12-04 and -05) were these two modes.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
usage="usage: bench/ab.sh env VAR A B | bench/ab.sh patch PATCH"
declare -A TREE ENVS
case "${1:-}" in
  env)
    VAR=${2:?$usage}
    ARMS=("${3:?$usage}" "${4:?$usage}")
    for a in "${ARMS[@]}"; do TREE[$a]=$PWD ENVS[$a]="$VAR=$a"; done
    ;;
  patch)
    PATCH=$(realpath "${2:?$usage}")
    ARMS=(new base)
    TREE[new]=$PWD TREE[base]=/tmp/base ENVS[new]="" ENVS[base]=""
    rm -rf /tmp/base && mkdir -p /tmp/base && cp -r csrc python bench tests setup.py scripts /tmp/base/ &&
      (cd /tmp/base && patch -s -R -p1 -E < "$PATCH") || exit 1
    ;;
  *) echo "$usage"; exit 2 ;;
esac
trees=$(printf '%s\n' "${TREE[@]}" | sort -u)
jobs=$((16 / $(echo "$trees" | wc -l)))
t0=$SECONDS
# The tree as it is from prebuilt/ (carried; scripts/prebuild_device.sh) where it matches: no build here.
if bash bench/device_run.sh build 2>&1 | grep -q "^using prebuilt/"; then
  echo "the tree as it is: prebuilt/"
  trees=$(echo "$trees" | grep -v -x "$PWD")
fi
# A patch of no compiled source: the base takes the tree's build.
if [ "${1:-}" = patch ] && ! grep -q -E '^\+\+\+ b/(csrc/|setup\.py)' "$PATCH" && ! echo "$trees" | grep -q -x "$PWD"; then
  cp python/coalesced_bcast/_C.*.so python/coalesced_bcast/_build_info.py /tmp/base/python/coalesced_bcast/ &&
    echo "base: the tree's build (the patch changes no compiled source)" && trees=$(echo "$trees" | grep -v -x /tmp/base)
fi
for t in $trees; do
  (cd "$t" && MAX_JOBS=$jobs python3 setup.py build_ext --inplace > "$OUT/build_$(basename "$t").log" 2>&1) &
done
wait
for t in $trees; do
  ls "$t"/python/coalesced_bcast/*.so > /dev/null || { tail -20 "$OUT/build_$(basename "$t").log"; exit 1; }
done
echo "built in $((SECONDS - t0)) s"
run() {  # run ARM SCRIPT ARGS...: SCRIPT from the arm's tree, on one GPU
  local tree=${TREE[$1]} envs=${ENVS[$1]} script=$2; shift 2
  env $envs PYTHONPATH="$tree/python:$tree/tests:$tree/bench" python3 -m torch.distributed.run --standalone \
    --nproc-per-node 1 "$tree/$script" "$@" 2>&1 | grep -v -i warn
}
if [ "${GPUTEST:-0}" = 1 ]; then
  echo "--- GPU tests ($(date +%T))"
  PYTHONPATH=$PWD/python:$PWD/tests timeout 300 python3 -m pytest -q tests/test_gpu_single.py tests/test_copy_buckets.py \
    tests/test_module_walk.py tests/test_host_stage.py > "$OUT/gputest.txt" 2>&1; tail -4 "$OUT/gputest.txt"
fi
for i in $(seq "${ROUNDS:-2}"); do
  for a in "${ARMS[@]}"; do
    echo "--- fine $a $i ($(date +%T))"; run "$a" bench/load_calls.py | tee -a "$OUT/fine_$a.txt" | tail -11
  done
done
[ "${FSDP2:-1}" = 1 ] && for a in "${ARMS[@]}"; do
  echo "--- fsdp2_load $a ($(date +%T))"
  run "$a" bench/fsdp2_load.py --states small16k --sources "${SOURCES:-pinned}" --phases --no-dcp --reps 4 \
    --out "$OUT/load_$a.jsonl" | tail -12
done
[ "${OFFLOAD:-0}" = 1 ] && for a in "${ARMS[@]}"; do
  echo "--- offload pinned $a ($(date +%T))"
  run "$a" bench/fsdp2_load.py --offload pinned --states small16k --sources pinned --phases --no-dcp --reps 3 \
    --out "$OUT/offload_$a.jsonl" | tail -8
done
exit 0
