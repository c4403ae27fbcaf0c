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
# in CI (.ci/run sets AOT_TEST_LONG=1) or when you set it.
selected="not slow"
if [ "${AOT_TEST_LONG:-0}" = "1" ]; then
  selected="slow or not slow"
fi
# Two test files at a time (pytest-xdist, a file's tests on one worker so that they share their
# builds): a build is one core's work and this machine has two. AOT_TEST_WORKERS=1: one at a time.
# CI's whole run on 2 cores: 26.7 minutes one at a time at a386743, 17.3 two at a time at 7ac8c90.
workers=(-n "${AOT_TEST_WORKERS:-2}" --dist loadfile)
python -m pytest -q -p no:cacheprovider --durations=15 "${workers[@]}" -m "($selected) and not alone" "$@"
# Then the tests that measure this machine's speed, with nothing beside them (exit 5: none selected)
status=0
python -m pytest -q -p no:cacheprovider -m "($selected) and alone" "$@" || status=$?
[ "$status" = 0 ] || [ "$status" = 5 ]
