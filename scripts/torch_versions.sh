#!/usr/bin/env bash
# Every CPU test (gloo) on each torch release named, one after another, each in a venv of its own
# (.venv-torch-X.Y.Z, 5-6 GB) with a CPU-only build (older wheels are CUDA 12, this machine's nvcc 13.0).
# CI runs 2.4.1, 2.14.1 and 2.15.0; this covers the releases between them.
#   bash scripts/torch_versions.sh 2.5.1 2.6.0 ... [-- pytest args]
# (pytest args go after the tests folder that scripts/test.sh names: select with -k EXPR, not with file names)
# Each release is one part (scripts/ci_part.sh, as in .ci/run): a venv the part created is removed after it.
# One line per release goes to stdout and to $SUMMARY (default $LOGDIR/torch_versions.txt): the torch that ran,
# pytest's exit status, the time, pytest's counts and its FAILED/ERROR lines; the whole log of each
# release is kept at $LOGDIR/torch-X.Y.Z.log (default /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/ci_part.sh
versions=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do versions+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
LOGDIR=${LOGDIR:-/tmp}
SUMMARY=${SUMMARY:-$LOGDIR/torch_versions.txt}
NO_CAP="$(mktemp)"
trap 'rm -f "$NO_CAP"' EXIT
failed=0
for v in "${versions[@]}"; do
  ci_part quiet "$LOGDIR/torch-$v.log" VENV=".venv-torch-$v" TORCH_SPEC="torch==$v" COALESCED_BCAST_CPU_ONLY=1 \
    PIP_CONSTRAINT="$NO_CAP" -- "$@"
  line="torch $part_torch: exit $part_rc, $part_seconds s: ${part_counts:-no test summary}"
  echo "$line" | tee -a "$SUMMARY"
  grep -E "^(FAILED|ERROR) " "$LOGDIR/torch-$v.log" | sed 's/^/    /' | tee -a "$SUMMARY"
  [ "$part_rc" = 0 ] || failed=1
done
exit $failed
