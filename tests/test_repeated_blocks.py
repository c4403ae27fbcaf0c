"""Deep models planned from a few of their blocks (issue #42): the planner traces a model of
repeated blocks cut to 3 of them and writes the middle block out to full depth
(aot/plan/repeated_blocks.py). The graph it prices must be the one a trace of the whole model
gives, node for node (names aside) and storage for storage, for every layout class the planner
traces (dp x fsdp, tp, dp x tp with sequence parallelism, fsdp under bf16), a model whose blocks
run under torch.utils.checkpoint, and model code as written (transformers, torchtitan, nanoGPT). tests/test_compile_path.py checks the same models'
priced programs against `aot build`'s."""

from __future__ import annotations

from pathlib import Path

import pytest

from aot.compile_step import tensor_parallel_plan, trace_program
from aot.plan.model_steps import ModelSteps, Pricing
from aot.plan.repeated_blocks import find_blocks
from helpers.graphs import canonical_nodes
from runner.hardware.topology import for_nodes, load_profile

MODELS = Path(__file__).resolve().parent / "models"
GPT6, LLAMA6, CHECKPOINTED6 = MODELS / "gpt6.py", MODELS / "llama6.py", MODELS / "checkpointed6.py"
BATCH = 4


def planner(model: Path, world_size: int, precision: str | None = None, sequence_parallel: bool = False) -> ModelSteps:
    profile = for_nodes(load_profile("dgx_a100"), 1, world_size)
    return ModelSteps(model, BATCH, sequence_parallel=sequence_parallel, pricing=Pricing(profile, world_size, world_size, precision))


@pytest.mark.parametrize(
    "model,mesh,precision,sequence_parallel",
    [
        (LLAMA6, (2, 2, 1), None, False),
        (LLAMA6, (1, 1, 2), None, False),
        (LLAMA6, (2, 1, 2), None, True),
        (LLAMA6, (1, 2, 1), "bf16", False),
        (CHECKPOINTED6, (2, 1, 1), None, False),
    ],
    ids=lambda v: v.stem if isinstance(v, Path) else str(v),
)
def test_a_deep_models_step_is_written_out_from_three_of_its_blocks_node_for_node(model, mesh, precision, sequence_parallel):
    dp, fsdp, tp = mesh
    steps = planner(model, dp * fsdp * tp, precision, sequence_parallel)
    assert steps.blocks is not None and steps.blocks[1] == 6
    if tp > 1:  # the tp plan found on the cut model and read out is the one found on the whole
        assert steps.tp_plan(tp) == tensor_parallel_plan(steps.rec, tp)
    gm, slots = steps._capture(dp, fsdp, tp)
    assert steps.blocks is not None, "the planner fell back to tracing the whole model"
    whole = trace_program(steps.rec, steps.layout(dp, fsdp, tp), for_pricing=True)
    assert slots == whole.slots
    assert canonical_nodes(gm) == canonical_nodes(whole.graph)
    # and so priced alike, after the passes (recomputation of the checkpoint calls among them)
    ours, theirs = steps._finished(gm, slots), steps._finished(whole.graph, whole.slots)
    assert ours.memory.to_json() == theirs.memory.to_json() and ours.flops == theirs.flops and len(ours.comms) == len(theirs.comms)


def test_which_models_are_written_out_from_a_few_blocks(tmp_path):
    """The longest list of blocks of one class and shape, at least 4 of them; a model whose blocks
    differ in shape, or that has too few, is traced whole."""
    import torch

    steps = planner(LLAMA6, 2)
    assert find_blocks(steps.state.model) == ("layers", 6)
    assert find_blocks(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])) is None
    widths = torch.nn.Module()
    widths.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4 + i) for i in range(6))
    assert find_blocks(widths) is None


def test_a_model_whose_blocks_cannot_be_written_out_is_traced_whole(tmp_path):
    """Blocks whose residual is added outside them (x = x + block(x)): a node of no block reads
    the middle block's output, which the written-out graph could not place; the planner says so
    and traces the whole model, the same graph as a whole trace."""
    path = tmp_path / "outside_residual.py"
    path.write_text(
        "import torch\n"
        "from torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))\n"
        "        self.head = nn.Linear(16, 4)\n"
        "    def forward(self, x):\n"
        "        for block in self.blocks:\n"
        "            x = x + torch.tanh(block(x))\n"
        "        return self.head(x)\n"
        "def model():\n    return Net()\n"
        "def batch(n):\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)\n"
    )
    notes = []
    profile = for_nodes(load_profile("dgx_a100"), 1, 2)
    steps = ModelSteps(path, BATCH, pricing=Pricing(profile, 2, 2), note=notes.append)
    assert steps.blocks == ("blocks", 5)
    gm, _ = steps._capture(2, 1, 1)
    assert steps.blocks is None and any("tracing the whole model" in n for n in notes), notes
    whole = trace_program(steps.rec, steps.layout(2, 1, 1), for_pricing=True)
    assert canonical_nodes(gm) == canonical_nodes(whole.graph)


