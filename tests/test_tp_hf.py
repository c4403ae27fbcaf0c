"""Tensor parallelism on transformers' own models: the finder splits their attention (RoPE's
slice and cat, grouped-query heads) and MLPs as Megatron does, training equals eager DDP, and the
build says what it left whole and why.

The models are transformers' LlamaForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel and
MixtralForCausalLM at tiny sizes (tests/models/hf_*.py), traced as transformers writes them. The
references are eager DDP over the data-parallel ranks (tests/helpers/ddp_reference.py), as for
every tp test. GPT-2's q, k and v come from one fused Conv1D (`c_attn`, weight stored (in, out))
whose output the attention splits in three: each rank holds its slice of each third (format 6,
`tensor_parallel.fused`).
"""

from __future__ import annotations

import json

import pytest
import torch

from safetensors.torch import save_file

from helpers.commands import MODELS, aot, ok, show
from helpers.training import STEPS, TOL, adamw_lr, assert_same_training, train_both

LAYERS = 2


def attention_and_mlp_plan(prefix: str = "model.model.layers") -> dict[str, str]:
    """What Megatron splits in a Llama-family decoder layer: q, k, v and the MLP's gate and up
    projections column-wise, the attention output and the MLP's down projection row-wise."""
    plan = {}
    for i in range(LAYERS):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{prefix}.{i}.{name}"] = "colwise"
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{prefix}.{i}.{name}"] = "rowwise"
    return plan


# Llama and Qwen2 trace alike (Qwen2 adds q/k/v biases); one of them runs each mesh
@pytest.mark.parametrize(
    "model,strategy,world",
    [("hf_llama.py", "tp=2", 2), pytest.param("hf_qwen2.py", "dp=2,tp=2", 4, marks=pytest.mark.slow)],
)
def test_attention_is_split_and_training_matches_ddp(model, strategy, world, tmp_path):
    losses, ref_losses, weights, ref_weights = train_both(MODELS / model, world, tmp_path, strategy=strategy)
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["tensor_parallel"]["plan"] == attention_and_mlp_plan()
    # k and v have 2 heads of 16 features: each rank holds one key/value head
    params = manifest["tensor_parallel"]["params"]
    assert params["model.model.layers.0.self_attn.k_proj.weight"] == 0 and params["model.model.layers.0.self_attn.o_proj.weight"] == 1
    # a last-bit difference of split matmuls, magnified by AdamW on near-zero gradients (see
    # helpers/training.py); losses stay within TOL
    assert_same_training(losses, ref_losses, weights, ref_weights, weight_tol=2 * TOL, adamw_lr=adamw_lr(MODELS / model))


@pytest.mark.parametrize(
    "model,strategy,world",
    [
        pytest.param("hf_llama.py", "tp=2", 2, marks=pytest.mark.slow),
        pytest.param("hf_llama.py", "pp=2,tp=2", 4, marks=pytest.mark.slow),
        pytest.param("hf_gpt2.py", "tp=2", 2, marks=pytest.mark.slow),
    ],
)
def test_sequence_parallel_on_transformers_models_matches_ddp(model, strategy, world, tmp_path):
    """transformers calls its attention with `hidden_states=` (a keyword, which torch's
    PrepareModuleInput refused: the build failed), and Llama's norm is its own LlamaRMSNorm, not
    torch's (its weight was left out of the gradient sum over tp: the norms' weights came out
    4e-3 off eager's after 5 steps). Both found running these."""
    losses, ref_losses, weights, ref_weights = train_both(MODELS / model, world, tmp_path, strategy=strategy, build_args=("--sequence-parallel",))
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["tensor_parallel"]["sequence_parallel"]
    assert_same_training(losses, ref_losses, weights, ref_weights, weight_tol=2 * TOL, adamw_lr=adamw_lr(MODELS / model))


