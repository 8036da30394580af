#!/usr/bin/env bash
# One rank of a run: sets environment defaults, then execs the Python CLI. No logic here.
#   bash scripts/run.sh --data-path D --log-path L --rl-phase both --eval-interval 6 \
#       --num-nodes 3 --rank-weights "2,1,1" --master        # node 0
#   bash scripts/run.sh ... --worker 1                        # node 1
export PYTHONUNBUFFERED="${PYTHONUNBUFFERED:-1}"
export ORCHESTRATOR_LOG_LEVEL="${ORCHESTRATOR_LOG_LEVEL:-INFO}"
export PYTHON="${PYTHON:-python3}"
exec "$PYTHON" -m orchestrator run "$@"