def test_a_graph_without_fsdp_derived_from_a_written_out_one_is_the_traced_one():
    """The planner derives a mesh's graph without fsdp from the fsdp=2 graph of its tp degree
    (aot.plan.pricing.derive_without_fsdp); from a written-out graph it must still be the trace
    of that mesh, node for node, and priced alike."""
    from aot.plan.step_reading import analyze
    from aot.capture.graph_reading import storage_key
    from aot.plan.pricing import derive_without_fsdp

    steps = planner(GPT6, 8)
    sharded, _ = steps._capture(2, 2, 1)
    assert steps.blocks is not None
    derived = derive_without_fsdp(steps.mf, steps.state, steps.inputs, steps.targets, steps.layout(8, 1, 1), sharded, "aot.fsdp")
    assert derived is not None
    gm, slots, shared = derived
    traced = trace_program(steps.rec, steps.layout(8, 1, 1), for_pricing=True)
    assert slots == traced.slots
    assert canonical_nodes(gm) == canonical_nodes(traced.graph)
    aliases = {storage_key(a.meta["val"]): storage_key(b.meta["val"]) for a, b in shared}
    ours, theirs = analyze(gm, slots, aliases), analyze(traced.graph, traced.slots)
    assert ours.memory.to_json() == theirs.memory.to_json() and ours.flops == theirs.flops


ZOO = MODELS / "zoo"


def _deeper(tmp_path: Path, family: str, layers: int) -> Path:
    """A zoo model file at `layers` layers: transformers families through tests/models/zoo/families.py,
    torchtitan's llama and nanoGPT by their own depth constant."""
    path = tmp_path / f"{family}{layers}.py"
    if family == "titan_llama":
        text = (ZOO / "titan_llama.py").read_text()
        path.write_text(text.replace("N_LAYERS, N_HEADS, N_KV_HEADS = 128, 16, 64, 2,", f"N_LAYERS, N_HEADS, N_KV_HEADS = 128, 16, 64, {layers},"))
    elif family == "nanogpt":
        path.write_text((ZOO / "nanogpt.py").read_text().replace("n_layer=2,", f"n_layer={layers},"))
    else:
        path.write_text(
            "import importlib.util\n"
            f"_spec = importlib.util.spec_from_file_location('aot_zoo_{family}{layers}', {str(ZOO / 'families.py')!r})\n"
            "zoo = importlib.util.module_from_spec(_spec)\n_spec.loader.exec_module(zoo)\n"
            f"zoo.hf.LLAMA_SHAPES['num_hidden_layers'] = {layers}\n"
            f"model, batch, loss = zoo.model_file({family!r})\n"
        )
    assert path.read_text() != "" and str(layers) in path.read_text()
    return path


@pytest.mark.slow  # three zoo models traced twice each (15 s); CI runs it
@pytest.mark.parametrize(
    "family,layers,composed",
    [("qwen3_moe", 5, True), ("titan_llama", 5, True), ("nanogpt", 5, True), ("gemma3", 8, False)],
)
def test_model_code_as_written_is_written_out_or_traced_whole(tmp_path, family, layers, composed):
    """Users' model code (transformers' Qwen3-MoE, torchtitan's llama with its ModuleDict of
    layers, nanoGPT) deepened to 5 layers is written out from 3 and equals the whole trace under
    fsdp; Gemma 3 at 8 layers, whose 6th is a global attention layer among sliding ones, is
    traced whole (its blocks' settings differ), never written out from three sliding ones."""
    profile = for_nodes(load_profile("dgx_a100"), 1, 2)
    steps = ModelSteps(_deeper(tmp_path, family, layers), BATCH, pricing=Pricing(profile, 2, 2))
    assert (steps.blocks is not None) == composed, steps.blocks
    if not composed:
        return  # traced whole: the planner's graph is the whole trace
    gm, slots = steps._capture(1, 2, 1)
    assert (steps.blocks is not None) == composed
    whole = trace_program(steps.rec, steps.layout(1, 2, 1), for_pricing=True)
    assert slots == whole.slots and canonical_nodes(gm) == canonical_nodes(whole.graph)


def test_which_parameters_the_backward_reads_are_found_on_the_cut_model():
    """The pipeline floor's finding (aot/capture/backward_reads.py: the parameters the loss
    reaches and those the backward reads), made on llama6 cut to 3 blocks and read out to its 6
    (repeated_blocks.widened_reads), is the one its whole forward makes: every parameter
    reached, every one read but the embedding table (its gradient is a scatter of the rows)."""
    from aot.capture.backward_reads import parameters_read_in_backward

    steps = planner(LLAMA6, 4)
    assert steps.blocks is not None and steps.blocks[1] == 6
    steps.pipeline_holdings(2, 1)  # finds them on the cut model
    whole = parameters_read_in_backward(steps.mf, steps.state, steps.rec.inputs, steps.rec.targets)
    assert whole is not None and steps._backward_reads == whole
    assert whole.reached == frozenset(steps.state.params) and whole.reached - whole.read == {"embed_tokens.weight"}
