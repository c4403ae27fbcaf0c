"""One cell of the model zoo (issue #39): a family x strategy, judged against eager's own noise floor.

A cell builds the family's model file (tests/models/zoo/<family>.py) for the strategy, trains it
STEPS steps under torchrun, and compares with eager PyTorch over the same global batch:

- `eager_1`: one process over the whole global batch: what training means;
- `eager_n`: eager over as many ranks as the artifact has (DDP; for a bf16 strategy with fsdp,
  FSDP2's MixedPrecisionPolicy, as tests/helpers/ddp_reference.py writes it), the global batch
  split between them. Its distance from `eager_1` is eager's own noise floor: how far the same
  training moves when only the summation order changes.

The artifact's distance from `eager_1` (max loss difference, max and mean weight difference) must be
at most twice the floor plus a fixed slack for fp32 rounding (SLACK). A build refused in one line
(`aot: error: ...`, exit 1) is a cell too ("refused", with the line); an internal error or a
traceback never is.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from safetensors.torch import load_file

from helpers.artifacts import session_cache
from helpers.commands import MODELS, ok, torchrun
from helpers.training import STEPS, reference
from runner.checkpoint import merge_checkpoint

ZOO = MODELS / "zoo"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3", "phi3", "olmo2", "gpt2", "bert", "t5", "mamba")
# strategy -> (aot build arguments, ranks, data-parallel ranks, eager reference arguments)
STRATEGIES: dict[str, tuple[tuple, int, int, tuple]] = {
    "dp=2": (("--strategy", "dp=2"), 2, 2, ()),
    "fsdp=2": (("--strategy", "fsdp=2"), 2, 2, ()),
    "tp=2": (("--strategy", "tp=2"), 2, 1, ()),
    "pp=2": (("--strategy", "pp=2"), 2, 1, ()),
    "fsdp=2 bf16": (("--strategy", "fsdp=2", "--topology", "cpu", "--precision", "bf16"), 2, 2, ("--precision", "bf16", "--param-dtype", "bf16")),
}
BATCH = 4  # per data-parallel rank
# fp32 rounding the floor may not show on one run (a last bit flipped elsewhere): weights, losses
SLACK = {"loss": 1e-6, "max_weight": 1e-6, "mean_weight": 1e-7}


@dataclass
class Cell:
    family: str
    strategy: str
    status: str = ""  # equal | refused | diverged
    line: str = ""  # the refusal a user sees
    distance: dict = field(default_factory=dict)  # the artifact against eager_1
    floor: dict = field(default_factory=dict)  # eager_n against eager_1

    def within(self) -> bool:
        return all(self.distance[k] <= 2 * self.floor[k] + SLACK[k] for k in SLACK)


def _distance(losses, ref_losses, weights, ref_weights) -> dict:
    diffs = [(weights[k].double() - ref_weights[k].double()).abs() for k in ref_weights]
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "max_weight": max(d.max().item() for d in diffs),
        "mean_weight": sum(d.sum().item() for d in diffs) / sum(d.numel() for d in diffs),
    }


def _read(ref: Path) -> tuple[list[float], dict]:
    return json.loads((ref / "losses.json").read_text()), load_file(ref / "state_dict.safetensors")


def run_cell(family: str, strategy: str, tmp_path: Path) -> Cell:
    cell = Cell(family, strategy)
    build_args, world, data_ranks, ref_args = STRATEGIES[strategy]
    model_file = ZOO / f"{family}.py"
    try:
        art = session_cache()(model_file, "--world-size", world, "--batch-size", BATCH, "--no-onnx", *build_args)
    except AssertionError as e:  # the build failed: a refusal in one line, or a defect
        cell.status, cell.line = "refused", _refusal(str(e))
        return cell
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    ok(torchrun(world, "run", art, "--steps", STEPS, "--metrics", metrics, "--save", ckpt, "--quiet", "--check-replicas", 1))
    merge_checkpoint(ckpt, tmp_path / "merged.safetensors")
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    weights = load_file(tmp_path / "merged.safetensors")
    data = art / "data" / "example_batch.safetensors"
    global_batch = BATCH * data_ranks
    eager_1 = _read(reference(model_file, data, 1, global_batch, tmp_path, extra_args=ref_args))
    eager_n = _read(reference(model_file, data, world, global_batch // world, tmp_path, extra_args=ref_args))
    cell.distance = _distance(losses, eager_1[0], weights, eager_1[1])
    cell.floor = _distance(eager_n[0], eager_1[0], eager_n[1], eager_1[1])
    cell.status = "equal" if cell.within() else "diverged"
    _record(cell)
    return cell


def _refusal(failure: str) -> str:
    """The refusal line of a failed build's output (helpers.commands.show), checked to be one line
    of aot's own: an internal error or a traceback is a defect, never a refusal."""
    stderr = failure.split("--- stderr ---", 1)[-1].strip().splitlines()
    errors = [line for line in stderr if line.startswith("aot: ")]
    assert len(errors) == 1 and "internal error" not in errors[0] and "Traceback" not in failure, failure
    return errors[0]


def _record(cell: Cell) -> None:
    """With AOT_ZOO_RESULTS=FILE, append the cell (one JSON line) for scripts/zoo_table.py."""
    out = os.environ.get("AOT_ZOO_RESULTS")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(asdict(cell)) + "\n")
