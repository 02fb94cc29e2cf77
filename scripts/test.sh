#!/usr/bin/env bash
# The README's test command: set up, then run the whole suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
K3SERVE_MOONCAKE="${K3SERVE_MOONCAKE:-auto}" bash scripts/setup.sh  # the Mooncake plane's tests need its wheel
export TRITON_INTERPRET=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -p no:cacheprovider -q --durations=15 "$@" tests
