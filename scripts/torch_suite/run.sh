#!/usr/bin/env bash
# Run PyTorch's own DDP / FSDP1 tests twice, without and with coalesced_bcast.install() active in every
# test process (sitecustomize.py in this folder), then compare the per-test outcomes.
#
#   scripts/torch_suite/run.sh TESTS_DIR [PYTHON] [ENTRY ...]
#
# TESTS_DIR: the test/ folder of the pytorch source at the installed torch's version (holds distributed/).
# PYTHON:    the python whose torch is tested (default: python3).
# ENTRY:     "path/under/TESTS_DIR.py" or "path.py|pytest -k expression"; default: the list below.
# Env: OUT (results, default /tmp/torch_suite_out), MODES (default "without with"),
#      FILE_TIMEOUT (seconds per file and mode, default 1500).
# Needs pytest and expecttest in PYTHON's environment (torch's test utilities import expecttest).
# Results: $OUT/<mode>/<file>.{xml,log,rc}, and $OUT/with/<file>.calls.jsonl (one line per process:
# syncs served by coalesced_bcast and handed back to torch, with reasons). Then compare.py prints the report.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
tests=$(cd "${1:?usage: run.sh TESTS_DIR [PYTHON] [ENTRY ...]}" && pwd)
py=${2:-python3}
[[ $py != */* ]] || py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")  # absolute, not resolved (a venv's link)
shift $(( $# < 2 ? $# : 2 ))
out=${OUT:-/tmp/torch_suite_out}
# distributed_test.py's DDP tests: the names that say so, and the others that build a DDP model.
spawn_k="DistributedDataParallel or ddp or get_data_parallel_params or accumulate_gradients or post_localSGD"
spawn_k+=" or static_graph or grads_same_across_ranks or compute_bucket_assignment or verify_model_across_rank"
spawn_k+=" or output_unused_in_loss or undefined_grad_parity or different_graph_across_ranks or sync_bn_logged"
spawn_k+=" or skip_all_reduce_unused"
entries=("$@")
[[ ${#entries[@]} -gt 0 ]] || entries=(
  "distributed/test_c10d_pypg.py"
  "distributed/test_c10d_gloo.py|DistributedDataParallel or ddp or DDP or Ddp"
  "distributed/test_distributed_spawn.py|$spawn_k"
  "distributed/fsdp/test_fsdp_misc.py"
  "distributed/fsdp/test_fsdp_meta.py"
  "distributed/fsdp/test_hsdp_sync_module_states.py"
)

"$py" -c 'import torch; print("torch", torch.__version__, torch.version.git_version, "cuda:", torch.cuda.device_count())'
for mode in ${MODES:-without with}; do
  mkdir -p "$out/$mode"
  for entry in "${entries[@]}"; do
    file=${entry%%|*} k=""
    [[ $entry == *"|"* ]] && k=${entry#*|}
    name=${file%.py} name=${name//\//_}
    env=(PYTHONPATH="$here:$repo/python${PYTHONPATH:+:$PYTHONPATH}")
    if [[ $mode == with ]]; then
      rm -f "$out/$mode/$name.calls.jsonl"
      env+=(COALESCED_BCAST_INSTALL=1 COALESCED_BCAST_INSTALL_LOG="$out/$mode/$name.calls.jsonl")
    fi
    if [[ $file == */test_distributed_spawn.py ]]; then  # see its header; INIT_METHOD: a file:// one, as
      tmp=$(mktemp -d) && mkdir "$tmp/barrier"          # the tests' setUp sets it before spawning ranks
      env+=(BACKEND="${BACKEND:-gloo}" WORLD_SIZE="${WORLD_SIZE:-2}" TEMP_DIR="$tmp" INIT_METHOD="file://$tmp/init")
    fi
    echo "== $mode: $file${k:+ -k '$k'}"
    start=$SECONDS
    (cd "$tests" && env "${env[@]}" timeout -k 60 "${FILE_TIMEOUT:-1500}" "$py" -m pytest "$file" ${k:+-k "$k"} \
      -p no:cacheprovider -q -rfE --tb=short --junit-xml="$out/$mode/$name.xml") >"$out/$mode/$name.log" 2>&1
    rc=$?
    echo "$rc" >"$out/$mode/$name.rc"
    [[ $file != */test_distributed_spawn.py ]] || rm -rf "$tmp"
    echo "   rc=$rc in $((SECONDS - start))s: $(tail -n 1 "$out/$mode/$name.log")"
  done
done
"$py" "$here/compare.py" "$out"
