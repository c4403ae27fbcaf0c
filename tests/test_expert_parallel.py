"""Expert parallelism (issue #44): transformers' mixture-of-experts models with their experts split
over ep ranks and tokens dispatched by all_to_all inside the static graph, and experts held as an
nn.ModuleList (tests/models/zoo/gshard_moe_sgd.py: the block's own static dispatch), stacked.

Trained under torchrun and judged against eager DDP over the same global batch, within eager's own
noise floor (tests/helpers/zoo.py), dropless. The models train by SGD with clipping
(tests/models/zoo/*_sgd.py): an expert gradient divided by the wrong number of ranks, or a norm
summed over the wrong groups, moves the weights (Adam's update would hide a constant factor; with
the experts' gradients left undivided by ep the ep=2 cell is 1.6e-3 off eager, 13,000 times its
floor)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from aot.capture.expert_parallel import dispatch_rows
from helpers import zoo
from helpers.commands import MODELS, EXAMPLES, aot, ok, torchrun
from helpers.training import STEPS, reference
from helpers.zoo import run_cell
from test_bad_input import assert_user_error

QWEN3_MOE = MODELS / "zoo" / "qwen3_moe_sgd.py"
GSHARD_MOE = MODELS / "zoo" / "gshard_moe_sgd.py"  # experts in an nn.ModuleList, the block's own static dispatch


@pytest.mark.parametrize(
    "family,strategy",
    [
        ("qwen3_moe_sgd", "ep=2"),
        ("qwen3_moe_sgd", "ep=2,fsdp=2"),
        pytest.param("qwen3_moe_sgd", "ep=2,dp=2", marks=pytest.mark.slow),
        pytest.param("mixtral_sgd", "ep=2", marks=pytest.mark.slow),
        pytest.param("qwen3_moe_sgd", "pp=2,ep=2", marks=pytest.mark.slow),  # a stage per layer, experts split in each
        pytest.param("qwen3_moe_sgd", "ep=2,tp=2", marks=pytest.mark.slow),  # attention split; each tp rank dispatches half the tokens
        pytest.param("qwen3_moe", "ep=2,fsdp=2 bf16", marks=pytest.mark.slow),  # against FSDP2 with MixedPrecisionPolicy
        ("gshard_moe_sgd", "ep=2"),  # a ModuleList's experts, stacked; the block's dispatch buffer exchanged in one all_to_all
        pytest.param("gshard_moe_sgd", "pp=2,ep=2", marks=pytest.mark.slow),
        pytest.param("gshard_moe_sgd", "ep=2,tp=2", marks=pytest.mark.slow),  # each tp rank dispatches 1/tp of every expert's rows
    ],
)
def test_experts_split_over_ep_ranks_train_as_eager_ddp(family, strategy, tmp_path):
    cell = run_cell(family, strategy, tmp_path)
    assert cell.status == "equal", cell


def test_resume_is_exact_and_a_merged_checkpoint_holds_every_expert(built, tmp_path):
    """ep=2,fsdp=2 on 4 ranks: 3 steps straight == 1 step, save, resume, 2 steps (bit for bit);
    the checkpoint has a shard per (ep, fsdp) rank and merges into the model's whole tensors."""
    art = built(QWEN3_MOE, "--world-size", 4, "--strategy", "ep=2,fsdp=2", "--batch-size", 4, "--no-onnx")
    full, first, resumed = tmp_path / "full", tmp_path / "first", tmp_path / "resumed"
    ok(torchrun(4, "run", art, "--steps", 3, "--save", full, "--quiet"))
    ok(torchrun(4, "run", art, "--steps", 1, "--save", first, "--quiet"))
    ok(torchrun(4, "run", art, "--steps", 2, "--resume", first, "--save", resumed, "--quiet"))
    a, b = json.loads((full / "checkpoint.json").read_text()), json.loads((resumed / "checkpoint.json").read_text())
    assert len(a["shards"]) == 4 and a["shards"] == b["shards"] and a["expert_parallel"]["size"] == 2
    for shard in a["shards"]:
        for name in shard.values():
            x, y = load_file(full / name), load_file(resumed / name)
            assert all(torch.equal(x[k], y[k]) for k in x)
    ok(aot("checkpoint", "merge", full, "-o", tmp_path / "merged.safetensors"))
    merged = load_file(tmp_path / "merged.safetensors")
    experts = "model.model.layers.0.mlp.experts.gate_up_proj"
    assert merged[experts].shape == (4, 64, 64)
    # each ep rank's own experts: rank 0 (ep=0) trained experts 0-1, rank 2 (ep=1) experts 2-3
    summary = json.loads(ok(aot("inspect", art, "--json")).stdout)
    assert [r["experts"]["model.model.layers.0.mlp.experts"] for r in summary["ranks"]] == [[0, 2], [0, 2], [2, 4], [2, 4]]
    assert "ep=1  experts 2-3 of every layer" in ok(aot("inspect", art)).stdout
    # `aot verify` gathers every rank's experts (in one order on every rank) and compares with eager DDP
    assert ": OK" in ok(aot("verify", art, QWEN3_MOE, "--steps", 2)).stdout


