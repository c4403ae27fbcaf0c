"""One cell of the model zoo (issue #39): a family x strategy, judged against eager's own noise floor.

A cell builds the family's model file (tests/models/zoo/<family>.py) for the strategy, trains it
STEPS steps under torchrun, and compares with eager PyTorch over the same global batch:

- `eager_1`: one process over the whole global batch: what training means;
- eager over as many ranks as the artifact has and over twice as many (DDP; for a bf16 strategy
  with fsdp, FSDP2's MixedPrecisionPolicy, as tests/helpers/ddp_reference.py writes it), the global
  batch split between them. The largest distance between any two of these three eager runs is
  eager's own noise floor: how far the same training moves when only the summation order changes.

The artifact's distance from `eager_1` (max loss difference, max and mean weight difference) must be
at most twice the floor plus a fixed slack for fp32 rounding (SLACK). A build refused in one line
(`aot: error: ...`, exit 1) is a cell too ("refused", with the line); an internal error or a
traceback never is.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from helpers.artifacts import session_cache
from helpers.commands import MODELS, REPO, ok, torchrun
from helpers.training import ADAMW_OUTLIERS, STEPS, adamw_lr, reference
from runner.format.checkpoint import merge_checkpoint

ZOO = MODELS / "zoo"
# transformers' families (tests/models/zoo/families.py), then models written as their projects write them
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3", "phi3", "olmo2", "gpt2", "bert", "t5", "mamba", "resnet")
FAMILIES += ("titan_llama", "nanogpt")
# Families whose step normalizes over the batch (BatchNorm): built with --sync-batchnorm, so that
# training means one process over the global batch, and their floor compares that process with
# itself on the batch's rows in other orders (eager over N ranks would normalize per rank: another
# computation, not another summation order)
BATCH_NORMALIZED = {"resnet": ("--sync-batchnorm",)}
# strategy -> (aot build arguments, ranks, data-parallel ranks, eager reference arguments)
STRATEGIES: dict[str, tuple[tuple, int, int, tuple]] = {
    "dp=2": (("--strategy", "dp=2"), 2, 2, ()),
    "fsdp=2": (("--strategy", "fsdp=2"), 2, 2, ()),
    "tp=2": (("--strategy", "tp=2"), 2, 1, ()),
    "pp=2": (("--strategy", "pp=2"), 2, 1, ()),
    "fsdp=2 bf16": (("--strategy", "fsdp=2", "--topology", "cpu", "--precision", "bf16"), 2, 2, ("--precision", "bf16", "--param-dtype", "bf16")),
}
# Expert parallelism, for the families with experts (tests/test_expert_parallel.py): not in the grid,
# whose other families have none to split
EXPERT_STRATEGIES: dict[str, tuple[tuple, int, int, tuple]] = {
    "ep=2": (("--strategy", "ep=2"), 2, 2, ()),
    "ep=2,fsdp=2": (("--strategy", "ep=2,fsdp=2"), 4, 4, ()),
    "ep=2,dp=2": (("--strategy", "ep=2,dp=2"), 4, 4, ()),
    "pp=2,ep=2": (("--strategy", "pp=2,ep=2"), 4, 2, ()),
    "ep=2,tp=2": (("--strategy", "ep=2,tp=2"), 4, 2, ()),
    "ep=2,fsdp=2 bf16": (("--strategy", "ep=2,fsdp=2", "--topology", "cpu", "--precision", "bf16"), 4, 4, ("--precision", "bf16", "--param-dtype", "bf16")),
}
# Cells with no eager run to judge them by, and why (the table says so in their place)
NO_COUNTERPART = {
    ("resnet", "fsdp=2 bf16"): "no eager counterpart: FSDP2's param_dtype hands BatchNorm a bf16 weight beside its fp32 running "
    "statistics, which torch's CPU batch_norm refuses (expected scalar type BFloat16 but found Float)",
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

    outliers: int = -1  # weight elements beyond the bound that AdamW's noise accounts for (see _outliers)

    def within(self) -> bool:
        """Loss and mean weight within twice the floor plus the slack; the max weight too, but for the
        few elements `_outliers` accepts."""
        bounded = [k for k in SLACK if k != "max_weight" or self.outliers == 0]
        return self.outliers >= 0 and all(self.distance[k] <= 2 * self.floor[k] + SLACK[k] for k in bounded)


def _real(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as float64 (a complex buffer's as its real and imaginary parts)."""
    return torch.view_as_real(t).double() if t.is_complex() else t.double()


