#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: a 2-rank sync of a sample model, compared with
# torch.distributed._broadcast_coalesced. gloo on CPU; NCCL when 2 GPUs are there.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VENV:-.venv}
exec "$VENV/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2 examples/sync_demo.py "$@"
