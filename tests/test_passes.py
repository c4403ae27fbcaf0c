"""Each graph pass on its own: what it changes in the graph, and that the numbers stay the same.

The graphs are real captured training steps (examples/mlp.py with a 2-rank gradient reduction).
To run them numerically in one process, the graph's group name is bound to a world-size-1 gloo
group: all_reduce is then the identity and every pass must leave the results bit-identical.
"""

from __future__ import annotations

import copy
from pathlib import Path
import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group

from aot.capture.model_file import load_model_file
from aot.capture.step import Group, StepLayout, capture_step
from aot.capture.training_state import build_training_state
from aot.passes import bucket_all_reduces, drop_profiler_calls, issue_early_wait_late, run_passes
from aot.passes.graph_utils import ALL_GATHER, ALL_REDUCE, WAIT, copy_graph, funcol, is_call
from helpers.commands import EXAMPLES
from runner.execution.graph_loader import wait_at_issue
from runner.execution.init_program import replay

GROUP = "aot.test"


@pytest.fixture(scope="module", autouse=True)
def single_rank_group():
    started = not dist.is_initialized()
    if started:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
    _register_process_group(GROUP, dist.group.WORLD)
    yield
    # Later tests build in this process; a tensor-parallel capture needs its own (fake) group.
    if started:
        dist.destroy_process_group()


def capture(model="mlp.py", axis="dp"):
    mf = load_model_file(EXAMPLES / model if "/" not in model else Path(model))
    state = build_training_state(mf, seed=0, max_steps=10)
    inputs, targets = mf.batch(4)
    # size 1: the average over the (single-rank) group is the identity, so results are checkable
    step = capture_step(mf, state, [inputs], targets, StepLayout(**{axis: Group(GROUP, 1)}))
    step.example_args = _real_arguments(state, step)
    return step


def _real_arguments(state, step):
    """The step's inputs with real values: the build traces on fake tensors and stores no state,
    so the weights come from the init program (as the runner makes them) and the optimizer
    state from its recorded initial values."""
    made = replay(state.init_graph, [*state.params, *state.buffers], 0)
    args = []
    for slot, arg in zip(step.slots, step.example_args):
        if slot["kind"] in ("param", "buffer"):
            args.append(made[slot["name"]].reshape(arg.shape))
        elif slot["kind"] == "optim":
            args.append(torch.full(arg.shape, state.optimizer_fills[f"{slot['name']}:{slot['key']}"], dtype=arg.dtype))
        else:
            args.append(arg)
    return args


def run_graph(gm, args):
    """`gm` run on copies of `args`, each collective waited for where it is issued, as the runner
    runs programs on gloo (runner.execution.graph_loader.wait_at_issue: torch 2.13's gloo corrupts
    its heap with many collectives of one group in flight; seen here as a segfault once)."""
    fresh = [a.clone() for a in args]
    torch.manual_seed(0)  # the same draws for graphs with dropout
    out = wait_at_issue(copy_graph(gm))(*fresh)
    return [o.clone() for o in out], fresh


def first_use(gm, node):
    return next(n for n in gm.graph.nodes if n in node.users)


def count(gm, target):
    return sum(1 for n in gm.graph.nodes if is_call(n, {target}))


def position(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def test_capture_has_one_all_reduce_per_gradient_and_loss():
    step = capture()
    params = sum(1 for s in step.slots if s["kind"] == "param")
    assert count(step.graph, ALL_REDUCE) == params + 1
    assert count(step.graph, WAIT) == params + 1


def test_drop_profiler_calls_removes_only_profiler_ops():
    step = capture()
    before, _ = run_graph(step.graph, step.example_args)
    profiler_ops = [n for n in step.graph.graph.nodes if n.op == "call_function" and "profiler" in str(n.target)]
    assert profiler_ops, "torch.optim's record_function should appear in a raw capture"
    gm = drop_profiler_calls(step.graph)
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and "profiler" in str(n.target)]
    after, _ = run_graph(gm, step.example_args)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("bucket_bytes,expected", [(2**30, 1), (1, None)])