def _distance(losses, weights, ref_losses, ref_weights) -> dict:
    diffs = {k: (_real(weights[k]) - _real(ref_weights[k])).abs() for k in ref_weights}
    worst = max(diffs, key=lambda k: diffs[k].max().item())
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "max_weight": diffs[worst].max().item(),
        "mean_weight": sum(d.sum().item() for d in diffs.values()) / sum(d.numel() for d in diffs.values()),
        "worst": worst,
    }


def _outliers(weights: dict, ref_weights: dict, bound: float, model_file: Path) -> int:
    """How many weight elements are further than `bound` from eager_1, where that is AdamW's noise:
    an element whose gradient cancels to near AdamW's eps has its last-bit noise divided by its own
    tiny running size and moves by up to lr a step; which elements those are changes with any change
    of summation order (tensor parallelism's split matmuls change it where data parallelism does
    not, so eager's floor, measured over data-parallel ranks, cannot show the same elements). At most
    1 in 2,000 elements may (helpers/training.py ADAMW_OUTLIERS, the project's rule since tp landed),
    each within what AdamW moves in STEPS steps. -1 where more are, or further, or the optimizer is
    not Adam-family (no such noise): the cell diverged."""
    diffs = [(_real(weights[k]) - _real(ref_weights[k])).abs() for k in ref_weights]
    beyond = sum(int((d > bound).sum()) for d in diffs)
    if beyond == 0:
        return 0
    from helpers.inference import load_user

    make = getattr(load_user(model_file), "optimizer", None)
    optimizer = make([torch.zeros(1, requires_grad=True)]) if make else None
    if optimizer is not None and not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return -1
    lr = optimizer.defaults["lr"] if optimizer is not None else adamw_lr(model_file)
    elements = sum(d.numel() for d in diffs)
    worst = max(d.max().item() for d in diffs)
    return beyond if beyond <= max(1, elements * ADAMW_OUTLIERS) and worst <= 2 * lr * STEPS else -1


def _read(ref: Path) -> tuple[list[float], dict]:
    return json.loads((ref / "losses.json").read_text()), load_file(ref / "state_dict.safetensors")


def run_cell(family: str, strategy: str, tmp_path: Path) -> Cell:
    cell = Cell(family, strategy)
    build_args, world, data_ranks, ref_args = {**STRATEGIES, **EXPERT_STRATEGIES}[strategy]
    model_file = ZOO / f"{family}.py"
    try:
        art = session_cache()(
            model_file, "--world-size", world, "--batch-size", BATCH, "--no-onnx", "--no-eval", *build_args, *BATCH_NORMALIZED.get(family, ())
        )
    except AssertionError as e:  # the build failed: a refusal in one line, or a defect
        cell.status, cell.line = "refused", _refusal(str(e))
        _record(cell)
        return cell
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    ok(torchrun(world, "run", art, "--steps", STEPS, "--metrics", metrics, "--save", ckpt, "--quiet", "--check-replicas", 1))
    merge_checkpoint(ckpt, tmp_path / "merged.safetensors")
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    weights = load_file(tmp_path / "merged.safetensors")
    data = art / "data" / "example_batch.safetensors"
    global_batch = BATCH * data_ranks
    eager_1 = _read(reference(model_file, data, 1, global_batch, tmp_path, extra_args=ref_args))
    cell.distance = _distance(losses, weights, *eager_1)
    # eager over `world` ranks and over twice as many besides one: each run is one draw of the same
    # noise (heavy-tailed: an element whose gradient cancels to near AdamW's eps moves by up to lr
    # when a sum's order changes), and the floor is the largest distance between any two of them
    runs = [eager_1]
    if family in BATCH_NORMALIZED:
        for seed in (1, 2):
            runs.append(_read(reference(model_file, data, 1, global_batch, tmp_path, extra_args=(*ref_args, "--permute-rows", seed))))
    else:
        for ranks in (world, 2 * world):
            if global_batch % ranks == 0:
                runs.append(_read(reference(model_file, data, ranks, global_batch // ranks, tmp_path, extra_args=ref_args)))
    pairs = [_distance(*a, *b) for i, a in enumerate(runs) for b in runs[i + 1 :]]
    cell.floor = {k: max(p[k] for p in pairs) for k in SLACK}
    cell.outliers = _outliers(weights, eager_1[1], 2 * cell.floor["max_weight"] + SLACK["max_weight"], model_file)
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
        # the commit the cell ran at ("-dirty": with uncommitted changes), for the table's claim
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        with open(out, "a") as f:
            f.write(json.dumps({**asdict(cell), "commit": commit}) + "\n")
