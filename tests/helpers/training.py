"""Train a model file twice, as a built artifact under torchrun and as eager DDP, and compare.

`train_both` builds the model file (extra `aot build` / `aot run` arguments allowed: a topology
profile, the --allow-topology-mismatch a GPU profile needs on this CPU machine; the build is the
session's, helpers/artifacts.py, shared with every test that builds the same), trains it under
torchrun, and trains the same model file with plain DDP (tests/helpers/ddp_reference.py) on the
same data. A reference run depends only on the model file, the data, the number of data-parallel
ranks and the batch size, so each distinct one runs once per test session and is shared: the
strategy matrix compares a dozen builds against three references per model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from helpers.artifacts import session_cache
from helpers.commands import REFERENCE, ok, torchrun
from helpers.inference import load_user
from runner.format.checkpoint import merge_checkpoint

TOL = 1e-5
STEPS = 5


def tp_degree(strategy: str | None) -> int:
    return degree(strategy, "tp")


def degree(strategy: str | None, axis: str) -> int:
    degrees = dict(part.split("=") for part in strategy.split(",")) if strategy else {}
    return int(degrees.get(axis, 1))


def train_both(
    model_file, world, tmp_path, data=None, batch_size=4, strategy=None, build_args=(), run_args=(), init_from=None, reference_init=None, reference_args=()
):
    """(losses, reference losses, merged weights, reference weights) after STEPS steps of each.
    `init_from`: the artifact starts from these weights (`aot run --init-from`), and the
    reference from `reference_init` (a safetensors state_dict; default: the same path).
    `reference_args`: more ddp_reference.py options (its mixed precision: --precision, ...)."""
    art, ckpt = tmp_path / "art", tmp_path / "ckpt"
    # the session's build (read-only), linked as tmp_path/art for the caller to read; --no-onnx: the
    # inference export has its own tests (test_onnx.py), this compares training only;
    # --no-eval: the eval program has its own tests (test_evaluation.py; every model file builds one in test_model_code.py)
    build = ("--world-size", world, "--batch-size", batch_size, "--no-onnx", "--no-eval", *(["--strategy", strategy] if strategy else []), *build_args)
    art.symlink_to(session_cache()(model_file, *build))
    metrics = tmp_path / "metrics.jsonl"
    args = [
        "run",
        art,
        "--steps",
        STEPS,
        "--metrics",
        metrics,
        "--save",
        ckpt,
        "--quiet",
        *run_args,
        *(["--init-from", init_from] if init_from is not None else []),
    ]
    if data is not None:
        args += ["--data", data]
    ok(torchrun(world, *args))
    data_file = data if data is not None else art / "data" / "example_batch.safetensors"
    # Tensor-parallel ranks and pipeline stages share a batch: the reference has one process per
    # data-parallel rank.
    ref = reference(
        model_file, data_file, world // tp_degree(strategy) // degree(strategy, "pp"), batch_size, tmp_path, reference_init or init_from, reference_args
    )
    merge_checkpoint(ckpt, tmp_path / "merged.safetensors")  # what `aot checkpoint merge` runs (tested on its own)
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    return losses, json.loads((ref / "losses.json").read_text()), load_file(tmp_path / "merged.safetensors"), load_file(ref / "state_dict.safetensors")


def reference(model_file, data_file, world: int, batch_size: int, tmp_path: Path, init_from=None, extra_args=(), steps: int = STEPS) -> Path:
    """The folder of eager DDP's run (losses.json, state_dict.safetensors) on `world` ranks; run
    once per session for each model file, data content, initial weights, world and batch size."""
    start = Path(init_from).read_bytes() if init_from is not None else b""
    digest = hashlib.sha256(Path(model_file).read_bytes() + Path(data_file).read_bytes() + start + " ".join(map(str, extra_args)).encode()).hexdigest()[:16]
    # tmp_path's parent is the session's base folder: the cache lives and goes with it
    ref = tmp_path.parent / "ddp-references" / f"{Path(model_file).stem}-{digest}-w{world}-b{batch_size}-s{steps}"
    if not (ref / "state_dict.safetensors").is_file():
        staging = ref.with_name(ref.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        args = (
            REFERENCE,
            model_file,
            data_file,
            staging,
            "--steps",
            steps,
            "--batch-size",
            batch_size,
            *(["--init-from", init_from] if init_from is not None else []),
            *extra_args,
        )
        r = torchrun(world, *args, module=None)
        if r.returncode != 0 and "Signal 6 (SIGABRT)" in r.stderr:
            # eager FSDP2 under gloo once aborted in teardown ("terminate called without an active
            # exception") on a loaded machine: the reference is torch's, not ours; run it again once
            shutil.rmtree(staging, ignore_errors=True)
            r = torchrun(world, *args, module=None)
        ok(r)
        staging.rename(ref)
    return ref


def eager_single_process(model_file, batches, seed: int = 0) -> tuple[list[float], dict]:
    """Plain eager training in this process, the reference of one-rank artifact runs: the model
    file's `model()` after `torch.manual_seed(seed)` (a build's default seed), its optimizer and its
    loss (cross-entropy by default), one step per (inputs, targets) of `batches`. Returns the
    losses and the state_dict after the last step."""
    user = load_user(Path(model_file))
    torch.manual_seed(seed)
    model = user.model()
    opt = user.optimizer(model.parameters()) if hasattr(user, "optimizer") else torch.optim.AdamW(model.parameters(), lr=1e-3)  # aot's default
    loss_fn = getattr(user, "loss", torch.nn.functional.cross_entropy)
    losses = []
    for inputs, targets in batches:
        opt.zero_grad()
        loss = loss_fn(model(*inputs), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


# At most this share of a model's elements may leave the weight bound when AdamW meets split
# matmuls (assert_same_training's adamw_lr); a wrong split moves whole rows, columns or heads.
ADAMW_OUTLIERS = 1 / 2000


def adamw_lr(model_file) -> float:
    """The base learning rate of the model file's optimizer (aot's default AdamW when it has none)."""
    from aot.capture.model_file import default_optimizer

    make = getattr(load_user(Path(model_file)), "optimizer", default_optimizer)
    return make([torch.zeros(1, requires_grad=True)]).defaults["lr"]


def assert_same_training(losses, ref_losses, weights, ref_weights, weight_tol=TOL, adamw_lr=None):
    """Losses within TOL at every step and every weight within `weight_tol` of the reference.

    `adamw_lr`: the run's AdamW learning rate, for builds whose matmuls sum in another order than
    eager's (tp splits them). The last-bit difference is harmless except where an element's
    gradient is itself near zero, a difference of rounding noise: AdamW divides each gradient by
    its own running size and turns that noise into a step of up to lr. Which elements those are
    depends on the data and on how each machine's BLAS splits its sums (CI once saw 1 element of
    90,432 in a Llama MLP 2.6e-5 off, the rest within 1e-5). Then at most ADAMW_OUTLIERS of the
    elements may exceed `weight_tol`, each by no more than AdamW can move it in STEPS steps."""
    assert len(losses) == len(ref_losses) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (losses, ref_losses)
    assert sorted(weights) == sorted(ref_weights)
    diffs = {k: (weights[k].double() - ref_weights[k].double()).abs() for k in ref_weights}
    worst, name = max((d.max().item(), k) for k, d in diffs.items())
    if adamw_lr is None:
        assert worst <= weight_tol, f"{name} differs by {worst:.3g} (bound {weight_tol:g})"
    else:
        outside = {k: int((d > weight_tol).sum()) for k, d in diffs.items() if (d > weight_tol).any()}
        elements = sum(d.numel() for d in diffs.values())
        assert sum(outside.values()) <= max(1, elements * ADAMW_OUTLIERS), f"{outside} elements beyond {weight_tol:g} of {elements}"
        assert worst <= 2 * adamw_lr * STEPS, f"{name} differs by {worst:.3g}, more than AdamW's steps can move it"
    # the run really trained: weights moved away from their initial values and the loss fell
    assert losses[-1] < losses[0]