def test_bucketing_counts_and_numbers(bucket_bytes, expected):
    step = capture()
    n_reduces = count(step.graph, ALL_REDUCE)
    before_out, before_state = run_graph(step.graph, step.example_args)
    gm = bucket_all_reduces(drop_profiler_calls(step.graph), bucket_bytes)
    after_out, after_state = run_graph(gm, step.example_args)
    # one bucket when everything fits; with 1-byte buckets every all_reduce stays on its own
    assert count(gm, ALL_REDUCE) == (expected if expected is not None else n_reduces)
    assert all(torch.equal(a, b) for a, b in zip(before_out, after_out))
    # the step's in-place updates (weights, momentum) are the same too
    assert all(torch.equal(a, b) for a, b in zip(before_state, after_state))


def test_bucketing_respects_bucket_size():
    step = capture()
    grads = [n.args[0].meta["val"] for n in step.graph.graph.nodes if is_call(n, {ALL_REDUCE})]
    largest = max(g.numel() * g.element_size() for g in grads)
    gm = bucket_all_reduces(drop_profiler_calls(step.graph), largest)
    buckets = count(gm, ALL_REDUCE)
    assert 1 < buckets < len(grads)


def test_bucketing_never_fuses_dependent_all_reduces():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    first = graph.call_function(funcol.all_reduce.default, (x, "sum", GROUP))
    first_wait = graph.call_function(funcol.wait_tensor.default, (first,))
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (first_wait, 2))
    second = graph.call_function(funcol.all_reduce.default, (doubled, "sum", GROUP))
    second_wait = graph.call_function(funcol.wait_tensor.default, (second,))
    graph.output((first_wait, second_wait))
    example = torch.ones(3)
    for node in graph.nodes:  # the pass reads shapes from tracing metadata
        if node.op != "output":
            node.meta["val"] = example
    gm = bucket_all_reduces(torch.fx.GraphModule(torch.nn.Module(), graph), 2**30)
    assert count(gm, ALL_REDUCE) == 2
    a, b = gm(torch.arange(3.0))
    assert torch.equal(a, torch.arange(3.0)) and torch.equal(b, 2 * torch.arange(3.0))


def test_bucketing_fuses_gradients_reduced_over_one_group_then_another():
    """Gradients summed over one group, then averaged over another (tp then ep, under ep x tp): both
    groups' all_reduces are bucketed, the second bucket reading the first's results; a transposed
    gradient (a batched matmul's) is made contiguous before it is flattened into its bucket."""
    second_group = "aot.test.second"
    _register_process_group(second_group, dist.group.WORLD)
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    transposed = graph.call_function(torch.ops.aten.transpose.int, (y, 0, 1))
    waited = []
    for source in (x, transposed):
        first = graph.call_function(funcol.all_reduce.default, (source, "sum", GROUP))
        first_wait = graph.call_function(funcol.wait_tensor.default, (first,))
        second = graph.call_function(funcol.all_reduce.default, (first_wait, "sum", second_group))
        waited.append(graph.call_function(funcol.wait_tensor.default, (second,)))
    graph.output(tuple(waited))
    values = {"x": torch.arange(6.0).reshape(2, 3), "y": torch.arange(6.0).reshape(3, 2)}
    for node in graph.nodes:  # the pass reads shapes (and layouts) from tracing metadata
        if node.op == "placeholder":
            node.meta["val"] = values[node.name]
        elif node.op != "output":
            source = node.args[0].meta["val"]
            node.meta["val"] = source.t() if node.target is torch.ops.aten.transpose.int else source
    gm = bucket_all_reduces(torch.fx.GraphModule(torch.nn.Module(), graph), 2**30)
    assert count(gm, ALL_REDUCE) == 2  # one bucket per group
    a, b = gm(values["x"], values["y"])
    assert torch.equal(a, values["x"]) and torch.equal(b, values["y"].t())


