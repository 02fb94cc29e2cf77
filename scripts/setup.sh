#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine with Python 3.11: venv, pinned packages, redis-server.
# Re-runs are fast: pip runs again only when pyproject.toml changed.
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

if ! command -v redis-server >/dev/null 2>&1; then
  echo "setup: installing redis-server"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