def test_a_module_lists_experts_are_stacked_resume_exactly_and_load_under_their_own_names(built, tmp_path):
    """GShard-style experts (an nn.ModuleList) at ep=2,fsdp=2 on 4 ranks: stored as one [E, ...]
    weight per parameter (the manifest's `state.stacked` maps each row to the model's own name);
    3 steps straight == 1 step, save, resume, 2 steps (bit for bit); the merged checkpoint holds
    exactly the model's state_dict keys, each expert's own tensor; and `--init-from` that file
    puts every expert's tensor back in its row (saved before any step, merged: the same file)."""
    import importlib.util

    art = built(GSHARD_MOE, "--world-size", 4, "--strategy", "ep=2,fsdp=2", "--batch-size", 4, "--no-onnx", "--no-eval")
    manifest = json.loads((art / "manifest.json").read_text())
    stacked = manifest["state"]["stacked"]
    assert stacked["blocks.0.moe.experts.w1__weight"] == [f"blocks.0.moe.experts.{e}.w1.weight" for e in range(4)]
    assert manifest["state"]["params"]["blocks.0.moe.experts.w1__weight"][0] == [4, 64, 32]
    assert manifest["expert_parallel"]["capacity"] == "model" and "blocks.1.moe.experts.w2__bias" in manifest["expert_parallel"]["params"]
    full, first, resumed = tmp_path / "full", tmp_path / "first", tmp_path / "resumed"
    ok(torchrun(4, "run", art, "--steps", 3, "--save", full, "--quiet"))
    ok(torchrun(4, "run", art, "--steps", 1, "--save", first, "--quiet"))
    ok(torchrun(4, "run", art, "--steps", 2, "--resume", first, "--save", resumed, "--quiet"))
    a = json.loads((full / "checkpoint.json").read_text())
    assert a["stacked"] == stacked
    for shard in a["shards"]:
        for name in shard.values():
            x, y = load_file(full / name), load_file(resumed / name)
            assert all(torch.equal(x[k], y[k]) for k in x)
    merged = tmp_path / "merged.safetensors"
    ok(aot("checkpoint", "merge", full, "-o", merged))
    spec = importlib.util.spec_from_file_location("gshard_moe", GSHARD_MOE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert sorted(load_file(merged)) == sorted(module.model().state_dict())
    assert "ep=1  experts 2-3 of every layer" in ok(aot("inspect", art)).stdout
    # --init-from the merged file, saved before any step: each expert's tensor back in its row
    ok(torchrun(4, "run", art, "--steps", 0, "--init-from", merged, "--save", tmp_path / "loaded", "--quiet"))
    ok(aot("checkpoint", "merge", tmp_path / "loaded", "-o", tmp_path / "loaded.safetensors"))
    again, expected = load_file(tmp_path / "loaded.safetensors"), load_file(merged)
    assert sorted(again) == sorted(expected) and all(torch.equal(again[k], expected[k]) for k in expected)


@pytest.mark.parametrize(
    "model,strategy,extra,needle",
    [
        (EXAMPLES / "mlp.py", "ep=2", (), "no mixture-of-experts layer"),
        (QWEN3_MOE, "ep=3", (), "holds 4 experts, which 3 ep ranks cannot share evenly"),
        # 64 tokens x top-2 / 4 experts x 0.01 = 0.32 rows
        (QWEN3_MOE, "ep=2", ("--batch-size", 4, "--moe-capacity-factor", 0.01), "under one token per expert"),
        (QWEN3_MOE, "fsdp=2", ("--moe-capacity-factor", 1), "needs --strategy with ep=N"),
        (QWEN3_MOE, "ep=2", ("--moe-capacity-factor", -1), "must be positive"),
    ],
)
def test_an_expert_parallel_build_it_cannot_make_is_refused_in_one_line(model, strategy, extra, needle, tmp_path):
    degrees = [int(part.split("=")[1]) for part in strategy.split(",")]
    world = 1
    for d in degrees:
        world *= d
    r = aot("build", model, "--world-size", world, "--strategy", strategy, "--no-onnx", *extra, "-o", tmp_path / "out")
    assert_user_error(r, needle)
    assert not (tmp_path / "out").exists()


def test_stacked_experts_export_to_onnx_under_their_own_names(built, tmp_path):
    """The ONNX forward of an ep=2 build with ModuleList experts reads each expert's own weights:
    `aot infer` (the init program's stacked weights, rows handed over by the model's names) gives
    eager PyTorch's output for `torch.manual_seed(0); model()`, and `aot export` of a trained
    checkpoint passes its own check against eager."""
    import importlib.util

    model_file = MODELS / "moe_fixed_capacity.py"
    art = built(model_file, "--world-size", 2, "--strategy", "ep=2", "--batch-size", 2, "--no-eval")
    example = art / "data" / "example_batch.safetensors"
    ok(aot("infer", art, "--input", example, "-o", tmp_path / "out.safetensors"))
    spec = importlib.util.spec_from_file_location("moe_fixed", model_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    with torch.no_grad():
        eager = module.model()(load_file(example)["inputs"])
    assert torch.allclose(load_file(tmp_path / "out.safetensors")["outputs"], eager, atol=1e-5)
    ok(torchrun(2, "run", art, "--steps", 1, "--save", tmp_path / "ckpt", "--quiet"))
    r = ok(aot("export", art, model_file, "--checkpoint", tmp_path / "ckpt", "-o", tmp_path / "trained.onnx"))
    assert "max |ONNX Runtime - eager|" in r.stdout + r.stderr, r


def test_module_list_experts_ep_cannot_split_are_refused_in_one_line(tmp_path):
    """ModuleList experts ep refuses, each in one line and leaving no artifact: called after a
    data-dependent selection (no static row count), trained by a layer-wise optimizer (stacking
    would change its update), with a capacity factor (the block has its own capacity)."""
    cases = [
        (MODELS / "bad_moe_module_list.py", 2, "ep=2", (), "is not called on row block 0 of one [E, ...] dispatch buffer"),
        (MODELS / "bad_moe_lars.py", 2, "ep=2", (), "may update a stacked weight differently"),
        (GSHARD_MOE, 2, "ep=2", ("--moe-capacity-factor", 1), "whose block dispatches with its own capacity"),
    ]
    for index, (model, world, strategy, extra, needle) in enumerate(cases):
        out = tmp_path / f"out{index}"
        r = aot("build", model, "--world-size", world, "--strategy", strategy, "--no-onnx", *extra, "-o", out)
        assert_user_error(r, needle)
        assert not out.exists()


def test_dispatch_fills_each_experts_rows_choice_first_and_drops_past_capacity():
    """The static dispatch's bookkeeping (aot/capture/expert_parallel.py): each kept (token, choice)
    has a row in its expert's run of `capacity` rows, filled by that token; first choices claim
    rows before second choices; a choice past capacity reads the dump row (a zero result)."""
    experts, capacity = 3, 2
    top_k = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1]])  # 4 tokens, 2 choices each
    source, slot = dispatch_rows(top_k, experts, capacity)
    assert source.shape == (experts * capacity,) and slot.shape == top_k.shape
    dump = experts * capacity
    for t in range(4):
        for k in range(2):
            row = int(slot[t, k])
            if row != dump:
                assert row // capacity == top_k[t, k] and source[row] == t
    # expert 0: first choices of tokens 0, 1 and 3 compete for 2 rows; token 2's second choice
    # comes after every first choice, so tokens 0 and 1 keep theirs and 3 and 2 drop
    assert slot[0, 0] == 0 and slot[1, 0] == 1 and slot[3, 0] == dump and slot[2, 1] == dump
    # expert 1: token 2's first choice before the second choices of tokens 0 and 3
    assert slot[2, 0] == 2 and slot[0, 1] == 3 and slot[3, 1] == dump
    # rows no choice fills read the zero row (source = the token count)
    assert source[5] == 4 and source[4] == 1


