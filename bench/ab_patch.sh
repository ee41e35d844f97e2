#!/usr/bin/env bash
# A/B of a change on one GPU, in one device call: the tree as it is (new) against the same tree with
# PATCH reversed (base), both built side by side, then bench/load_calls.py twice each, alternating, and
# fsdp2_load.py's 16k-key rows (plain and offloaded shards) for each. Results under $OUT.
#   git add -N <new files> && git diff HEAD -- csrc > /tmp/new.patch && cp /tmp/new.patch bench/ab.patch
#   bash bench/ab_patch.sh bench/ab.patch
# Knobs: GPUTEST=1 runs the one-GPU tests on new first; ROUNDS (default 2) load_calls.py rounds;
# OFFLOAD=0 leaves out the offloaded rows.
set -u
PATCH=$(realpath "${1:?usage: bench/ab_patch.sh PATCH}")
export NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
NEW=$PWD BASE=/tmp/base
rm -rf $BASE && mkdir -p $BASE && cp -r csrc python bench tests setup.py scripts $BASE/ && (cd $BASE && patch -s -R -p1 -E < "$PATCH") || exit 1
t0=$SECONDS
(cd $NEW && MAX_JOBS=8 python3 setup.py build_ext --inplace > $OUT/build_new.log 2>&1) &
(cd $BASE && MAX_JOBS=8 python3 setup.py build_ext --inplace > $OUT/build_base.log 2>&1) &
wait
echo "built in $((SECONDS - t0)) s"; ls $NEW/python/coalesced_bcast/*.so $BASE/python/coalesced_bcast/*.so || exit 1
run() {  # run TREE ARGS...
  local tree=$1; shift
  PYTHONPATH=$tree/python:$tree/tests:$tree/bench python3 -m torch.distributed.run --standalone --nproc-per-node 1 "$@" 2>&1 | grep -v -i warn
}
if [ "${GPUTEST:-0}" = 1 ]; then
  echo "--- GPU tests on new ($(date +%T))"
  PYTHONPATH=$NEW/python:$NEW/tests timeout 300 python3 -m pytest -q tests/test_gpu_single.py tests/test_copy_buckets.py \
    tests/test_module_walk.py tests/test_host_stage.py 2>&1 | tail -4
fi
for i in $(seq "${ROUNDS:-2}"); do
  for v in new base; do
    tree=$NEW; [ $v = base ] && tree=$BASE
    echo "--- fine $v $i ($(date +%T))"; run $tree $tree/bench/load_calls.py | tee -a $OUT/fine_$v.txt | tail -11
  done
done
for v in new base; do
  tree=$NEW; [ $v = base ] && tree=$BASE
  echo "--- fsdp2_load $v ($(date +%T))"
  run $tree $tree/bench/fsdp2_load.py --states small16k --sources pinned,gpu --phases --no-dcp --reps 4 --out $OUT/load_$v.jsonl | tail -12
done
[ "${OFFLOAD:-1}" = 1 ] && for v in new base; do
  tree=$NEW; [ $v = base ] && tree=$BASE
  echo "--- offload pinned $v ($(date +%T))"
  run $tree $tree/bench/fsdp2_load.py --offload pinned --states small16k --sources pinned --phases --no-dcp --reps 3 --out $OUT/offload_$v.jsonl | tail -8
done
