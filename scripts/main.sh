#!/usr/bin/env bash
# The README's main-job command: set up, make a tiny random checkpoint, and generate through the local
# disaggregated path (prefill TP=2 -> decode TP=1), checked against the single-process reference.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" PYTHONUNBUFFERED=1
exec .venv/bin/python -m k3serve.demo "$@"