def test_overlap_issues_collectives_during_backward_and_waits_late():
    step = capture()
    grads = [n.args[0].meta["val"] for n in step.graph.graph.nodes if is_call(n, {ALL_REDUCE})]
    before_out, before_state = run_graph(step.graph, step.example_args)
    gm = bucket_all_reduces(drop_profiler_calls(step.graph), max(g.numel() * 4 for g in grads))
    gm = issue_early_wait_late(gm)
    pos = position(gm)
    reduces = [n for n in gm.graph.nodes if is_call(n, {ALL_REDUCE})]
    matmuls = [n for n in gm.graph.nodes if is_call(n, {torch.ops.aten.mm.default})]
    # the first bucket goes out while backward still has matrix products to compute ...
    assert pos[reduces[0]] < pos[matmuls[-1]]
    for node in reduces:
        wait = next(iter(node.users))
        # ... and each wait sits right before the first use of its result
        assert first_use(gm, wait) == wait.next or is_call(wait.next, {torch.ops.aten.split_with_sizes.default})
    # every bucket but the last (issued when backward is done) has compute to hide behind
    for node in reduces[:-1]:
        assert pos[next(iter(node.users))] - pos[node] > 1
    after_out, after_state = run_graph(gm, step.example_args)
    assert all(torch.equal(a, b) for a, b in zip(before_out, after_out))
    assert all(torch.equal(a, b) for a, b in zip(before_state, after_state))


def test_pipeline_composes_on_gpt():
    step = capture("gpt.py")
    before_out, before_state = run_graph(step.graph, step.example_args)
    gm = run_passes(step.graph)
    assert count(gm, ALL_REDUCE) == 1
    after_out, after_state = run_graph(gm, step.example_args)
    assert all(torch.equal(a, b) for a, b in zip(before_out, after_out))
    assert all(torch.equal(a, b) for a, b in zip(before_state, after_state))


def test_fsdp_gathers_are_prefetched_one_parameter_ahead():
    step = capture("gpt.py", axis="fsdp")
    before_out, before_state = run_graph(step.graph, step.example_args)
    gm = run_passes(step.graph)
    pos = position(gm)
    gathers = sorted((n for n in gm.graph.nodes if is_call(n, {ALL_GATHER})), key=lambda g: pos[next(iter(g.users))])
    waits = [next(iter(g.users)) for g in gathers]
    # every parameter gathered for forward; those backward needs (weights) gathered again there
    params = sum(1 for s in step.slots if s["kind"] == "param")
    assert params < len(gathers) < 2 * params
    for k in range(1, len(gathers)):
        # issued while the previous parameter's layer is about to compute, not all at the start
        assert pos[gathers[k]] < pos[waits[k - 1]]
        if k >= 2:
            assert pos[gathers[k]] > pos[waits[k - 2]]
    # the reduce-scattered gradients and every result are unchanged
    assert count(gm, torch.ops._c10d_functional.reduce_scatter_tensor.default) == params
    after_out, after_state = run_graph(gm, step.example_args)
    assert all(torch.equal(a, b) for a, b in zip(before_out, after_out))
    assert all(torch.equal(a, b) for a, b in zip(before_state, after_state))


def test_fsdp_regathers_parameters_for_backward_and_lowers_peak_memory():
    """Backward uses a fresh gather, so no forward copy of a full parameter outlives its layer's
    forward; the predicted peak (graph liveness) drops, and results are bit-identical."""
    from aot.passes.cleanup import plain_collectives
    from aot.passes.overlap import issue_early_wait_late
    from aot.capture.graph_reading import loss_node as _loss_node
    from aot.passes.regather import _view_chain, regather_in_backward
    from aot.plan.step_reading import analyze

    step = capture("gpt.py", axis="fsdp")
    before_out, before_state = run_graph(step.graph, step.example_args)
    kept = issue_early_wait_late(plain_collectives(drop_profiler_calls(step.graph)))
    peak_kept = analyze(kept, step.slots).memory.peak_transient
    gm = regather_in_backward(kept)
    pos = position(gm)
    turn = pos[_loss_node(gm.graph)]
    forward = [g for g in gm.graph.nodes if is_call(g, {ALL_GATHER}) and pos[g] < turn]
    backward = [g for g in gm.graph.nodes if is_call(g, {ALL_GATHER}) and pos[g] > turn]
    assert backward and len(backward) < len(forward)
    for gather in forward:  # nothing after the loss reads a forward gather or a view of it
        chain = _view_chain(next(iter(gather.users)))
        assert all(pos[u] < turn for node in chain for u in node.users), gather
    assert analyze(gm, step.slots).memory.peak_transient < peak_kept
    after_out, after_state = run_graph(gm, step.example_args)
    assert all(torch.equal(a, b) for a, b in zip(before_out, after_out))
    assert all(torch.equal(a, b) for a, b in zip(before_state, after_state))


