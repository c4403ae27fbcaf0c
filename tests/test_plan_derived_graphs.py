"""The graphs the planner prices are the build's graphs, however it gets them.

- Traced for pricing (capture_step(tracer=trace_for_pricing): make_fx without generating code): the same
  graph as the build's make_fx trace, node for node, and the same cost-model reading of it.
- Derived without fsdp from the graph with fsdp=2 (aot.plan.pricing.derive_without_fsdp: its forward and
  backward, then the step's end traced alone): the trace of that mesh, node for node.
- Traced ahead of the search (ModelSteps.prefetch, which derives what it can): the same graphs as
  the search traces one by one.
- Derived instead of traced by the cost model (a wider fsdp axis re-read from the fsdp=2 graph,
  fsdp without dp from the dp x fsdp graph): the same predicted step time and FLOPs as the traced
  graph of that mesh, within 1% (collective bytes and peak memory too, on the GPT).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import aot.plan.pricing as pricing
from aot.capture.step import capture_step
from aot.passes.cleanup import drop_profiler_calls, plain_collectives
from aot.plan.step_reading import analyze
from aot.capture.graph_reading import storage_key
from aot.plan.machine import Machine
from aot.plan.layout_traces import prefetch
from aot.plan.mesh import factorizations
from aot.plan.model_steps import ModelSteps, Pricing, Unsupported
from aot.plan.search import Planner
from helpers.graphs import graph_nodes
from runner.hardware.topology import for_nodes, load_profile

REPO = Path(__file__).resolve().parents[1]
MLP = REPO / "examples" / "mlp.py"
GPT = REPO / "examples" / "gpt.py"


def _facts(step) -> tuple:
    return (
        [(o.name, o.target, o.kind, o.flops, o.bytes, o.dtype, o.tensors) for o in step.ops],
        [(c.name, c.kind, c.group, c.bytes, c.input_bytes, c.issue_at, c.wait_at, c.readers) for c in step.comms],
        step.memory.to_json(),
        step.memory.intervals,
        step.memory.resident_tensors,
        step.graph_nodes,
    )


def _variant(tmp_path: Path, name: str, extra: str) -> Path:
    """examples/mlp.py with its model wrapped as `extra` (a class Wrapped taking the MLP) says."""
    path = tmp_path / f"{name}.py"
    path.write_text(MLP.read_text().replace("def model():", "def _model():") + extra + "\n\ndef model():\n    return Wrapped()\n")
    return path


@pytest.mark.parametrize(
    "model,sequence,meshes",
    [
        (MLP, False, [(2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)]),
        (GPT, False, [(2, 1, 1), (2, 2, 2), (1, 2, 4)]),
        (GPT, True, [(2, 2, 2)]),
    ],
)
def test_pricing_trace_is_the_build_trace(model, sequence, meshes):
    steps = ModelSteps(model, 8, sequence_parallel=sequence, pricing=Pricing(world_size=8))
    for mesh in meshes:
        layout = steps.layout(*mesh)
        graphs = [
            capture_step(steps.mf, steps.state, steps.inputs, steps.targets, layout, check_ranks=False, tracer=tracer)
            for tracer in (None, pricing.trace_for_pricing)
        ]
        built, priced = graphs
        assert graph_nodes(priced.graph) == graph_nodes(built.graph), mesh
        assert priced.slots == built.slots
        facts = [_facts(analyze(plain_collectives(drop_profiler_calls(g.graph)), g.slots)) for g in graphs]
        assert facts[0] == facts[1], mesh


def test_pricing_trace_keeps_tensor_constants(tmp_path):
    # a tensor constant in the forward: make_fx interns it as an attribute
    path = _variant(
        tmp_path,
        "mlp_constant",
        """

class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, x):
        return self.net(x) * torch.tensor(2.0)
""",
    )
    steps = ModelSteps(path, 8, pricing=Pricing(world_size=2))
    layout = steps.layout(2, 1, 1)
    built, priced = (
        capture_step(steps.mf, steps.state, steps.inputs, steps.targets, layout, check_ranks=False, tracer=t) for t in (None, pricing.trace_for_pricing)
    )
    assert graph_nodes(priced.graph) == graph_nodes(built.graph)
    assert any(n.op == "get_attr" for n in priced.graph.graph.nodes)


@pytest.mark.parametrize(
    "model,sequence,pairs",
    [
        (MLP, False, [((2, 2, 1), (2, 1, 1)), ((1, 2, 1), (1, 1, 1)), ((2, 2, 2), (4, 1, 2))]),
        (GPT, False, [((2, 2, 1), (8, 1, 1)), ((1, 2, 4), (2, 1, 4))]),
        (GPT, True, [((2, 2, 2), (2, 1, 2))]),
    ],
)
def test_graph_without_fsdp_derived_is_the_traced_one(model, sequence, pairs):
    steps = ModelSteps(model, 8, sequence_parallel=sequence, pricing=Pricing(world_size=8))
    for sharded, plain in pairs:
        sharded_gm, _ = steps._capture(*sharded)
        derived = pricing.derive_without_fsdp(steps.mf, steps.state, steps.inputs, steps.targets, steps.layout(*plain), sharded_gm, "aot.fsdp")
        assert derived is not None, (sharded, plain)
        gm, slots, shared = derived
        traced = capture_step(steps.mf, steps.state, steps.inputs, steps.targets, steps.layout(*plain), check_ranks=False)
        traced_gm = plain_collectives(drop_profiler_calls(traced.graph))
        assert graph_nodes(gm) == graph_nodes(traced_gm), plain
        assert slots == traced.slots
        aliases = {storage_key(a.meta["val"]): storage_key(b.meta["val"]) for a, b in shared}
        assert _facts(analyze(gm, slots, aliases)) == _facts(analyze(traced_gm, traced.slots)), plain


def test_graph_without_fsdp_is_traced_where_it_cannot_be_derived(tmp_path):
    # an unused parameter has no gradient, so no reduce-scatter: not the form the derivation reads
    path = _variant(
        tmp_path,
        "mlp_spare",
        """

