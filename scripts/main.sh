#!/usr/bin/env bash
# The README's main-job command: set up, then start the embedded deployment (local Ray, a private redis-server,
# 3 clusters of the tiny preset with prefill TP=2 / decode TP=1, 2 routers), run 24 multi-turn sessions through
# the routers, kill cluster c1 mid-run, check every output against the single-process reference, print the
# drill report and exit 0 only if no request failed and no token differed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2  # set-up's progress on stderr: stdout is the drill report, JSON alone
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONUNBUFFERED=1 RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
exec .venv/bin/k3serve drill --config configs/local.yaml --kill cluster:c1 --at 4 --sessions 24 --turns 3 \
  --max-tokens 24 --json "$@"
