#!/usr/bin/env bash
# Set up from scratch if needed, then run the whole test suite (real torchrun processes, CPU, gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
python -m pytest -q -p no:cacheprovider --durations=15 "$@"
