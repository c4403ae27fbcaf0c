#!/usr/bin/env bash
# The main job on an embedded default: build examples/gpt.py for this machine, then train it under
# torchrun and watch the loss fall. One rank per GPU when there are GPUs, else 2 CPU ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  RANKS=$(nvidia-smi -L | wc -l)
else
  RANKS=2
fi
STEPS="${STEPS:-200}"
OUT=artifacts/gpt

python examples/prepare_data.py -o "$OUT-data.safetensors"
aot build examples/gpt.py --world-size "$RANKS" --batch-size 16 --max-steps "$STEPS" -o "$OUT"
aot inspect "$OUT"
torchrun --nproc-per-node "$RANKS" -m aot run "$OUT" --steps "$STEPS" --data "$OUT-data.safetensors" \
  --log-every 20 --save runs/gpt-checkpoint