def gpt2_plan() -> dict[str, str]:
    """Megatron's split of GPT-2: the fused q/k/v projection column-wise per third, c_fc
    column-wise, both c_proj row-wise."""
    plan = {}
    for i in range(LAYERS):
        prefix = f"model.transformer.h.{i}"
        plan.update(
            {f"{prefix}.attn.c_attn": "colwise:3", f"{prefix}.attn.c_proj": "rowwise", f"{prefix}.mlp.c_fc": "colwise", f"{prefix}.mlp.c_proj": "rowwise"}
        )
    return plan


def _gpt2_weights(seed: int, path):
    """tests/models/hf_gpt2.py's state_dict under another seed, as a weights file for --init-from."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_gpt2_init_from", MODELS / "hf_gpt2.py")
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    torch.manual_seed(seed)
    save_file({k: v.clone().contiguous() for k, v in user.model().state_dict().items()}, path)
    return path


@pytest.mark.parametrize("strategy,world,init_from", [("tp=2", 2, True), pytest.param("fsdp=2,tp=2", 4, False, marks=pytest.mark.slow)])
def test_gpt2_fused_attention_is_split_and_training_matches_ddp(strategy, world, init_from, tmp_path):
    """The fused c_attn's slices are cut per third everywhere a rank's piece is made or joined: the
    init program, --init-from (read from the user's file), the checkpoint merge."""
    weights = _gpt2_weights(7, tmp_path / "weights.safetensors") if init_from else None
    losses, ref_losses, merged, ref_weights = train_both(MODELS / "hf_gpt2.py", world, tmp_path, strategy=strategy, init_from=weights)
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["tensor_parallel"]["plan"] == gpt2_plan()
    assert manifest["tensor_parallel"]["fused"] == {f"model.transformer.h.{i}.attn.c_attn.{p}": 3 for i in range(LAYERS) for p in ("weight", "bias")}
    # Conv1D weights are (in, out): column-wise splits dimension 1
    assert manifest["tensor_parallel"]["params"]["model.transformer.h.0.attn.c_attn.weight"] == 1
    assert manifest["tensor_parallel"]["params"]["model.transformer.h.0.mlp.c_proj.weight"] == 0
    # The key projection's bias has no gradient in exact arithmetic (softmax ignores a constant
    # added to every score of a query), so its computed gradient is rounding noise, which AdamW
    # normalizes into full-size steps of either sign: the two runs' noise differs with the
    # reduction order. It may move at most lr per step (AdamW); every other element keeps
    # the tp bound.
    embed = merged["model.transformer.h.0.attn.c_attn.bias"].numel() // 3
    for i in range(LAYERS):
        name = f"model.transformer.h.{i}.attn.c_attn.bias"
        keys, ref_keys = merged[name][embed : 2 * embed], ref_weights[name][embed : 2 * embed]
        assert (keys - ref_keys).abs().max() <= 2 * STEPS * adamw_lr(MODELS / "hf_gpt2.py")
        merged[name][embed : 2 * embed] = ref_keys
    assert_same_training(losses, ref_losses, merged, ref_weights, weight_tol=2 * TOL, adamw_lr=adamw_lr(MODELS / "hf_gpt2.py"))


def test_build_says_what_tensor_parallel_left_whole(tmp_path):
    """Mixtral: attention split; the router (a top-k) and the experts' 3-d weights stay whole, each
    named with its reason; the lm_head's output is the model's."""
    r = ok(aot("build", MODELS / "hf_mixtral.py", "--world-size", 2, "--strategy", "tp=2", "--no-onnx", "-o", tmp_path / "art"))
    out = r.stdout + r.stderr
    assert "6 column-wise (model.model.layers.*.self_attn.q_proj (x2), model.model.layers.*.self_attn.k_proj (x2), " in out, out
    assert "left whole: model.model.layers.*.mlp.gate (x2): its output reaches topk in model.model.layers.*.mlp.gate" in out, out
    assert "left whole: model.model.layers.*.mlp.experts (x2): mixture-of-experts weights (gate_up_proj, down_proj) stay whole on every tp rank" in out
    assert "left whole: model.lm_head: its output reaches the model's output" in out
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    split = {n for n in manifest["tensor_parallel"]["plan"]}
    assert split == {f"model.model.layers.{i}.self_attn.{p}_proj" for i in range(LAYERS) for p in "qkvo"}


def test_tp_must_divide_the_key_value_heads(tmp_path):
    """4 query heads share 2 key/value heads: tp=4 would split a key/value head. Refused before tracing."""
    r = aot("build", MODELS / "hf_llama.py", "--world-size", 4, "--strategy", "tp=4", "--no-onnx", "-o", tmp_path / "art")
    assert r.returncode == 1 and "Traceback" not in r.stderr, show(r)
    assert r.stderr.strip().splitlines()[-1] == (
        "aot: error: --strategy tp=4: the tensor-parallel degree must divide the attention kv heads (model.config.num_key_value_heads = 2)"
    )
    assert not (tmp_path / "art").exists()


def test_finder_follows_slices_within_heads_but_not_across_them():
    """In-process: a slice inside each head (RoPE's halves) keeps q/k/v splittable; a slice of the
    projected features themselves (across heads) leaves the layers whole, saying which op."""
    from torch import nn

    from aot.plan.tensor_parallel import explain_plan

    class Attention(nn.Module):
        def __init__(self, across: bool):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))
            self.across = across

        def forward(self, x):
            b, t, _ = x.shape
            q = self.q(x)
            if self.across:
                q = torch.cat([q[..., 16:], q[..., :16]], dim=-1)  # moves features between heads
            q, k, v = (y.view(b, t, -1, 8).transpose(1, 2) for y in (q, self.k(x), self.v(x)))
            half = torch.cat([-q[..., 4:], q[..., :4]], dim=-1)  # rotate_half within each head
            q = q + torch.stack([half, half], dim=0).sum(0)
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(b, t, -1))  # sizes from the tensor: tp can split the heads

    x = [torch.randn(2, 5, 32)]
    found = explain_plan(Attention(across=False), x)
    assert found.plan == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}
    found = explain_plan(Attention(across=True), x)
    assert found.plan == {}
    assert found.whole["q"] == "slice in the model would mix the split features", found.whole


