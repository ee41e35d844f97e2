# Sourced by .ci/run and scripts/torch_versions.sh: one "part", scripts/test.sh in one venv with one torch.
#   ci_part tee|quiet LOG VAR=VALUE... [-- PYTEST_ARGS...]
# Runs scripts/test.sh under the VAR=VALUE settings (VENV names the venv, default .venv; TORCH_SPEC the
# torch), with PYTEST_ARGS after its tests folder. Its output goes to LOG, and with "tee" to stdout too.
# Sets part_rc (test.sh's exit status), part_torch (the torch the venv holds), part_counts (pytest's
# last count line, "N passed, M failed ... in Ts"; empty when there is none) and part_seconds.
# A venv the part created is removed afterwards (5-6 GB each: torch and its CUDA libraries), so that a
# run of several parts needs one venv's disk at a time; a venv that was there before is kept.
ci_part() {
  local mode=$1 log=$2 t0=$SECONDS venv created=0
  shift 2
  local settings=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do settings+=("$1"); shift; done
  [ "${1:-}" = "--" ] && shift
  venv=$(env "${settings[@]}" bash -c 'echo "${VENV:-.venv}"')
  [ -e "$venv" ] || created=1
  if [ "$mode" = tee ]; then
    env "${settings[@]}" bash scripts/test.sh "$@" 2>&1 | tee "$log"
    part_rc=${PIPESTATUS[0]}
  else
    env "${settings[@]}" bash scripts/test.sh "$@" > "$log" 2>&1
    part_rc=$?
  fi
  part_torch=$("$venv/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null || echo "not installed")
  part_counts=$(grep -E "[0-9]+ (passed|failed|error).* in [0-9.]+s" "$log" | tail -1 | tr -d '=' | sed 's/^ *//')
  part_seconds=$((SECONDS - t0))
  if [ "$created" = 1 ]; then rm -rf "$venv"; fi
}
