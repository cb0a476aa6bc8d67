#!/usr/bin/env bash
# The whole GPU check on a lent device, from a repository checkout and the wheels folder that
# `ringserve gpu-check --prepare WHEELS` made on a machine with network (docs/operations.md):
#   tools/commands/device_check.sh WHEELS [gpu-check flags...]     e.g. --out "$OUT/gpu-check.json"
# Installs the carried wheels offline, then this checkout without touching the image's torch and
# CuPy (--no-deps), then runs gpu-check. PYTHON picks the interpreter (default python3).
set -euo pipefail
wheels=${1:?usage: tools/commands/device_check.sh WHEELS_DIR [gpu-check flags]}
shift
py=${PYTHON:-python3}
cd "$(dirname "$0")/../.."
"$py" -m pip install -q --no-index --no-deps --find-links "$wheels" -r "$wheels/requirements.txt"
"$py" -m pip install -q --no-index --no-deps --no-build-isolation -e .
exec "$py" -m ringserve.cli gpu-check "$@"
