"""Activation recomputation (aot/passes/recompute.py, aot/plan/recompute.py).

In one process, on real captured steps (tests/test_passes.py's single-rank group): a recomputing
graph gives bit-identical losses, weights and optimizer state to the graph that keeps everything,
with dropout too (random draws are never repeated), keeps at most its budget of saved bytes, and a
memory budget picks a plan whose predicted peak is under it. Under torchrun: builds with
recomputation train like eager DDP, under dp, fsdp and tp.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from aot.errors import AotError
from aot.passes.recompute import MATMULS, Forward, by_budget, by_checkpoint_calls, by_modules, has_checkpoint_calls, recompute_activations
from aot.passes import run_passes
from aot.plan.step_reading import analyze, node_seconds
from aot.plan.machine import Machine
from aot.plan.recompute import Request, apply_request
from helpers.commands import EXAMPLES, MODELS, aot, ok
from helpers.training import assert_same_training, train_both
from runner.hardware.topology import load_profile
from test_passes import capture, run_graph, single_rank_group  # noqa: F401 (the autouse fixture)

COMPUTE = Machine(load_profile("cpu"), 1).compute
cost = lambda n: node_seconds(n, COMPUTE)
GPT_DROPOUT = str(MODELS / "gpt_dropout.py")


@pytest.fixture(scope="module")
def steps():
    """Captured single-rank steps (dp over a group of 1), by model file, with their outputs."""
    found = {}
    for model in (GPT_DROPOUT, "mlp.py", str(MODELS / "mlp_dropout.py")):
        step = capture(model)
        found[model] = (step, run_graph(step.graph, step.example_args))
    return found


def test_layers_checkpointed_together_are_each_checkpointed_alone(steps):
    """by_budget's search (aot.passes.recompute._Layered) takes the first k layers checkpointed as
    the union of each layer checkpointed alone, each found once: the same choice, node for node, as
    _checkpoint over the k layers' region at once, for every k."""
    from aot.passes.recompute import _checkpoint, _Layered, _layers, _region_of

    step, _ = steps[GPT_DROPOUT]
    fwd = Forward(step.graph.graph)
    layers = _layers(fwd)
    layered = _Layered(fwd, layers, cost)
    assert len(layers) == 2
    for k in range(len(layers) + 1):
        together = _checkpoint(fwd, {n: _region_of(n, lambda call: call in set(layers[:k])) for n in fwd.nodes}, lambda n: False)
        alone = layered.with_values(k, 1.0)  # budget 1: no single value beyond the layers
        assert (alone.nodes, alone.kept, alone.pinned, alone.kept_bytes) == (together.nodes, together.kept, together.pinned, together.kept_bytes), k
        assert k == 0 or together.nodes


def _random_ops(gm) -> int:
    return sum(
        1
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags
    )


def _recomputed(step, choose):
    """The step's graph with `choose(graph)`'s recomputation, and its results."""
    gm = copy.deepcopy(step.graph)
    choice = choose(gm.graph)
    gm = recompute_activations(gm, choice)
    return gm, choice, run_graph(gm, step.example_args)


def _assert_identical(a, b):
    (out_a, state_a), (out_b, state_b) = a, b
    assert all(torch.equal(x, y) for x, y in zip(out_a, out_b))
    assert all(torch.equal(x, y) for x, y in zip(state_a, state_b))


@pytest.mark.parametrize("model", [GPT_DROPOUT, "mlp.py", str(MODELS / "mlp_dropout.py")])
def test_budgets_keep_their_share_and_results_are_bit_identical(steps, model):
    step, reference = steps[model]
    least = by_budget(step.graph.graph, 0.0, cost).fraction
    assert 0 < least < 0.7
    kept, peaks = [], []
    for fraction in (1.0, 0.5, least):
        if fraction < least:
            continue
        gm, choice, results = _recomputed(step, lambda g: by_budget(g, fraction, cost))
        assert choice.kept_bytes <= fraction * choice.saved_bytes + 1
        _assert_identical(results, reference)
        assert _random_ops(gm) == _random_ops(step.graph), "a random draw was repeated"
        assert Forward(gm.graph).saved and sum(Forward(gm.graph).saved.values()) == choice.kept_bytes
        kept.append(choice.kept_bytes)
        peaks.append(analyze(gm, step.slots).memory.activations_peak)
    assert kept == sorted(kept, reverse=True) and kept[0] > kept[-1]
    assert peaks[-1] < peaks[0]