def test_fsdp_prefetch_holds_gathered_parameters_within_its_memory_budget():
    """A larger budget issues gathers further ahead (the predicted transient peak grows with it);
    at every wait, the parameters gathered ahead of it fit the budget (or are just the next one);
    results are bit-identical whatever the budget."""
    from aot.passes.cleanup import plain_collectives
    from aot.passes.graph_utils import tensor_bytes
    from aot.passes.overlap import issue_early_wait_late
    from aot.passes.prefetch import prefetch_parameter_gathers
    from aot.passes.regather import regather_in_backward
    from aot.plan.step_reading import analyze

    step = capture("gpt.py", axis="fsdp")
    before_out, before_state = run_graph(step.graph, step.example_args)
    peaks, depths = [], []
    for budget in (None, 64 * 2**10, 256 * 2**10, 2**30):
        gm = issue_early_wait_late(plain_collectives(drop_profiler_calls(copy.deepcopy(step.graph))))
        gm = prefetch_parameter_gathers(regather_in_backward(gm), budget)
        pos = position(gm)
        gathers = sorted((n for n in gm.graph.nodes if is_call(n, {ALL_GATHER})), key=lambda g: pos[next(iter(g.users))])
        waits = [next(iter(g.users)) for g in gathers]
        deepest = 0
        for j, wait in enumerate(waits):
            ahead = [g for g in gathers[j + 1 :] if pos[g] < pos[wait]]
            deepest = max(deepest, len(ahead))
            assert len(ahead) <= 1 or sum(tensor_bytes(g) for g in ahead) <= (budget or 0)
            assert j + 1 == len(gathers) or gathers[j + 1] in ahead  # always at least one ahead
        depths.append(deepest)
        peaks.append(analyze(gm, step.slots).memory.peak_transient)
        after_out, after_state = run_graph(gm, step.example_args)
        assert all(torch.equal(a, b) for a, b in zip(before_out, after_out))
        assert all(torch.equal(a, b) for a, b in zip(before_state, after_state))
    assert depths[0] == 1 and depths[1] < depths[2] < depths[3]
    assert peaks[0] <= peaks[1] <= peaks[2] < peaks[3]


def test_overlap_never_moves_a_collective_above_a_transfer_on_its_group():
    """A pipeline rank's all_reduce over the pipeline group whose input is a constant there (a
    stage without the loss) must stay after the rank's transfers on that group: the group runs
    operations in the order each rank issues them, and the other ranks issue theirs later (the
    build deadlocked when an expert-capacity count was all_reduced so)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from aot.passes.overlap import issue_early_wait_late

    funcol = torch.ops._c10d_functional

    def program(x):
        constant = torch.zeros(2)  # made first, as the pipeline step's sums are
        received = funcol.wait_tensor(funcol.irecv(torch.empty(4), 1, 0, "aot.pp"))
        y = (x * received).sum()
        total = funcol.wait_tensor(funcol.all_reduce(constant, "sum", "aot.pp"))
        return y + total.sum()

    gm = make_fx(program, tracing_mode="fake")(torch.ones(4))
    gm = issue_early_wait_late(gm)
    pos = position(gm)
    (recv,) = [n for n in gm.graph.nodes if "irecv" in str(n.target)]
    (reduce,) = [n for n in gm.graph.nodes if is_call(n, {ALL_REDUCE})]
    assert pos[recv] < pos[reduce]


def test_a_malformed_graph_is_caught_once_per_run_of_the_passes():
    """The passes check the graph they leave (graph.lint()); run_passes checks once after its last
    pass instead of after each (aot.passes.graph_utils.lint_once): a graph a pass left malformed
    (here: a node reading a value made after it) is still refused, by run_passes, and by a pass run
    on its own."""
    from aot.passes.graph_utils import lint, lint_once

    def malformed() -> torch.fx.GraphModule:
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        y = graph.call_function(torch.ops.aten.relu.default, (x,))
        z = graph.call_function(torch.ops.aten.neg.default, (y,))
        graph.output(z)
        y.prepend(z)  # z now comes before the value it reads
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    with pytest.raises(RuntimeError, match="used before it has been defined"):
        lint(malformed().graph)
    with lint_once():
        lint(malformed().graph)  # deferred: the caller checks the graph it ends with
    with pytest.raises(RuntimeError, match="used before it has been defined"):
        run_passes(malformed(), only=("drop_profiler_calls",))