@pytest.mark.parametrize(
    "name,capacity",
    [
        ("qwen3_moe_capacity", 1.0),  # the documented drop rule, computed in plain torch by the eager runs
        ("qwen3_moe_aux", None),  # transformers' load-balancing loss from each rank's own router logits
        pytest.param("qwen3_moe_capacity_tp2", 1.0, marks=pytest.mark.slow),  # ep=2,tp=2: the rule per tp rank's half of the tokens
        pytest.param("qwen3_moe_capacity_pp2", 1.0, marks=pytest.mark.slow),  # pp=2,ep=2: the rule per microbatch
    ],
)
def test_per_rank_semantics_equal_eager_ddp_over_the_same_ranks(name, capacity, built, tmp_path):
    """Where a step's result depends on how the batch is split between ranks (a capacity drops
    choices by each rank's own tokens; the load-balancing loss is a product of two means over each
    rank's own tokens), the counterpart is eager DDP over the same 2 ranks: aot's ep=2 training
    equals it within eager's noise floor on the same model without either (eager over 1, 2 and 4
    ranks), and differs far more from that model (the effect is real). With a capacity
    (tests/models/zoo/qwen3_moe_capacity.py: `--moe-capacity-factor 1`) the drops are counted
    every step."""
    model = MODELS / "zoo" / f"{name}.py"
    extra = ("--moe-capacity-factor", capacity) if capacity else ()
    # a second axis splits a rank's tokens into shares dispatched apart: tp ranks' halves, pp's two microbatches
    second = {"_tp2": "tp=2", "_pp2": "pp=2"}.get(name[-4:])
    strategy = {"pp=2": "pp=2,ep=2", "tp=2": "ep=2,tp=2"}.get(second, "ep=2")  # pp outermost
    ranks = 4 if second else 2
    art = built(model, "--world-size", ranks, "--strategy", strategy, "--batch-size", 4, *extra, "--no-onnx", "--no-eval")
    manifest = json.loads((art / "manifest.json").read_text())
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    ok(torchrun(ranks, "run", art, "--steps", STEPS, "--metrics", metrics, "--save", ckpt, "--quiet"))
    ok(aot("checkpoint", "merge", ckpt, "-o", tmp_path / "merged.safetensors"))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    if capacity:
        # 64 tokens (32 per share: a tp rank's, a microbatch's) x top-2 / 4 experts
        assert manifest["expert_parallel"]["capacity"] == {"factor": 1.0, "rows": 16 if second else 32}
        assert all(r["moe_dropped"] > 0 for r in records), records
        assert_user_error(aot("verify", art, model), "no eager counterpart")
    else:
        assert manifest["expert_parallel"]["capacity"] == "dropless" and all("moe_dropped" not in r for r in records)
    ours = ([r["loss"] for r in records], load_file(tmp_path / "merged.safetensors"))
    data = art / "data" / "example_batch.safetensors"
    eager = zoo._read(reference(model, data, 2, 4, tmp_path))
    distance = zoo._distance(*ours, *eager)
    runs = [zoo._read(reference(QWEN3_MOE, data, ranks, 8 // ranks, tmp_path)) for ranks in (1, 2, 4)]
    floor = {k: max(zoo._distance(*a, *b)[k] for i, a in enumerate(runs) for b in runs[i + 1 :]) for k in zoo.SLACK}
    assert all(distance[k] <= 2 * floor[k] + zoo.SLACK[k] for k in zoo.SLACK), (distance, floor)
    plain = zoo._distance(*ours, *runs[1])
    assert plain["loss"] > 10 * (2 * floor["loss"] + zoo.SLACK["loss"]), (plain, floor)


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_the_planner_searches_ep_and_prices_it_as_the_build_predicts(capacity, tmp_path):
    """`aot plan` on a model with experts searches ep (its all_to_alls priced per link) and says why
    it leaves an ep mesh out; an ep plan's peak per rank is its build's, and it prices the
    all_to_alls the build makes; with `--moe-capacity-factor`, as the build makes it."""
    moe = EXAMPLES / "moe.py"
    common = ("--topology", "dgx_h100", "--nodes", 2, "--world-size", 16, "--batch-size", 4)
    common += ("--moe-capacity-factor", capacity) if capacity else ()
    out = json.loads(ok(aot("plan", moe, *common, "--json")).stdout)
    rows = {(p["strategy"], p["bucket_mb"]): p for p in out["plans"]}
    ep_rows = [key for key in rows if "ep=" in key[0]]
    assert ep_rows, sorted(rows)
    assert any("ep=16" in s and "cannot share evenly" in s for s in out["skipped"]), out["skipped"]
    strategy, bucket = next(key for key in ep_rows if key[0] == "dp=8,ep=2" and key[1] == 25.0)
    assert "all_to_all:pairwise" in json.dumps(rows[(strategy, bucket)])
    art = tmp_path / "art"
    ok(aot("build", moe, *common, "--strategy", strategy, "--bucket-mb", bucket, "--no-onnx", "--no-eval", "--quiet", "-o", art))
    manifest = json.loads((art / "manifest.json").read_text())
    assert rows[(strategy, bucket)]["memory_bytes"]["peak"] == manifest["memory"]["predicted"]["peak"]
    built_a2a = [c for c in manifest["programs"]["train"]["collectives"] if c["kind"] == "all_to_all_single"]
    assert rows[(strategy, bucket)]["algorithms"]["all_to_all:pairwise"] == len(built_a2a) == 8  # 2 layers x dispatch and return x forward and backward


def test_init_from_a_weights_file_gives_each_rank_its_experts(tmp_path):
    """`aot run --init-from` on ep=2,fsdp=2: each rank reads only its experts' rows (its ep slice of
    dimension 0, then its fsdp piece), and training from those weights equals eager DDP's from the
    same file."""
    import importlib.util

    from safetensors.torch import save_file

    from helpers.training import assert_same_training, train_both

    spec = importlib.util.spec_from_file_location("moe_init_from", QWEN3_MOE)
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    torch.manual_seed(7)  # not the weights the init program makes
    weights = tmp_path / "user.safetensors"
    save_file({k: v.clone().contiguous() for k, v in user.model().state_dict().items()}, weights)
    losses, ref_losses, ours, ref = train_both(QWEN3_MOE, 4, tmp_path, strategy="ep=2,fsdp=2", init_from=weights)
    assert_same_training(losses, ref_losses, ours, ref)