def test_half_the_activations_halves_gpt_activation_memory_for_a_few_percent_more_compute(steps):
    step, _ = steps[GPT_DROPOUT]
    gm, _, _ = _recomputed(step, lambda g: by_budget(g, 0.5, cost))
    before, after = analyze(step.graph, step.slots), analyze(gm, step.slots)
    assert after.memory.activations_peak <= 0.6 * before.memory.activations_peak
    compute = lambda g: sum(node_seconds(n, COMPUTE) for n in g.graph.nodes if n.op == "call_function")
    assert compute(step.graph) < compute(gm) < 1.25 * compute(step.graph)


def test_checkpointing_blocks_and_selective_checkpointing(steps):
    step, reference = steps[GPT_DROPOUT]
    kept = {}
    for save_matmuls in (False, True):
        gm, choice, results = _recomputed(step, lambda g: by_modules(g, ["blocks.*"], save_matmuls))
        kept[save_matmuls] = choice.kept_bytes
        _assert_identical(results, reference)
        assert _random_ops(gm) == _random_ops(step.graph)
        matmuls_after_loss = _matmuls_after_loss(gm)
        assert (matmuls_after_loss > _matmuls_after_loss(step.graph)) == (not save_matmuls)
    assert kept[False] < kept[True] < choice.saved_bytes
    # a call's output (ln_f's, which lm_head reads) is kept, as torch.utils.checkpoint keeps a region's
    # output; only what stays inside (its mean and 1/std) is recomputed
    gm = copy.deepcopy(step.graph)
    ln_f = by_modules(gm.graph, ["ln_f"], save_matmuls=False)
    fwd = Forward(gm.graph)
    outside = {fwd.owner[a] for n in fwd.nodes if _call(n) != "ln_f" for a in n.all_input_nodes if _call(a) == "ln_f"}
    assert ln_f.values == 2 and outside and not outside & ln_f.nodes


def test_the_models_checkpoint_calls_are_recomputed_as_checkpointed_modules_bit_identical():
    """torch.utils.checkpoint(block, x, use_reentrant=False) in the forward (issue #40): traced once,
    as a plain call, and recomputed by the pass from the call's inputs, exactly what checkpointing
    the blocks by name (model-file `recompute`) chooses; dropout's draws stay saved, so the step is
    bit-identical to keeping everything, and the build asks for it with no flag."""
    step = capture(str(MODELS / "checkpointed_dropout.py"))
    reference = run_graph(step.graph, step.example_args)
    assert has_checkpoint_calls(step.graph.graph)
    gm, choice, results = _recomputed(step, lambda g: by_checkpoint_calls(g, cost))
    assert choice.values > 0 and _matmuls_after_loss(gm) > _matmuls_after_loss(step.graph)
    _assert_identical(results, reference)
    assert _random_ops(gm) == _random_ops(step.graph), "a random draw was repeated"
    by_name = by_modules(copy.deepcopy(step.graph).graph, ["blocks.*"], save_matmuls=False)
    assert (choice.values, len(choice.nodes), choice.kept_bytes) == (by_name.values, len(by_name.nodes), by_name.kept_bytes)
    _, summary = apply_request(copy.deepcopy(step.graph), step.slots, Request(), COMPUTE, lambda g: g)
    assert summary["policy"] == "checkpoint_calls" and summary["recomputed_values"] == choice.values


def _call(node):
    calls = node.meta.get("custom", {}).get("aot_module_calls", ())
    return calls[0][0] if calls else None


def _matmuls_after_loss(gm) -> int:
    nodes = list(gm.graph.nodes)
    turn = nodes.index(Forward(gm.graph).turn)
    return sum(1 for n in nodes[turn:] if n.op == "call_function" and n.target in MATMULS)


