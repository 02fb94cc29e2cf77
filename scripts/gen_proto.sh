#!/usr/bin/env bash
# Regenerate the committed Python code of every .proto under k3serve/proto (pinned grpcio-tools): each file
# lands at its protobuf package path, e.g. k3serve.transfer.v1 -> k3serve/transfer/v1/. --check only compares.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
exec "$PY" -m k3serve.proto.gen "$@"