@pytest.mark.parametrize("strategy,world", [("tp=2", 2), pytest.param("pp=2,tp=2", 4, marks=pytest.mark.slow)])
def test_whole_weight_with_per_rank_gradient_is_summed_over_tp(strategy, world, tmp_path):
    """Qwen3 normalizes every head's queries and keys with RMSNorm weights (q_norm, k_norm) that tp
    keeps whole while each rank normalizes only its own heads: each rank's gradient is its heads'
    part of the sum. Found from the graph (aot/capture/replicas.py) and summed over tp; before,
    nothing summed them and the two ranks' copies drifted apart (5e-3 after 5 steps) in silence."""
    losses, ref_losses, weights, ref_weights = train_both(MODELS / "hf_qwen3.py", world, tmp_path, strategy=strategy)
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    summed = manifest["tensor_parallel"]["summed"]
    assert summed == sorted(f"model.model.layers.{i}.self_attn.{n}_norm.weight" for i in range(LAYERS) for n in "qk")
    assert_same_training(losses, ref_losses, weights, ref_weights, weight_tol=2 * TOL, adamw_lr=adamw_lr(MODELS / "hf_qwen3.py"))
    # the build's replica proof: every whole weight's update passes through a sum over tp
    handling = manifest["replicas"]["params"]
    assert handling["model.model.layers.0.self_attn.q_norm.weight"] == {"tp": "reduced"}
    assert handling["model.model.layers.0.self_attn.q_proj.weight"] == {"tp": "sharded"}
    assert sorted({h["tp"] for h in handling.values()}) == ["reduced", "sharded"]