def test_a_memory_budget_picks_a_plan_under_it_and_refuses_one_below_the_smallest(steps):
    step, reference = steps[GPT_DROPOUT]
    finish = run_passes
    fit = lambda budget: apply_request(copy.deepcopy(step.graph), step.slots, Request(memory_bytes=budget), COMPUTE, finish)
    plain = analyze(finish(copy.deepcopy(step.graph)), step.slots).memory.peak
    gm, summary = fit(plain)
    assert summary["policy"] == "none" and analyze(gm, step.slots).memory.peak == plain
    peaks = [plain]
    resident = analyze(step.graph, step.slots).memory.resident
    for budget in (int(resident + 0.8 * (plain - resident)), int(resident + 0.6 * (plain - resident))):
        gm, summary = fit(budget)
        peak = analyze(gm, step.slots).memory.peak
        assert summary["policy"] == "budget" and peak <= budget and summary["peak_without_recompute"] == plain
        _assert_identical(run_graph(gm, step.example_args), reference)
        peaks.append(peak)
    assert peaks == sorted(peaks, reverse=True)
    with pytest.raises(AotError, match="below the smallest peak recomputation reaches"):
        fit(resident)


# -- under torchrun, against eager DDP ---------------------------------------------------------------


def _smallest_feasible(model, tmp_path, strategy) -> str:
    """The smallest activation budget, as the refusal of a budget of 0 states it."""
    r = aot("build", model, "--strategy", strategy, "--batch-size", 4, "-o", tmp_path / "refused", "--quiet", "--no-onnx", "--activation-budget", 0)
    assert r.returncode == 1 and not (tmp_path / "refused").exists(), r.stderr
    return re.search(r"smallest feasible is ([0-9.]+)", r.stderr).group(1)


CASES = [(GPT_DROPOUT, "dp=2", "0.5"), (GPT_DROPOUT, "fsdp=2", "smallest"), (str(EXAMPLES / "mlp.py"), "tp=2", "smallest")]
# (gpt_dropout is not compared under tp: its attention dropout draws masks for a rank's heads alone,
# where eager draws one for all heads, with or without recomputation; gpt.py, without dropout, is)
SLOW_CASES = [
    (str(MODELS / "mlp_dropout.py"), "tp=2", "smallest"),
    (str(EXAMPLES / "mlp.py"), "fsdp=2", "smallest"),
    (str(EXAMPLES / "gpt.py"), "tp=2", "smallest"),
]


@pytest.mark.parametrize("model,strategy,budget", CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_CASES])
def test_training_with_recomputation_matches_eager_ddp(tmp_path, model, strategy, budget):
    if budget == "smallest":
        budget = _smallest_feasible(model, tmp_path, strategy)
    losses, ref_losses, weights, ref_weights = train_both(model, 2, tmp_path, strategy=strategy, build_args=("--activation-budget", budget))
    assert_same_training(losses, ref_losses, weights, ref_weights)
    recompute = json.loads((tmp_path / "art" / "manifest.json").read_text())["memory"]["recompute"]
    assert recompute["policy"] == "budget" and recompute["recomputed_values"] > 0
    assert recompute["kept_activation_bytes"] <= float(budget) * recompute["saved_activation_bytes"] + 1


def test_model_file_recompute_policy_trains_like_eager_ddp(tmp_path):
    """`recompute = {"modules": ["blocks.*"], "save": "matmuls"}` in the model file: selective
    checkpointing of every block; `aot inspect` says what is recomputed."""
    model = tmp_path / "gpt_selective.py"
    source = open(GPT_DROPOUT).read().replace('Path(__file__).resolve().parents[2] / "examples" / "gpt.py"', repr(str(EXAMPLES / "gpt.py")))
    model.write_text(source + '\nrecompute = {"modules": ["blocks.*"], "save": "matmuls"}\n')
    losses, ref_losses, weights, ref_weights = train_both(model, 2, tmp_path, strategy="dp=2")
    assert_same_training(losses, ref_losses, weights, ref_weights)
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["memory"]["recompute"]["policy"] == "modules"
    assert manifest["memory"]["recompute"]["save"] == "matmuls"
    shown = ok(aot("inspect", tmp_path / "art")).stdout
    assert "recompute" in shown and "blocks.*" in shown
