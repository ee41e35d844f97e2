#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and synccheck over a full GPU sync (bench/soak.py --mode
# sanitize: zoo of every dtype and view, several buckets through a 2-slot ring, in-place tensors, ties,
# both ranks as source, verify=True, bitwise check; then an FSDP-unit-like sync: tensors back to back
# in one buffer sent as one broadcast, small ones in place on the caller's stream, and a run that the
# ranks agree to split where one rank's layout differs). 2 ranks under torchrun --no-python, each rank's
# python wrapped by compute-sanitizer; the three tools run at the same time. Prints one verdict line
# per tool and exits non-zero on any error, a wrong result or a timeout.
#
#   bash bench/sanitize.sh          # after `python3 setup.py build_ext --inplace` on the device
#
# Logs: $OUT/sanitize/TOOL.log (OUT defaults to ./out). Knobs:
#   SANITIZE_TOOLS   (default "memcheck racecheck synccheck")
#   SANITIZE_KERNELS all | ours (default: memcheck checks every kernel, NCCL's and torch's too;
#                    racecheck and synccheck only ours, kernels named coalesced_bcast::*)
#   SANITIZE_TIMEOUT seconds per tool (default 330)
#   SANITIZE_TESTS   1 (default): also run the GPU bitwise test (pytest, its spawned ranks included)
#                    under memcheck
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
LOGS=$OUT/sanitize
mkdir -p "$LOGS"
PY=${PY:-python3}
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
     /usr/local/cuda/compute-sanitizer/compute-sanitizer 2>/dev/null | head -n 1)
if [ -z "$CS" ] || [ ! -x "$CS" ]; then
  echo "sanitize: FAIL (compute-sanitizer not found)"
  exit 2
fi
export PYTHONPATH=$PWD/python:$PWD/tests${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0
# Every tensor its own cudaMalloc: an access past a tensor's end is outside any allocation, which
# memcheck sees; inside one cached segment it would not.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
"$CS" --version | head -n 2
has_filter=0 has_api=0
"$CS" --help 2>&1 | grep -q -- "--kernel-name" && has_filter=1
"$CS" --help 2>&1 | grep -q -- "--report-api-errors" && has_api=1

run_tool() {  # run_tool TOOL -> writes $LOGS/TOOL.log, $LOGS/TOOL.rc
  local tool=$1 kernels=${SANITIZE_KERNELS:-}
  [ -n "$kernels" ] || { [ "$tool" = memcheck ] && kernels=all || kernels=ours; }
  local filter=()
  [ "$kernels" = ours ] && [ $has_filter = 1 ] && filter=(--kernel-name kns=coalesced_bcast)
  # NCCL's communicator set-up asks for attributes of kernels it has no sm_90 image for and gets
  # cudaErrorNoKernelImageForDevice, which it expects (all from
  # ncclInitKernelsForDevice): not errors of this code. Device-side checks are unaffected.
  [ $has_api = 1 ] && filter+=(--report-api-errors no)
  echo "$kernels" > "$LOGS/$tool.kernels"
  rm -f "$LOGS/$tool.jsonl"
  timeout "${SANITIZE_TIMEOUT:-330}" "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 --no-python \
    "$CS" --tool "$tool" --error-exitcode 97 --print-limit 50 "${filter[@]}" \
    "$PY" bench/soak.py --mode sanitize --out "$LOGS/$tool.jsonl" > "$LOGS/$tool.log" 2>&1
  echo $? > "$LOGS/$tool.rc"
}

run_tests() {  # the GPU tests' bitwise/stream-order test under memcheck, child processes included
  local filter=()
  [ $has_api = 1 ] && filter+=(--report-api-errors no)
  timeout "${SANITIZE_TIMEOUT:-330}" "$CS" --tool memcheck --target-processes all --error-exitcode 97 \
    --print-limit 50 "${filter[@]}" "$PY" -m pytest -q -x tests/test_gpu_nccl.py -k bitwise \
    > "$LOGS/memcheck-tests.log" 2>&1
  echo $? > "$LOGS/memcheck-tests.rc"
}

tools=${SANITIZE_TOOLS:-memcheck racecheck synccheck}
for tool in $tools; do run_tool "$tool" & done
[ "${SANITIZE_TESTS:-1}" = 1 ] && run_tests &
wait

status=0
for tool in $tools; do
  log=$LOGS/$tool.log
  rc=$(cat "$LOGS/$tool.rc")
  # "ERROR SUMMARY: N errors" per rank; racecheck also "RACECHECK SUMMARY: ... (N errors, M warnings)".
  errors=$(grep -oE "ERROR SUMMARY: [0-9]+ error" "$log" | awk '{s += $3} END {print s + 0}')
  races=$(grep -oE "RACECHECK SUMMARY: .*\(([0-9]+) error" "$log" | grep -oE "\(([0-9]+)" | tr -d '(' \
          | awk '{s += $1} END {print s + 0}')
  summaries=$(grep -cE "(ERROR|RACECHECK) SUMMARY" "$log")  # racecheck prints only the latter
  workload=$(grep -c '"ok": true' "$LOGS/$tool.jsonl" 2>/dev/null)
  kernels=$(cat "$LOGS/$tool.kernels")
  where=$(grep -E "^=+ +at " "$log" | sed -E 's/^=+ +at +//' | cut -c1-100 | sort | uniq -c | sort -rn | head -n 3 \
          | tr -s ' ' | tr '\n' ';')
  if [ "$rc" = 0 ] && [ "$errors" = 0 ] && [ "$races" = 0 ] && [ "$summaries" -ge 2 ] && [ "${workload:-0}" -ge 2 ]; then
    verdict=OK
  else
    verdict=FAIL
    status=1
  fi
  echo "sanitize $tool: $verdict (rc $rc, $errors errors, $races race errors, $summaries rank summaries," \
       "workload bitwise ok on ${workload:-0}/2 ranks, kernels checked: $kernels${where:+, first hits: $where}) log: $log"
done
if [ "${SANITIZE_TESTS:-1}" = 1 ]; then
  log=$LOGS/memcheck-tests.log rc=$(cat "$LOGS/memcheck-tests.rc")
  errors=$(grep -oE "ERROR SUMMARY: [0-9]+ error" "$log" | awk '{s += $3} END {print s + 0}')
  passed=$(grep -cE "^[0-9]+ passed" "$log")
  if [ "$rc" = 0 ] && [ "$errors" = 0 ] && [ "$passed" = 1 ]; then verdict=OK; else verdict=FAIL; status=1; fi
  echo "sanitize memcheck over tests/test_gpu_nccl.py -k bitwise: $verdict (rc $rc, $errors errors) log: $log"
fi
exit $status
