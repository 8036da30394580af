#!/usr/bin/env bash
# One command for a machine with a GPU: the machine's facts, the embedded engine on CUDA against
# the CPU, one bf16 training step with DDP and with FSDP, and the trainer's offload and reload
# around an engine; a table per part, JSON in bench/results/gpu_check.json. Sets environment
# defaults, then execs the Python check (bench/gpu_check.py --help says what each part does).
#   bash scripts/gpu-check.sh                       # exit 0: every part passed; 1: one failed; 2: no CUDA
#   bash scripts/gpu-check.sh --allow-cpu --quick   # every part on the CPU, small sizes
set -euo pipefail
export PYTHONUNBUFFERED="${PYTHONUNBUFFERED:-1}"
export PYTHON="${PYTHON:-python3}"
exec "$PYTHON" "$(dirname "$0")/../bench/gpu_check.py" "$@"
