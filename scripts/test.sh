#!/usr/bin/env bash
# The README's test command: set up, then run the suite on the CPU. `--fast`: only the fast tier (tests/tiers.py:
# no Ray, no subprocesses, no live deployments). Further arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
if [[ "${1:-}" == "--fast" ]]; then
  shift
  tier=(-m "not slow")
fi
K3SERVE_MOONCAKE="${K3SERVE_MOONCAKE:-auto}" bash scripts/setup.sh  # the Mooncake plane's tests need its wheel
export TRITON_INTERPRET=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -p no:cacheprovider -q --durations=15 "${tier[@]}" "$@" tests
