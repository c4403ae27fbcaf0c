"""Replicas never drift apart in silence (issue #39).

- The build proves, from the captured graph, how every mesh axis holds each parameter: sharded,
  reduced (its update passes through a collective over the axis) or identical (nothing that
  differs between the axis's ranks reaches it), aot/capture/replicas.py. A weight tp keeps whole
  whose gradient is a per-rank part of a sum is found and summed over tp; one no reduction serves
  is refused, and so is any parameter the proof cannot account for.
- The run compares the copies: `aot run --check-replicas N` every N steps and every save
  (runner/execution/replica_check.py); a difference stops the run in one line, the last good checkpoint kept.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.commands import EXAMPLES, MODELS, REPO, aot, ok, torchrun
from helpers.training import STEPS, TOL, adamw_lr, assert_same_training, train_both


def test_a_whole_weight_with_a_per_rank_gradient_is_summed_over_tp(tmp_path):
    losses, ref_losses, weights, ref_weights = train_both(MODELS / "per_rank_gain.py", 2, tmp_path, strategy="tp=2")
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["tensor_parallel"]["summed"] == ["gain"]
    assert manifest["replicas"]["params"]["gain"] == {"tp": "reduced"}
    assert manifest["replicas"]["params"]["up.weight"] == {"tp": "sharded"}
    assert_same_training(losses, ref_losses, weights, ref_weights, weight_tol=2 * TOL, adamw_lr=adamw_lr(MODELS / "per_rank_gain.py"))
    shown = ok(aot("inspect", tmp_path / "art")).stdout
    assert "replicas   tp: 4 reduced, 3 sharded (proved from the graph at build)" in shown


def test_a_clipped_step_sums_only_the_weights_whose_own_gradient_is_a_part(tmp_path):
    """With a global-norm clip, the gain's unsummed part makes the norm, and so every update,
    differ between tp ranks in the first trace: the proof reads each weight's own gradient (the
    clipping coefficient taken as shared) and its forward uses from the forward's values. Summing
    `head` or `down.bias` too (as it once did: they meet a bias, or a split value, in forward)
    would count their gradients twice: the training is eager's."""
    model = MODELS / "per_rank_gain_clipped.py"
    losses, ref_losses, weights, ref_weights = train_both(model, 2, tmp_path, strategy="tp=2")
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["tensor_parallel"]["summed"] == ["gain"]
    assert_same_training(losses, ref_losses, weights, ref_weights, weight_tol=2 * TOL, adamw_lr=adamw_lr(model))


def test_a_whole_weight_no_reduction_serves_is_refused_at_build(tmp_path):
    out = tmp_path / "art"
    r = aot("build", MODELS / "per_rank_gain.py", "--strategy", "tp=2", "--batch-size", 4, "--no-onnx", "-o", out, "--quiet", env={"AOT_GAIN_ON_INPUT": "1"})
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    expected = "aot: error: per_rank_gain.py: parameter gain is kept whole under tp but used both on values split"
    assert len(lines) == 1 and lines[0].startswith(expected), r.stderr
    assert not out.exists()


def test_a_tp_plan_sum_over_a_weight_every_rank_uses_alike_is_refused(tmp_path):
    """tp_plan's "replicated_with_grad_allreduce" is checked like a found sum: `head` runs on the
    whole activation every tp rank holds, so summing its gradient would count it twice."""
    out = tmp_path / "art"
    r = aot("build", MODELS / "per_rank_gain.py", "--strategy", "tp=2", "--batch-size", 4, "--no-onnx", "-o", out, "--quiet", env={"AOT_SUMMED": "head"})
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert 'tp_plan makes head.weight "replicated_with_grad_allreduce", but it is used on values every tp rank holds alike' in r.stderr, r.stderr
    assert not out.exists()


