"""One compile path (issue #41): the program the planner prices for a target is the program the
build makes for it, node for node.

The build's side is `aot build`'s own compile step (aot.build.compile_step: the model file loaded,
the tp plan chosen at the target's degree, the layout, the trace, recomputation as asked and every
pass); the planner's side is aot.plan.model_steps.ModelSteps, which prices its programs without
the passes it prices analytically (bucketing and hierarchical all_reduce): asked for the program
with those passes too, it must be the build's. Meshes: dp, fsdp, tp, a 2D dp x tp mesh, fsdp under
bf16, a model whose blocks run under torch.utils.checkpoint, and a pipeline; and models of 6
blocks, which the planner traces cut to 3 blocks and writes out (aot/plan/repeated_blocks.py).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from aot.build import BuildOptions, compile_step, place_mesh
from aot.passes import PRICED_ANALYTICALLY
from aot.plan.step_reading import analyze
from aot.plan.mesh import Mesh
from aot.plan.model_steps import ModelSteps, Pricing
from aot.plan.recompute import Request
from aot.progress import Progress
from helpers.graphs import canonical_nodes, graph_nodes
from runner.hardware.topology import for_nodes, load_profile

REPO = Path(__file__).resolve().parents[1]
GPT = REPO / "examples" / "gpt.py"
GPT4 = REPO / "tests" / "models" / "gpt4.py"
CHECKPOINTED = REPO / "tests" / "models" / "checkpointed_dropout.py"
# models of 6 blocks, which the planner traces cut to 3 and writes out (aot/plan/repeated_blocks.py)
GPT6, LLAMA6, CHECKPOINTED6 = (REPO / "tests" / "models" / name for name in ("gpt6.py", "llama6.py", "checkpointed6.py"))
# transformers' Qwen3-MoE (examples/moe.py's tiny preset: 2 layers) and at 6 layers, for ep
MOE, MOE6 = REPO / "examples" / "moe.py", REPO / "tests" / "models" / "moe6.py"
GSHARD = REPO / "tests" / "models" / "zoo" / "gshard_moe_sgd.py"  # experts an nn.ModuleList, stacked under ep
BATCH = 8


def built(model: Path, strategy: str, tmp_path: Path, precision: str | None = None):
    """The build's compiled step for `strategy` on one dgx_a100 node (no eval program)."""
    mesh = Mesh.parse(strategy, None)
    profile = for_nodes(load_profile("dgx_a100"), 1, mesh.world_size)
    options = BuildOptions(
        model,
        tmp_path / "never-written",
        topology="dgx_a100",
        world_size=mesh.world_size,
        strategy=strategy,
        batch_size=BATCH,
        precision=precision,
        eval=False,  # the train program is compared, not the eval program
    )
    progress = Progress(10, quiet=True, stream=io.StringIO())
    return compile_step(options, profile, mesh, place_mesh(mesh, profile), None, progress)


def planner(model: Path, world_size: int, precision: str | None = None) -> ModelSteps:
    profile = for_nodes(load_profile("dgx_a100"), 1, world_size)
    return ModelSteps(model, BATCH, pricing=Pricing(profile, world_size, world_size, precision))


@pytest.mark.parametrize(
    "model,strategy,precision",
    [
        (GPT, "dp=2", None),
        (GPT, "fsdp=2", None),
        (GPT, "tp=2", None),
        (GPT, "dp=2,tp=2", None),
        (GPT, "fsdp=2", "bf16"),
        (CHECKPOINTED, "dp=2", None),
        (LLAMA6, "fsdp=2", "bf16"),
        (CHECKPOINTED6, "dp=2", None),
        (MOE, "ep=2", None),
        (MOE6, "ep=2,fsdp=2", None),
        (MOE, "ep=2,tp=2", None),
        (GSHARD, "ep=2,fsdp=2", None),
    ],
    ids=lambda v: v.stem if isinstance(v, Path) else str(v),
)
def test_the_planners_program_is_the_builds(model, strategy, precision, tmp_path):
    """A model of 6 blocks is priced from 3 of them written out: its program is the build's node
    for node but for node names (helpers.graphs.canonical_nodes), and priced the same."""
    step = built(model, strategy, tmp_path, precision)
    mesh = Mesh.parse(strategy, None)
    steps = planner(model, mesh.world_size, precision)
    degrees = (mesh.size("dp"), mesh.size("fsdp"), mesh.size("tp"))
    build_program = step.captures["train"].graph
    composed = steps.blocks is not None
    assert composed == (model in (GPT6, LLAMA6, CHECKPOINTED6, MOE6))
    same = canonical_nodes if composed else graph_nodes
    assert same(steps.program(*degrees, skip=(), ep=mesh.size("ep"))) == same(build_program)
    assert composed == (steps.blocks is not None), "the planner fell back to tracing the whole model"
    # what it prices: that program but for the passes priced analytically
    priced = steps.program(*degrees, ep=mesh.size("ep"))
    if precision is None and model == GPT and strategy == "dp=2":
        assert graph_nodes(priced) != graph_nodes(build_program)  # bucketing made one all_reduce of many
    assert analyze(priced, step.captures["train"].slots).memory.to_json() == steps(mesh.axes, mesh.shape).memory.to_json()
    assert set(PRICED_ANALYTICALLY) == {"bucket_all_reduces", "split_hierarchical"}


def test_the_checkpointed_models_recomputation_is_priced(tmp_path):
    """The model's torch.utils.checkpoint calls are recomputed by the build without a flag, and so
    by the planner: the priced step runs their forward again (more ops, more FLOPs) as the build's does."""
    step = built(CHECKPOINTED, "dp=2", tmp_path)
    assert step.recompute["policy"] == "checkpoint_calls", step.recompute
    steps = planner(CHECKPOINTED, 2)
    gm, slots = steps._capture(2, 1, 1)
    plain = analyze(steps.passed(gm, slots, Request(source="a test: recompute nothing"))[0], slots)
    priced = steps.capture(2, 1, 1)
    assert priced.graph_nodes > plain.graph_nodes and priced.flops > plain.flops
    assert priced.flops == analyze(step.captures["train"].graph, step.captures["train"].slots).flops


def test_the_planners_pipeline_programs_are_the_builds(tmp_path):
    step = built(GPT4, "pp=2", tmp_path)
    steps = planner(GPT4, 2)
    graphs, _ = steps.pipeline(("pp",), (2,), microbatches=2)
    assert sorted(step.captures) == ["train.pp0", "train.pp1"]
    for r, graph in enumerate(graphs):
        assert graph_nodes(graph) == graph_nodes(step.captures[f"train.pp{r}"].graph), r
