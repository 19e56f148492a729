#!/usr/bin/env bash
# Every CUDA check of mmoe in one command, within 8 minutes on one GPU (scripts/gpu_check.py says what runs):
#   bash scripts/gpu_check.sh [--out runs/gpu_check/results.json] [--only NAME ...] [--dry-run]
# Creates .venv/ first (scripts/setup.sh) only where it is missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$root/.venv/bin/python" ]; then
    bash "$root/scripts/setup.sh"
fi
exec "$root/.venv/bin/python" "$root/scripts/gpu_check.py" "$@"