def test_the_proof_refuses_a_gradient_left_unreduced():
    """The proof on a real capture (examples/mlp.py at dp=2) holds; with the gradient all_reduce of
    one weight cut out of the graph it names that weight and the axis."""
    from pathlib import Path

    from aot.capture.model_file import load_model_file
    from aot.capture.replicas import prove_step
    from aot.capture.step import Group, StepLayout, capture_step
    from aot.capture.training_state import build_training_state
    from aot.errors import AotError
    from runner.execution.data import split_batch_tensors

    mf = load_model_file(Path(EXAMPLES / "mlp.py"))
    state = build_training_state(mf, 0, 10)
    inputs, targets = split_batch_tensors(mf.example_batch(4), "batch()")
    layout = StepLayout(dp=Group("aot.dp", 2))
    captured = capture_step(mf, state, inputs, targets, layout)
    assert captured.replicas is not None
    assert {h["dp"] for h in captured.replicas.params.values()} == {"reduced"}
    graph = captured.graph.graph
    reduces = [n for n in graph.nodes if n.op == "call_function" and n.target == torch.ops._c10d_functional.all_reduce.default]
    # before the passes bucket them, each gradient has its own all_reduce: the first is the first weight's
    wait = next(iter(reduces[0].users))
    wait.replace_all_uses_with(reduces[0].args[0])
    with pytest.raises(AotError, match=r"would differ between the ranks of dp: it is not sharded over dp, its gradient is not reduced"):
        prove_step(graph, captured.slots, layout, set(), "")


def test_replica_checks_pass_on_a_healthy_run_and_stop_a_diverged_one(tmp_path):
    art, ckpt = tmp_path / "art", tmp_path / "ckpt"
    ok(aot("build", EXAMPLES / "mlp.py", "--world-size", 2, "--batch-size", 4, "--no-onnx", "-o", art, "--quiet"))
    ok(torchrun(2, "run", art, "--steps", STEPS, "--check-replicas", 1, "--save", ckpt, "--quiet"))
    # a rank's copy made to differ: the next save refuses in one line, the checkpoint of step 2 stays
    again = tmp_path / "again"
    r = torchrun(2, REPO / "tests" / "helpers" / "diverge_replica.py", art, again, module=None)
    assert r.returncode != 0
    line = [x for x in r.stdout.splitlines() if x.startswith("replica check")]
    assert len(line) == 1 and "differs between ranks 0 and 1, which hold copies of it over dp" in line[0], r.stdout + r.stderr
    assert json.loads((again / "checkpoint.json").read_text())["step"] == 2


def test_adams_bias_corrections_are_computed_as_eager_computes_them(tmp_path):
    """Traced, torch.optim's Adam computes `1 - beta2 ** step` from its float32 step counter as a
    tensor, five digits short at step 1; eager computes it from `step.item()` in double precision.
    The step widens the counter while the optimizer runs: on one rank, aot's run equals eager's to
    the last bit of the loss (before: 3e-6 off by step 5, and 2.6e-8 of mean weight)."""
    from safetensors.torch import load_file

    from helpers.training import eager_single_process
    from runner.format.checkpoint import merge_checkpoint

    model_file = MODELS / "zoo" / "qwen2.py"
    art, ckpt, metrics = tmp_path / "art", tmp_path / "ckpt", tmp_path / "m.jsonl"
    ok(aot("build", model_file, "--world-size", 1, "--batch-size", 8, "--no-onnx", "-o", art, "--quiet"))
    ok(torchrun(1, "run", art, "--steps", STEPS, "--metrics", metrics, "--save", ckpt, "--quiet"))
    data = load_file(art / "data" / "example_batch.safetensors")
    ref_losses, ref_state = eager_single_process(model_file, [([data["inputs"]], data["targets"])] * STEPS)
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    merge_checkpoint(ckpt, tmp_path / "merged.safetensors")
    weights = load_file(tmp_path / "merged.safetensors")
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 5e-7, (losses, ref_losses)
    diffs = [(weights[k].double() - ref_state[k].double()).abs() for k in ref_state]
    assert sum(d.sum().item() for d in diffs) / sum(d.numel() for d in diffs) < 2e-9
