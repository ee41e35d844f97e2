#!/usr/bin/env bash
# Every CPU test (gloo) on each torch release named, one after another, each in a venv of its own made
# for the run and removed after it (5-6 GB each), with CPU-only builds (older wheels are CUDA 12, this
# machine's nvcc 13.0). CI runs 2.4.1, 2.14.1 and 2.15.0; this covers the releases between them.
#   bash scripts/torch_versions.sh 2.5.1 2.6.0 ... [-- pytest args]
# (pytest args go after the tests folder that scripts/test.sh names: select with -k EXPR, not with file names)
# One line per release goes to stdout and to $SUMMARY (default $LOGDIR/torch_versions.txt): the torch that ran,
# pytest's exit status, the time, pytest's counts and its FAILED/ERROR lines; the whole log of each
# release is kept at $LOGDIR/torch-X.Y.Z.log (default /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
versions=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do versions+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
LOGDIR=${LOGDIR:-/tmp}
SUMMARY=${SUMMARY:-$LOGDIR/torch_versions.txt}
NO_CAP="$(mktemp)"
trap 'rm -f "$NO_CAP"' EXIT
failed=0
for v in "${versions[@]}"; do
  venv=".venv-torch-$v"
  log="$LOGDIR/torch-$v.log"
  t0=$SECONDS
  VENV=$venv TORCH_SPEC="torch==$v" COALESCED_BCAST_CPU_ONLY=1 PIP_CONSTRAINT="$NO_CAP" \
    bash scripts/test.sh "$@" > "$log" 2>&1
  rc=$?
  ran=$("$venv/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null || echo "not installed")
  counts=$(grep -E "[0-9]+ (passed|failed|error).* in [0-9.]+s" "$log" | tail -1 | tr -d '=' | sed 's/^ *//')
  line="torch $ran: exit $rc, $((SECONDS - t0)) s: ${counts:-no test summary}"
  echo "$line" | tee -a "$SUMMARY"
  grep -E "^(FAILED|ERROR) " "$log" | sed 's/^/    /' | tee -a "$SUMMARY"
  [ "$rc" = 0 ] || failed=1
  rm -rf "$venv"
done
exit $failed
