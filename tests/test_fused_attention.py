"""The runner's fused attention (runner/execution/attention.py) and when the capture records it
(aot/capture/fused_attention.py). Builds and training against eager: test_mixed_precision.py
(transformers' GPT-2 for an A100 profile) and, for the compiled tier, the slow test below."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers.commands import MODELS, aot, ok
from torch.fx.experimental.proxy_tensor import make_fx

import runner.execution.attention  # noqa: F401  (registers the operators)
from aot.capture.fused_attention import FusedAttention

B, H, S, D = 2, 3, 16, 8


def _qkv(dtype=torch.float32, transposed=False):
    """q, k, v leaves; `transposed`: laid out [B, S, H, D] and viewed as [B, H, S, D], as models make them."""
    g = torch.Generator().manual_seed(0)
    if transposed:
        return [torch.randn(B, S, H, D, generator=g, dtype=dtype).transpose(1, 2).detach().requires_grad_(True) for _ in range(3)]
    return [torch.randn(B, H, S, D, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]


def _grads(fn, q, k, v):
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    return out, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["causal", "bool", "float", None])
def test_attention_and_its_backward_equal_torchs_sdpa(dtype, mask):
    """Bit for bit on the CPU: both run torch's own kernel (the backward recomputes the forward and
    differentiates it); outputs are contiguous whatever layout the inputs have."""
    causal = mask == "causal"
    m = None
    if mask == "bool":
        m = torch.ones(S, S, dtype=torch.bool).tril()[None, None].expand(B, 1, S, S)
    elif mask == "float":
        m = torch.randn(B, 1, S, S, generator=torch.Generator().manual_seed(1), dtype=dtype)
    q, k, v = _qkv(dtype, transposed=True)
    out, grads = _grads(lambda q, k, v: torch.ops.aot.attention(q, k, v, m, causal, D**-0.5), q, k, v)
    ref, ref_grads = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, scale=D**-0.5), q, k, v)
    assert torch.equal(out, ref)
    for name, a, b in zip("qkv", grads, ref_grads):
        assert torch.equal(a, b), name
        assert a.is_contiguous(), name
    assert out.is_contiguous() and out.dtype == dtype


def test_the_cost_model_prices_it_as_a_matmul():
    """FLOPs from torch's SDPA formulas (the backward adds its recomputed forward), in the GPU
    model's matmul class."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    from aot.plan.step_reading import node_op
    from aot.plan.gpu_model import MATMUL, op_class

    q, k, v = _qkv()
    gm = make_fx(lambda q, k, v: torch.autograd.grad(torch.ops.aot.attention(q, k, v, None, True, 0.5).sum(), (q, k, v)), tracing_mode="fake")(q, k, v)
    ops = {n.target: node_op(n) for n in gm.graph.nodes if n.op == "call_function" and "aot" in str(n.target)}
    shape = (B, H, S, D)
    forward, backward = ops[torch.ops.aot.attention.default], ops[torch.ops.aot.attention_backward.default]
    assert forward.flops == sdpa_flop_count(shape, shape, shape) > 0
    assert backward.flops == sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
    assert op_class("attention", forward.flops) == op_class("attention_backward", backward.flops) == MATMUL


def _traced(call, cast_to=None, dtype=torch.float32):
    q, k, v = _qkv(dtype)

    def step(q, k, v):
        with FusedAttention(cast_to):
            out = call(q, k, v)
        return torch.autograd.grad(out.sum(), (q, k, v))

    return {str(n.target) for n in make_fx(step)(q, k, v).graph.nodes if n.op == "call_function"}


def test_the_capture_records_plain_attention_as_the_fused_operator():
    targets = _traced(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert {"aot.attention.default", "aot.attention_backward.default"} <= targets
    assert not [t for t in targets if "softmax" in t or "for_cpu" in t], targets
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    assert "aot.attention.default" in _traced(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_the_capture_casts_inputs_as_the_targets_autocast_would():
    """Under a target's bf16 autocast SDPA runs in bf16 (CUDA's policy casts its inputs down); the
    mode sees the call before autocast, so it casts them itself."""
    q, k, v = _qkv()

    def step(q, k, v):
        with FusedAttention(torch.bfloat16):
            return F.scaled_dot_product_attention(q, k, v)

    gm = make_fx(step)(q, k, v)
    call = next(n for n in gm.graph.nodes if n.target == torch.ops.aot.attention.default)
    assert [a.meta["val"].dtype for a in call.args[:3]] == [torch.bfloat16] * 3


@pytest.mark.parametrize(
    "why, call",
    [
        ("dropout", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)),
        ("a mask that takes a gradient", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=q[:, :1, :, :1] * 0)),
        ("grouped-query broadcasting", lambda q, k, v: F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], enable_gqa=True)),
    ],
)
def test_calls_the_fused_operator_cannot_compute_keep_torchs_attention(why, call):
    targets = _traced(call)
    assert "aot.attention.default" not in targets, why


@pytest.mark.slow  # an AOTInductor build (about 25 s on 2 cores); CI runs it
def test_the_compiled_tier_calls_the_fused_operator(tmp_path):
    """AOTInductor compiles aot::attention as a call back into the operator (the runner imports its
    library before loading the package): the compiled tier trains as the portable one."""
    art = tmp_path / "art"
    ok(aot("build", MODELS / "hf_gpt2.py", "--topology", "dgx_a100", "--world-size", 1, "--batch-size", 4, "--no-onnx", "--compile", "aoti", "-o", art))
    assert json.loads((art / "manifest.json").read_text())["custom_ops"]["modules"] == ["runner.execution.attention"]
    losses = {}
    for tier in ("compiled", "portable"):
        metrics = tmp_path / f"{tier}.jsonl"
        ok(aot("run", art, "--steps", 3, "--tier", tier, "--metrics", metrics, "--allow-topology-mismatch"))
        losses[tier] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert losses["compiled"] == pytest.approx(losses["portable"], abs=1e-5), losses
    assert losses["compiled"][-1] < losses["compiled"][0]


@pytest.mark.slow  # two torchruns of 2 ranks (10 s); CI runs it
def test_tensor_parallel_attention_is_fused_per_head_and_trains_as_eager_ddp(tmp_path):
    """Under tp=2 each rank's q, k, v hold half the heads (DTensor shards the pair by heads, see
    aot/capture/fused_attention.py): the program calls the fused operator on its local heads, and
    trains as eager DDP within tp's bound."""
    from helpers.training import TOL, adamw_lr, assert_same_training, train_both

    losses, ref_losses, merged, ref_weights = train_both(
        MODELS / "hf_gpt2.py", 2, tmp_path, strategy="tp=2", build_args=("--topology", "dgx_a100"), run_args=("--allow-topology-mismatch",)
    )
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    program = json.loads((tmp_path / "art" / manifest["programs"]["train"]["file"]).read_text())
    graph = program["graph_module"]["graph"]
    calls = [n for n in graph["nodes"] if n["target"] == "torch.ops.aot.attention.default"]
    assert len(calls) == 2
    q = graph["tensor_values"][calls[0]["inputs"][0]["arg"]["as_tensor"]["name"]]
    assert [d["as_int"] for d in q["sizes"]][1] == 2  # 4 heads over 2 ranks
    assert_same_training(losses, ref_losses, merged, ref_weights, weight_tol=2 * TOL, adamw_lr=adamw_lr(MODELS / "hf_gpt2.py"))
