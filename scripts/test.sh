#!/usr/bin/env bash
# Set up from scratch if needed, then run the whole test suite (real torchrun processes, CPU, gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
# lint and format first: a minute of pytest is not spent on a tree ruff refuses (pyproject.toml
# [tool.ruff]; `ruff format .` fixes the layout)
python -m ruff check --quiet .
python -m ruff format --check --quiet .
# types of runner/ and aot/ (pyproject.toml [tool.mypy]; a few seconds)
python -m mypy
# Scenarios marked slow (more strategies on the second example model, a second placed mesh) run
# in CI (.ci/run sets AOT_TEST_LONG=1) or when you set it (CI's whole run: 26.7 minutes on 2
# cores on 2026-12-05 at a386743, 25.6 of them tests; without them 10.9 minutes of tests at a816463).
if [ "${AOT_TEST_LONG:-0}" = "1" ]; then
  python -m pytest -q -p no:cacheprovider --durations=15 "$@"
else
  python -m pytest -q -p no:cacheprovider --durations=15 -m "not slow" "$@"
fi
