#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment with everything aot and its tests need.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${AOT_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating virtual environment $VENV" >&2
  python3 -m venv "$VENV"
fi
# torch is pinned to the release the artifact format is tested with. On machines without a GPU
# install a CPU build: a bare `torch` pulls a CUDA build of several GB. Set AOT_TORCH_INDEX to a
# wheel index (e.g. PyTorch's CPU index) where the default index would give a CUDA build.
echo "setup: installing torch 2.13.0 and aot into $VENV (quiet; first run takes a few minutes)" >&2
"$VENV/bin/python" -m pip install -q --disable-pip-version-check ${AOT_TORCH_INDEX:+--index-url "$AOT_TORCH_INDEX"} "torch==2.13.0"
# onnxruntime and onnxruntime-gpu install the same `onnxruntime` module and clobber each other's
# files: where pyproject.toml asks for onnxruntime-gpu (Linux x86-64), drop a CPU-only one first.
if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] && "$VENV/bin/python" -m pip show onnxruntime >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip uninstall -y -q onnxruntime onnxruntime-gpu
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
export PATH="$PWD/$VENV/bin:$PATH"