class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _model()
        self.spare = nn.Linear(4, 4)

    def forward(self, x):
        return self.net(x)
""",
    )
    steps = ModelSteps(path, 8, pricing=Pricing(world_size=4))
    sharded_gm, _ = steps._capture(2, 2, 1)
    assert pricing.derive_without_fsdp(steps.mf, steps.state, steps.inputs, steps.targets, steps.layout(2, 1, 1), sharded_gm, "aot.fsdp") is None
    steps._derived = {(True, 2, 1): [((True, 1, 1), (2, 1, 1))]}
    graphs = steps._trace((True, 2, 1), (2, 2, 1))
    assert _facts(graphs[(True, 1, 1)]) == _facts(steps.capture(2, 1, 1))


def _machine(topology: str, world: int) -> Machine:
    profile = load_profile(topology)
    profile = for_nodes(profile, max(1, world // 8) if profile["device_kind"] == "cuda" else world)
    return Machine(for_nodes(profile, None, world), world)


def _search_all(steps: ModelSteps, world: int, axes=("dp", "fsdp", "tp")) -> None:
    for shape in factorizations(world, axes):
        try:
            steps(axes, shape)
        except Unsupported:
            pass


# mlp on 8 ranks: fsdp 1 and 2 at tp 1, 2 and 4, fsdp 1 at tp 8; gpt on 4 ranks, tp up to 2
@pytest.mark.parametrize("model,world,max_tp,keys,derived", [(MLP, 8, 8, 7, 3), (GPT, 4, 2, 4, 2)])
def test_prefetch_gives_the_graphs_traced_one_by_one(model, world, max_tp, keys, derived):
    """prefetch makes every graph the search asks for, deriving the meshes without fsdp; each is
    what the search traces one by one without it."""
    axes = ("dp", "fsdp", "tp")
    lazy = ModelSteps(model, 8, pricing=Pricing(world_size=world, max_tp=max_tp))
    _search_all(lazy, world)
    assert not lazy._derived
    ahead = ModelSteps(model, 8, pricing=Pricing(world_size=world, max_tp=max_tp))
    prefetch(ahead, axes)
    assert len(ahead.traced) == keys
    assert sum(len(v) for v in ahead._derived.values()) == derived
    assert ahead._tp_plans == lazy._tp_plans
    assert sorted(lazy.traced) == sorted(ahead.traced)
    for key in ahead.traced:
        assert _facts(ahead.traced[key]) == _facts(lazy.traced[key]), key


def _derived_and_traced(model: Path, topology: str, world: int = 8):
    """(mesh, prediction from the derived graph, from the traced graph, derived graph, traced graph)
    for every mesh of `world` ranks whose graph the cost model derives (fsdp > 2, or fsdp without dp)."""
    axes = ("dp", "fsdp", "tp")
    machine = _machine(topology, world)
    steps = ModelSteps(model, 8, pricing=Pricing(world_size=world, max_tp=machine.per_node))
    planner = Planner(machine, steps)
    for shape in factorizations(world, axes):
        dp, fsdp, tp = shape
        if fsdp == 1 or steps._source(dp, fsdp, tp) == (dp, fsdp, tp):
            continue  # traced, not derived
        try:
            derived = steps(axes, shape)
        except Unsupported:
            continue
        traced = steps.capture(dp, fsdp, tp)
        a, b = (planner.evaluate(axes, shape, 25.0, step=g).prediction for g in (derived, traced))
        yield shape, a, b, derived, traced


@pytest.mark.parametrize("model,topology", [(GPT, "dgx_a100"), (MLP, "dgx_a100"), (MLP, "cpu")])
def test_derived_graphs_predict_the_traced_step_time(model, topology):
    compared = 0
    for shape, a, b, derived, traced in _derived_and_traced(model, topology):
        assert a.step_s == pytest.approx(b.step_s, rel=0.01), shape
        assert a.compute_s == pytest.approx(b.compute_s, rel=0.01), shape
        assert derived.flops == pytest.approx(traced.flops, rel=0.01), shape
        assert len(derived.ops) == len(traced.ops) and a.collectives == b.collectives, shape
        assert (a.memory.params, a.memory.optimizer) == (b.memory.params, b.memory.optimizer), shape
        if model == GPT:
            assert a.comm_bytes == pytest.approx(b.comm_bytes, rel=0.01), shape
            assert a.memory.peak == pytest.approx(b.memory.peak, rel=0.02), shape
        compared += 1
    assert compared >= 3


@pytest.mark.xfail(
    strict=True,
    reason="derived_steps.ShardScale resizes a flat tensor by its numel alone: in the "
    "small MLP a padded whole parameter at fsdp=2 has the numel of another parameter's shard "
    "(2048: layer 1's weight, half of layer 2's), so gathered buffers and some collectives are "
    "resized as shards (collective bytes -3% at fsdp=4,tp=2; peak memory -12% at fsdp=8)",
)
def test_derived_graphs_match_traced_bytes_and_memory_on_small_parameters():
    for topology in ("dgx_a100", "cpu"):
        for shape, a, b, _, _ in _derived_and_traced(MLP, topology):
            assert a.comm_bytes == pytest.approx(b.comm_bytes, rel=0.01), shape
            assert a.memory.peak == pytest.approx(b.memory.peak, rel=0.02), shape
