#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine with Python 3.11: venv, pinned packages, redis-server.
# Re-runs are fast: pip runs again only when pyproject.toml changed.
# K3SERVE_MOONCAKE=1 also installs the Mooncake data plane (apt: libibverbs1 librdmacm1 libnuma1, gcc; pip: the
# k3serve[mooncake] extra) and fails if it cannot; K3SERVE_MOONCAKE=auto tries and warns (scripts/test.sh);
# unset or 0: skipped (the default plane, gRPC, needs neither).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do command -v "$cand" >/dev/null 2>&1 && { PY="$cand"; break; }; done
fi
[ -n "$PY" ] || { echo "setup: no python3 found" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $PY"
  "$PY" -m venv .venv
fi

stamp=.venv/.k3serve-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing k3serve and pinned dependencies (torch==2.13.0 CPU wheel where available)"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
  echo "$want" > "$stamp"
fi

MOONCAKE="${K3SERVE_MOONCAKE:-0}"
if [ "$MOONCAKE" != 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  mc_stamp=.venv/.k3serve-mooncake
  if [ ! -f "$mc_stamp" ] || [ "$(cat "$mc_stamp")" != "$want" ]; then
    echo "setup: installing the Mooncake data plane (apt: libibverbs1 librdmacm1 libnuma1; pip: k3serve[mooncake])"
    if { dpkg -s libibverbs1 librdmacm1 libnuma1 >/dev/null 2>&1 || \
         { $SUDO apt-get update -qq >/dev/null && \
           DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 >/dev/null; }; } \
       && .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,mooncake]"; then
      echo "$want" > "$mc_stamp"
    elif [ "$MOONCAKE" = auto ]; then
      echo "setup: WARNING: the Mooncake data plane could not be installed; its tests will report errors (K3SERVE_MOONCAKE=0 skips them)" >&2
    else
      echo "setup: installing the Mooncake data plane failed" >&2; exit 1
    fi
  fi
  # the bind() library that keeps each engine's listeners on its host (k3serve/transfer/mooncake/listeners.py)
  if [ -f "$mc_stamp" ]; then
    if ! { command -v cc >/dev/null 2>&1 || { $SUDO apt-get update -qq >/dev/null && \
             DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcc >/dev/null; }; } \
       || ! .venv/bin/python -m k3serve.transfer.mooncake.listeners >/dev/null; then
      if [ "$MOONCAKE" = auto ]; then
        echo "setup: WARNING: could not build the Mooncake bind() library (needs gcc); Mooncake deployments will refuse to start" >&2
      else
        echo "setup: building the Mooncake bind() library failed (needs gcc)" >&2; exit 1
      fi
    fi
  fi
fi

if ! command -v redis-server >/dev/null 2>&1; then
  echo "setup: installing redis-server"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

# compile the fused MXFP4 CPU kernel once (numba; cached under k3serve/kernels/__pycache__, ~5-15 s the first
# time, ~1 s when cached), so tests and Ray rank actors starting together do not each compile it
if ! ls k3serve/kernels/cpu/__pycache__/mxfp4_moe_cpu.routed_moe_kernel-*.nbi >/dev/null 2>&1; then
  echo "setup: compiling the fused MXFP4 CPU kernel (numba)"
  .venv/bin/python -c "from k3serve.kernels.cpu.mxfp4_moe_cpu import warm_up; warm_up()"
fi

# compile the fused chunked-KDA CPU kernel (numba, kernels/cpu/kda_cpu.py; ~20-40 s the first time, cached under
# k3serve/kernels/cpu/__pycache__): run every time, since loading a fresh cache takes ~2 s and a stale one (the
# kernel's source changed since) is then recompiled here once instead of in every test and Ray rank process
echo "setup: loading (or compiling) the fused chunked-KDA CPU kernel (numba)"
.venv/bin/python -c "from k3serve.kernels.cpu.kda_cpu import warm_up; warm_up()"
