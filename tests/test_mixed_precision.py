"""Mixed precision (`aot build --precision`): the artifact trains like eager torch.autocast.

The reference is eager PyTorch on the same model file and data (tests/helpers/ddp_reference.py):
DDP under `torch.autocast("cpu", dtype)` (CPU's rules, as the CPU profile's build traces), with
gradients all-reduced in bf16 for a bf16 reduce (DDP's bf16 compression hook, which needs NCCL), FSDP2's param_dtype emulated by casting
each parameter before the forward, and torch.amp.GradScaler for fp16.

Bounds, measured on this machine (gpt.py, 5 steps), and why they hold: eager bf16 is not
reproducible to the last bit against itself. The same eager run on one rank and on two (the same
arithmetic, gradients summed in another order) differs by 1.7e-5 in losses and 4.8e-3 in the
largest weight difference (fp32: 5e-7 and 1e-6). A last-bit difference in an fp32 weight flips
the rounding of its bf16 copy now and then, which moves activations by bf16's 2^-8, and AdamW
turns a changed near-zero gradient into a full step of the learning rate. The program's
differences from eager are of that kind: the reduction order across ranks, and the traced
optimizer's rounding (a tensor learning rate, foreach kernels; the same numbers up to rounding
in fp32). Measured against eager: losses within 7.1e-5 (dp), 3.7e-5 (fsdp), 5.6e-5 (one rank),
3.2e-4 (tp, whose bf16 partial sums are rounded before the all_reduce instead of once after);
largest weight difference 2.7e-3 (dp), 1.0e-3 (fsdp), 3.8e-3 (one rank), 8.2e-3 (tp); mean
weight difference at most 4.6e-6 (2.2e-5 under tp). The first step's loss (the forward before
any update) is the same to the last bit. Bounds: first loss 1e-6, losses 2e-4, mean weight
difference 1e-5, largest 1e-2 (tp: 1e-3, 1e-3, 5e-5, 2e-2). Eager fp32 is outside them (checked:
first loss 2.1e-5 off, mean weight difference 2.1e-5 after 5 steps on this small model), so the
comparison can fail.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers.commands import EXAMPLES, MODELS, aot, aot_each, ok, torchrun
from helpers.training import STEPS, reference, train_both
from runner.format.artifact import FORMAT_VERSION
from runner.format.checkpoint import merge_checkpoint


def _worst(weights, ref_weights) -> float:
    assert sorted(weights) == sorted(ref_weights)
    return max((weights[k].double() - ref_weights[k].double()).abs().max().item() for k in ref_weights)


def _mean(weights, ref_weights) -> float:
    """The mean absolute difference over every element of every weight."""
    total = sum((weights[k].double() - ref_weights[k].double()).abs().sum().item() for k in ref_weights)
    return total / sum(v.numel() for v in ref_weights.values())


FIRST_LOSS_TOL, LOSS_TOL, MEAN_TOL, WEIGHT_TOL = 1e-6, 2e-4, 1e-5, 1e-2
# (strategy, world, --reduce-dtype, tolerance factor: tp splits the matmuls themselves)
CASES = [("dp=2", 2, "fp32", 1), ("dp=2", 2, "bf16", 1), ("fsdp=2", 2, "fp32", 1), ("fsdp=2", 2, "bf16", 1), ("tp=2", 2, "fp32", 5)]


def _assert_close(losses, ref_losses, weights, ref_weights, factor: int = 1) -> None:
    """Within the bounds of the module docstring; `factor` (tp) widens them, and the first step's
    loss (the forward before any update) then is only as close as the later ones."""
    assert len(losses) == len(ref_losses) == STEPS
    first = FIRST_LOSS_TOL if factor == 1 else factor * LOSS_TOL
    assert abs(losses[0] - ref_losses[0]) <= first, (losses, ref_losses)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= factor * LOSS_TOL, (losses, ref_losses)
    assert _mean(weights, ref_weights) <= factor * MEAN_TOL
    assert _worst(weights, ref_weights) <= 2 * WEIGHT_TOL if factor > 1 else WEIGHT_TOL


# Two cases run in CI and with AOT_TEST_LONG=1 only (the same code paths as their neighbours).
SLOW = {("dp=2", "bf16"), ("fsdp=2", "fp32")}


@pytest.mark.parametrize(
    "strategy,world,reduce_dtype,factor",
    [pytest.param(*c, marks=[pytest.mark.slow] if (c[0], c[2]) in SLOW else [], id=f"{c[0]}-reduce-{c[2]}") for c in CASES],
)
def test_bf16_matches_eager_autocast(strategy, world, reduce_dtype, factor, tmp_path, gpt_data):
    ref_args = ["--precision", "bf16", "--reduce-dtype", reduce_dtype]
    if strategy.startswith("fsdp"):
        ref_args += ["--param-dtype", "bf16"]  # FSDP2's all-gather in bf16
    losses, ref_losses, weights, ref_weights = train_both(
        EXAMPLES / "gpt.py",
        world,
        tmp_path,
        data=gpt_data,
        strategy=strategy,
        build_args=("--topology", "cpu", "--precision", "bf16", "--reduce-dtype", reduce_dtype),
        reference_args=ref_args,
    )
    _assert_close(losses, ref_losses, weights, ref_weights, factor)
    assert all(w.dtype == torch.float32 for w in weights.values())  # fp32 master weights
    assert losses[-1] < losses[0]


def test_bf16_single_rank_within_the_same_bounds_and_not_fp32(tmp_path, gpt_data):
    """One rank: the same bounds hold (nothing is summed across ranks, but the update's rounding
    is still the traced optimizer's), and they are tight enough to fail: eager fp32 is far off."""
    losses, ref_losses, weights, ref_weights = train_both(
        EXAMPLES / "gpt.py", 1, tmp_path, data=gpt_data, build_args=("--topology", "cpu", "--precision", "bf16"), reference_args=["--precision", "bf16"]
    )
    _assert_close(losses, ref_losses, weights, ref_weights)
    fp32 = reference(EXAMPLES / "gpt.py", gpt_data, 1, 4, tmp_path)
    assert abs(losses[0] - json.loads((fp32 / "losses.json").read_text())[0]) > 10 * FIRST_LOSS_TOL
    assert _mean(weights, load_file(fp32 / "state_dict.safetensors")) > MEAN_TOL


FP16_STEPS = 8


def _fp16_run(tmp_path, strategy: str, world: int, steps, resume_at: int | None = None):
    """(losses, loss scales, skipped flags, merged weights) of fp16_overflow.py trained `steps`
    steps under `strategy`, saved and resumed at `resume_at` when given."""
    art, ckpt, metrics = tmp_path / "art", tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    if not art.exists():
        ok(
            aot(
                "build",
                MODELS / "fp16_overflow.py",
                "--world-size",
                world,
                "--strategy",
                strategy,
                "--batch-size",
                4,
                "-o",
                art,
                "--quiet",
                "--no-onnx",
                "--topology",
                "cpu",
            )
        )
    for count, extra in [(resume_at, []), (steps - resume_at, ["--resume", ckpt])] if resume_at else [(steps, [])]:
        ok(torchrun(world, "run", art, "--steps", count, "--metrics", metrics, "--save", ckpt, "--quiet", *extra))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    merge_checkpoint(ckpt, tmp_path / "merged.safetensors")
    return ([r["loss"] for r in records], [r["loss_scale"] for r in records], [r["skipped"] for r in records], load_file(tmp_path / "merged.safetensors"))


def test_fp16_loss_scaling_matches_grad_scaler(tmp_path):
    """fsdp=2: each rank holds half the gradients; found_inf is summed over both, so both skip the
    same steps, and the scale sequence is eager GradScaler's (init 2^19, growth interval 2)."""
    losses, scales, skipped, weights = _fp16_run(tmp_path, "fsdp=2", 2, FP16_STEPS)
    data = tmp_path / "art" / "data" / "example_batch.safetensors"
    ref = reference(MODELS / "fp16_overflow.py", data, 2, 4, tmp_path, extra_args=["--precision", "fp16", "--param-dtype", "fp16"], steps=FP16_STEPS)
    eager = json.loads((ref / "scaler.json").read_text())
    assert scales == eager["scales"]
    assert skipped == eager["skipped"]
    assert any(skipped) and not all(skipped)  # overflows happened, and updates too
    # fp16's rounding amplifies last-bit differences of the update as bf16's does (module docstring);
    # the steps before the first applied update are the same forward: equal to the last bit
    ref_losses, ref_weights = json.loads((ref / "losses.json").read_text()), load_file(ref / "state_dict.safetensors")
    assert losses[:4] == ref_losses[:4]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= LOSS_TOL, (losses, ref_losses)
    assert _mean(weights, ref_weights) <= MEAN_TOL and _worst(weights, ref_weights) <= WEIGHT_TOL


def test_fp16_resume_across_a_skipped_step_is_exact(tmp_path):
    """Stopped after step 5 and resumed: step 6 overflows; the scale, growth tracker, skipped-step
    count and learning-rate position come back from the checkpoint, bit for bit."""
    whole = _fp16_run(tmp_path / "whole", "dp=2", 2, FP16_STEPS)
    (tmp_path / "split").mkdir()
    split = _fp16_run(tmp_path / "split", "dp=2", 2, FP16_STEPS, resume_at=5)
    assert split[1] == whole[1] and split[2] == whole[2] and split[0] == whole[0]
    assert whole[2][5] and not whole[2][4]  # step 6 is a skipped one
    assert all(torch.equal(split[3][k], whole[3][k]) for k in whole[3])


def _softmax_dtypes(artifact) -> set[torch.dtype]:
    from runner.execution.graph_loader import load_graph_module

    manifest = json.loads((artifact / "manifest.json").read_text())
    program = json.loads((artifact / manifest["programs"]["train"]["file"]).read_text())
    values = program["graph_module"]["graph"]["tensor_values"]
    dtypes = {7: torch.float32, 13: torch.bfloat16}
    assert load_graph_module((artifact / manifest["programs"]["train"]["file"]).read_bytes()) is not None
    return {
        dtypes[values[n["outputs"][0]["as_tensor"]["name"]]["dtype"]]
        for n in program["graph_module"]["graph"]["nodes"]
        if n["target"] == "torch.ops.aten._softmax.default"
    }


def test_cuda_profile_traces_cudas_autocast_rules(built):
    """On this CPU-only machine, a bf16 build for an A100 profile carries CUDA's policy (attention's
    softmax upcast to fp32) where the CPU profile's carries CPU's (softmax in bf16), under tensor
    parallelism too, and it runs: every device its program names follows the runner's."""
    cuda, cpu, cuda_tp = built.many(
        *(
            (EXAMPLES / "gpt.py", "--topology", topology, "--world-size", world, "--strategy", strategy, "--precision", "bf16", "--batch-size", 2, "--no-onnx")
            for topology, world, strategy in (("dgx_a100", 1, "dp=1"), ("cpu", 1, "dp=1"), ("dgx_a100", 2, "tp=2"))
        )
    )
    assert _softmax_dtypes(cuda) == {torch.float32}
    assert _softmax_dtypes(cuda_tp) == {torch.float32}
    assert _softmax_dtypes(cpu) == {torch.bfloat16}
    manifest = json.loads((cuda / "manifest.json").read_text())
    assert manifest["precision"]["autocast_rules"] == "cuda" and manifest["format_version"] == FORMAT_VERSION
    ok(aot("run", cuda, "--steps", 2, "--allow-topology-mismatch", "--quiet"))
    ok(torchrun(2, "run", cuda_tp, "--steps", 2, "--allow-topology-mismatch", "--quiet"))


def test_gpu_builds_record_attention_as_the_runners_fused_operator(tmp_path):
    """Built on this CPU for an A100 profile in fp32, transformers' GPT-2 (SDPA) was recorded with
    torch's fused CPU attention kernel (`_scaled_dot_product_flash_attention_for_cpu`), which a GPU
    has no kernel for; held to the math backend instead, it kept every B x H x S x S score for
    backward. GPU builds record it as the runner's aot::attention (runner/execution/attention.py: the
    device's fused kernel at run time), name the op library in the manifest, keep no softmax of
    scores, and train as eager DDP (on CPU ranks here, where the op runs eager's own kernel).

    The step's gradients match eager's to the last bit, not bit for bit (the same without the
    fused operator: the op itself gives eager's values exactly), and AdamW magnifies a last-bit
    difference where a gradient is near zero; GPT-2 has such gradients by construction (its key
    bias has none in exact arithmetic: softmax ignores the q.b_k it adds to a whole row of scores).
    CI saw one element 1.12e-5 off, this machine 5.5e-6: helpers/training.py's AdamW bound."""
    from helpers.training import adamw_lr, assert_same_training

    r = ok(aot("build", MODELS / "hf_gpt2.py", "--topology", "dgx_a100", "--world-size", 1, "--batch-size", 4, "--no-onnx", "-o", tmp_path / "a"))
    assert "math decomposition" not in r.stderr
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["custom_ops"] == {"modules": ["runner.execution.attention"], "ops": ["aot::attention", "aot::attention_backward"]}
    program = json.loads((tmp_path / "a" / manifest["programs"]["train"]["file"]).read_text())
    targets = [n["target"] for n in program["graph_module"]["graph"]["nodes"]]
    assert not [t for t in targets if "for_cpu" in t or "_safe_softmax" in t], sorted(set(targets))
    assert targets.count("torch.ops.aot.attention.default") == 2 and targets.count("torch.ops.aot.attention_backward.default") == 2
    losses, ref_losses, weights, ref_weights = train_both(
        MODELS / "hf_gpt2.py", 1, tmp_path, build_args=("--topology", "dgx_a100"), run_args=("--allow-topology-mismatch",)
    )
    assert_same_training(losses, ref_losses, weights, ref_weights, adamw_lr=adamw_lr(MODELS / "hf_gpt2.py"))


def _plans(r) -> dict[str, dict]:
    """strategy -> plan at 25 MB buckets, of an `aot plan --json` that ran."""
    return {p["strategy"]: p for p in json.loads(ok(r).stdout)["plans"] if p["bucket_mb"] == 25}


@pytest.mark.slow  # a planner scenario (11 s); CI runs it
def test_planner_prices_bf16(tmp_path):
    """bf16 halves the activations the planner sees and fsdp's all-gathers; on a model whose step
    is matmuls (Llama 1B on A100s), the step is priced at the bf16 rate. (On gpt.py, whose step is
    launch-bound on a GPU, bf16's casts make it slower: the planner says so.)"""
    gpt = ("plan", EXAMPLES / "gpt.py", "--topology", "dgx_a100", "--world-size", 8, "--axes", "dp,fsdp", "--batch-size", 64, "--json")
    small = {p: _plans(r) for p, r in zip(("fp32", "bf16"), aot_each(*((*gpt, "--precision", p) for p in ("fp32", "bf16"))))}
    for strategy, plan in small["bf16"].items():
        fp32 = small["fp32"][strategy]
        assert plan["memory_bytes"]["peak"] < 0.9 * fp32["memory_bytes"]["peak"], strategy
        if "fsdp" in strategy:
            assert plan["collective_bytes_per_step"] < 0.8 * fp32["collective_bytes_per_step"], strategy
    llama = ("plan", EXAMPLES / "llama.py", "--topology", "dgx_a100", "--world-size", 8, "--axes", "fsdp", "--batch-size", 1, "--json")
    runs = aot_each(*((*llama, "--precision", p) for p in ("fp32", "bf16")), env={"AOT_SIZE": "1b"})
    big = {p: _plans(r) for p, r in zip(("fp32", "bf16"), runs)}
    assert big["bf16"]["fsdp=8"]["step_s"] < 0.5 * big["fp32"]["fsdp=8"]["step_s"]
