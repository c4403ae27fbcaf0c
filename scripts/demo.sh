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

# the text as llm.c token shards: its first 90% to train on, its last 10% for the validation loss
python examples/prepare_data.py -o "$OUT-data.safetensors" --tokens "$OUT-train.bin" --val-tokens "$OUT-val.bin"
aot build examples/gpt.py --world-size "$RANKS" --batch-size 16 --max-steps "$STEPS" -o "$OUT"
aot inspect "$OUT"
torchrun --nproc-per-node "$RANKS" -m aot run "$OUT" --steps "$STEPS" --data "$OUT-train.bin" --shuffle 0 \
  --eval-data "$OUT-val.bin" --eval-every 50 --eval-batches 1 --log-every 20 --save runs/gpt-checkpoint
