"""Run under torchrun on a dp=2 artifact: train, checkpoint, then make rank 1's copy of the optimizer
state differ from rank 0's through the public API (runner.load's trainer hands out its live
optimizer tensors), train on and checkpoint again. The second save must refuse: rank 0 prints the
line it got and both ranks exit 3. Usage: diverge_replica.py ARTIFACT CHECKPOINT_DIR."""

import sys

import torch
from safetensors.torch import load_file

import runner
from runner.errors import AotError

artifact, folder = sys.argv[1], sys.argv[2]
trainer = runner.load(artifact)
data = load_file(f"{artifact}/data/example_batch.safetensors")
rows = data["targets"].shape[0] // 2
r = trainer.rank
inputs, targets = data["inputs"][r * rows : (r + 1) * rows], data["targets"][r * rows : (r + 1) * rows]
for _ in range(2):
    trainer.step(inputs, targets)
trainer.save(folder)
if r == 1:
    state = trainer.optimizer_state()
    key = sorted(k for k, v in state.items() if v.dim() > 0)[0]
    with torch.no_grad():
        state[key].add_(1e-3)  # a last-bit-sized slip would do; this one is easy to see
trainer.step(inputs, targets)
try:
    trainer.save(folder)
except AotError as e:
    if r == 0:
        print(str(e), flush=True)
    # rank 0's line out before either exits: torchrun stops every rank once one has exited (rank 0
    # was once killed with the line still in its buffer: CI, 2026-12-07)
    torch.distributed.barrier()
    sys.exit(3)
sys.exit(0)
