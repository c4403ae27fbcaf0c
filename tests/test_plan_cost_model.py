"""The cost model: op costs, graph reading, memory liveness, overlap, bucketing and derived meshes."""

from __future__ import annotations

import dataclasses

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from aot.capture.model_file import load_model_file
from aot.capture.step import Group, StepLayout, capture_step
from aot.capture.training_state import build_training_state
from aot.passes import PassOptions, run_passes
from aot.passes.cleanup import drop_profiler_calls, plain_collectives
from aot.plan.cost_model import CommSite, Memory, Op, StepGraph, microbatched_seconds, simulate
from aot.plan.step_reading import analyze
from aot.plan.derived_steps import drop_group, rescale, shard_scale
from aot.plan.cpu_gloo_model import CpuGlooModel, median_of_sum
from aot.plan.gpu_model import GpuModel
from aot.plan.machine import Machine
from aot.plan.rebucket import rebucket
from helpers.commands import REPO, TIMEOUT, clean_env
from runner.execution.data import split_batch_tensors
from runner.hardware.topology import load_profile

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_roofline_with_overhead():
    cpu = CpuGlooModel({"default": 1e12}, 1e9, 1e-5)
    # 2 GFLOP at 1 TFLOP/s = 2 ms; 1 MB at 1 GB/s = 1 ms: compute-bound, plus 10 us of dispatch
    assert cpu.op_seconds(2e9, 1e6, "float32") == pytest.approx(2e-3 + 1e-5)
    gpu = GpuModel({"default": 1e12}, 1e9, 1e-5)
    assert gpu.op_seconds(2e9, 1e6, "float32") == pytest.approx(2e-3)  # launch hidden behind work
    assert gpu.op_seconds(1e3, 1e2, "float32") == pytest.approx(1e-5)  # launch-bound
    cached = CpuGlooModel({"default": 1e12}, 1e9, 0.0, bandwidth_by_bytes=((1e5, 1e10),), efficiency=0.5)
    # 1e4 bytes fit the 1e5-byte level (10 GB/s): 1 us of work, at half the roofline 2 us
    assert cached.op_seconds(0.0, 1e4, "float32") == pytest.approx(2e-6)
    assert cached.op_seconds(0.0, 1e6, "float32") == pytest.approx(2e-3)


def test_measured_elementwise_rates_and_foreach_kernels():
    """CPU ops with a measured time per element take at least that (GELU's arithmetic is not in
    any FLOP count); a foreach op pays its dispatch once and a smaller cost per extra tensor."""
    cpu = CpuGlooModel({"default": 1e12}, 1e9, 1e-5, element_seconds={"gelu": 4e-9}, foreach_tensor_s=1e-6)
    # 1e6 elements: bytes 8e6 at 1 GB/s = 8 ms against 4 ms of measured arithmetic: bytes win
    assert cpu.op_seconds(0.0, 8e6, "float32", target="gelu", elements=10**6) == pytest.approx(8e-3 + 1e-5)
    # in cache-sized working sets the arithmetic wins: 4 ns x 1e5 = 0.4 ms against 0.8 ms moved... at 10 GB/s
    fast = CpuGlooModel({"default": 1e12}, 1e10, 1e-5, element_seconds={"gelu": 4e-9})
    assert fast.op_seconds(0.0, 8e5, "float32", target="gelu", elements=10**5) == pytest.approx(4e-4 + 1e-5)
    assert fast.op_seconds(0.0, 8e5, "float32", target="relu", elements=10**5) == pytest.approx(8e-5 + 1e-5)
    # a foreach add over 28 tensors: one dispatch and 27 more tensors at 1 us
    assert cpu.op_seconds(0.0, 0.0, "float32", launches=28) == pytest.approx(1e-5 + 27e-6)
    gpu = GpuModel({"default": 1e12}, 1e9, 1e-5)
    assert gpu.op_seconds(0.0, 0.0, "float32", launches=28) == pytest.approx(1e-5)  # fused: one launch

    def f(xs, ys, x):
        torch._foreach_add_(xs, ys)
        return torch.nn.functional.gelu(x)

    gm = make_fx(f, tracing_mode="fake")([torch.randn(3) for _ in range(5)], [torch.randn(3) for _ in range(5)], torch.randn(4, 8))
    ops = {op.target: op for op in analyze(gm).ops if op.kind == "compute"}
    assert ops["gelu"].elements == 32 and ops["gelu"].launches == 1
    foreach = next(op for name, op in ops.items() if name.startswith("_foreach_add"))
    assert foreach.launches == 5
    # in place, it returns nothing: it reads xs and ys and writes xs (5 x 3 floats each)
    assert foreach.bytes == 3 * 15 * 4 and foreach.elements == 15


def test_measured_call_costs_per_op():
    """With a calibrated table of call costs an op pays its own (a foreach op its cost on one tensor
    and its per-tensor cost for the rest), an op the table lacks the table's median, and every op
    op_overhead_s on top (what a whole step adds beyond a call timed alone)."""
    table = {"relu": (4e-6, 0.0), "addmm": (12e-6, 0.0), "gelu": (20e-6, 0.0), "_foreach_add_": (10e-6, 5e-6)}
    cpu = CpuGlooModel({"default": 1e12}, 1e12, 3e-6, foreach_tensor_s=1e-6, dispatch_s=table)
    assert cpu.op_seconds(0.0, 0.0, "float32", target="relu") == pytest.approx(4e-6 + 3e-6)
    assert cpu.op_seconds(0.0, 0.0, "float32", target="_foreach_add_", launches=6) == pytest.approx(10e-6 + 5 * 5e-6 + 3e-6)
    # not in the table: the median call (12 us of 4, 10, 12, 20 -> 11 us), foreach_tensor_s per further tensor
    assert cpu.op_seconds(0.0, 0.0, "float32", target="stack") == pytest.approx(11e-6 + 3e-6)
    assert cpu.op_seconds(0.0, 0.0, "float32", target="_foreach_mul", launches=3) == pytest.approx(11e-6 + 2e-6 + 3e-6)
    # a GPU launches asynchronously: its launch hides the call, and it has no such table
    gpu = GpuModel({"default": 1e12}, 1e12, 5e-6)
    assert gpu.op_seconds(0.0, 0.0, "float32", target="gelu") == pytest.approx(5e-6)


def test_a_gpu_prices_each_op_class_at_its_fraction_of_peak():
    """An A100 (312 TFLOP/s dense bf16, 19.5 fp32, 2039 GB/s): matmul-like ops at 60% of the
    dtype's dense peak, FLOPs of other ops at 60% of the CUDA cores' fp32 rate, bytes at 80% of the
    bandwidth, each op at least a 5 us launch that overlaps the work before it; a calibrated
    profile's rates replace the defaults, its CPU-only tables do not apply."""
    a100 = Machine(load_profile("dgx_a100"), 8)
    gpu = a100.compute
    assert isinstance(gpu, GpuModel) and gpu.overlaps_communication and not gpu.calibrated
    n = 8192
    matmul = gpu.op_seconds(2 * n**3, 3 * n * n * 2, "bfloat16", target="mm")
    assert matmul == pytest.approx(2 * n**3 / (0.6 * 312e12))
    # the same FLOPs in an elementwise op run on the CUDA cores: 16x slower than on the tensor cores
    assert gpu.op_seconds(2 * n**3, 0.0, "bfloat16", target="add") == pytest.approx(2 * n**3 / (0.6 * 19.5e12))
    assert gpu.op_seconds(0.0, 1e9, "bfloat16", target="gelu") == pytest.approx(1e9 / (0.8 * 2039e9))
    assert gpu.op_seconds(0.0, 4e3, "float32", target="add", launches=28) == pytest.approx(5e-6)
    assert gpu.view_seconds() == pytest.approx(5e-6) and gpu.blocking_stall([1e-3, 2e-3]) == 0.0
    measured = {
        "flops_per_s": {"float32": 1.5e13, "bfloat16": 2.5e14},
        "memory_bytes_per_s": 1.6e12,
        "op_overhead_s": 4e-6,
        "view_overhead_s": 4e-6,
        "efficiency": 0.5,
        "element_seconds": {"gelu": 1.0},
        "dispatch_s": {"mm": [1.0, 0.0]},
        "collective_stall_s": 1.0,
    }
    calibrated = Machine({**load_profile("dgx_a100"), "compute": measured}, 8).compute
    assert calibrated.calibrated and calibrated.collective_stall_s == 0.0
    assert calibrated.op_seconds(2 * n**3, 0.0, "bfloat16", target="mm") == pytest.approx(2 * n**3 / 2.5e14 / 0.5)
    assert calibrated.op_seconds(0.0, 1e9, "float32", target="gelu", elements=10**8) == pytest.approx(1e9 / 1.6e12 / 0.5)
    assert calibrated.op_seconds(0.0, 0.0, "float32", target="mm") == pytest.approx(4e-6)


def test_planning_for_gpus_never_imports_the_cpu_model():
    """The CPU gloo model (its stall tables and statistics) is a plugin a cpu profile loads: an
    `aot plan` on dgx_a100, in a fresh interpreter, leaves it out; a cpu profile then loads it."""
    code = """if True:
        import sys
        from aot.cli import main
        sys.argv = ["aot", "plan", "examples/mlp.py", "--topology", "dgx_a100", "--world-size", "8", "--axes", "dp", "--json"]
        try:
            main()
        except SystemExit as e:
            assert not e.code, e.code
        print("gpu", "aot.plan.gpu_model" in sys.modules, "aot.plan.cpu_gloo_model" in sys.modules, file=sys.stderr)
        from aot.plan.machine import Machine
        from runner.hardware.topology import load_profile
        Machine(load_profile("cpu"), 2)
        print("cpu", "aot.plan.cpu_gloo_model" in sys.modules, file=sys.stderr)
    """
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["plans"][0]["strategy"] == "dp=8"
    assert "gpu True False" in r.stderr and "cpu True" in r.stderr


def test_calibrated_call_costs_cover_the_reference_step_and_common_training_ops():
    from aot.plan.calibrate import _reference_step
    from aot.plan.cpu_op_costs import measure_dispatch_seconds

    gm, _, args = _reference_step(torch.device("cpu"), 4, 1)
    before = [a.clone() for a in args]
    table = measure_dispatch_seconds(torch.device("cpu"), gm, args, reps=3)
    assert all(torch.equal(a, b) for a, b in zip(args, before))  # timed on copies
    targets = {op.target for op in analyze(gm).ops if op.kind == "compute"}
    assert targets <= set(table)
    assert {"relu", "threshold_backward", "_foreach_mul", "embedding", "linalg_vector_norm"} <= set(table)
    assert all(one > 0 and per_tensor >= 0 for one, per_tensor in table.values())
    assert table["_foreach_add_"][1] > 0  # Adam's in-place updates loop over 13 tensors
    # _foreach_pow(scalar, tensors) runs one kernel per tensor of its second argument
    pow_op = next(op for op in analyze(gm).ops if op.target == "_foreach_pow")
    assert pow_op.launches == 13


def test_microbatched_seconds_run_forward_and_backward_per_microbatch_and_the_step_end_once():
    """A pipeline's lower bound (aot.plan.search.Planner.pipeline_may_win): on an A100 a large
    matmul split in 4 costs the same FLOPs, a launch-bound op costs 4 launches, and the step's end
    (from the first read of a reduced gradient) runs once."""
    gpu = Machine(load_profile("dgx_a100"), 8).compute
    n = 8192
    ops = [
        Op("mm", "mm", flops=2 * n**3, bytes=3 * n * n * 2, dtype="bfloat16"),
        Op("tiny", "add", flops=64, bytes=768),
        Op("adam", "add", flops=64, bytes=768),  # reads the reduced gradient: the step's end
    ]
    grad = CommSite("g", "all_reduce", "aot.dp", 256, 256, "float32", 1, 2, input_numel=64)
    step = StepGraph(ops=ops, comms=[grad], memory=Memory(), graph_nodes=3)
    mm, tiny = (gpu.op_seconds(op.flops, op.bytes, op.dtype, target=op.target) for op in ops[:2])
    assert microbatched_seconds(step, gpu, 1) == pytest.approx(mm + 2 * tiny)
    assert microbatched_seconds(step, gpu, 4) == pytest.approx(mm + 4 * tiny + tiny)


def test_a_pipelines_lower_bound_takes_only_the_microbatch_counts_its_batch_splits_into():
    """Planner.pipeline_may_win bounds a pipeline by the smallest bubble of the microbatch counts
    pipeline_plan tries (1, 2 and 4 per pipeline rank). A batch of 2 at pp=2 splits into 2
    microbatches only, whose smallest bubble (zero-bubble's, 1/7) is far above 8 microbatches'
    (1/25): a plan without pp between the two bounds is beaten by no pipeline of that batch."""
    from aot.plan.cost_model import Prediction
    from aot.plan.placement import identity
    from aot.plan.search import Plan, Planner

    machine = Machine(load_profile("dgx_a100"), 8)
    n = 8192
    step = StepGraph(ops=[Op("mm", "mm", flops=2 * n**3, bytes=3 * n * n * 2, dtype="bfloat16")], comms=[], memory=Memory(), graph_nodes=1)
    work = microbatched_seconds(step, machine.compute, 2)
    loose, tight = work / 8 / (1 - 1 / 25), work / 8 / (1 - 1 / 7)
    per_sample = (loose + tight) / 2
    prediction = Prediction(step_s=8 * per_sample, compute_s=0.0, comm_s=0.0, exposed_comm_s=0.0, collectives=0, comm_bytes=0, algorithms={}, memory=Memory())
    best = Plan(("dp",), (8,), 25.0, identity(("dp",), (8,)), prediction, fits=True)
    may_win = lambda batch_size: Planner(machine, lambda axes, shape: step, batch_size=batch_size).pipeline_may_win([best], 2)  # noqa: E731
    assert may_win(8) and may_win(None)  # 8 microbatches: the loose bound, below the plan
    assert not may_win(2)  # 2 microbatches only: the plan is faster than any pipeline could be
    assert may_win(3)  # no microbatch count fits: pipeline_plan says why, so it is tried


def test_graph_reading_counts_flops_bytes_views_and_liveness():
    def f(x, w):
        y = torch.mm(x, w)  # (4x8) @ (8x16)
        z = y.view(-1)
        return (z * 2).sum()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 16))
    step = analyze(gm, [{"kind": "input"}, {"kind": "param"}])
    ops = {op.target: op for op in step.ops}
    assert list(ops) == ["mm", "view", "mul", "sum"]
    assert ops["mm"].flops == 2 * 4 * 8 * 16 and ops["mm"].bytes == (32 + 128 + 64) * 4
    assert ops["view"].kind == "view" and ops["view"].bytes == 0
    assert ops["mul"].bytes == (64 + 64) * 4 and ops["sum"].bytes == (64 + 1) * 4
    m = step.memory
    assert (m.batch, m.params) == (128, 512)
    # y (256 B) lives from mm to the mul that reads its view; mul's output (256 B) from mul to sum
    assert m.peak_transient == 512 and m.peak == 128 + 512 + 512


def _step(times, comms):
    return StepGraph(ops=[Op(f"op{i}", "x") for i in range(len(times))], comms=comms, memory=Memory(), graph_nodes=len(times))


def _site(name, issue_at, wait_at, nbytes=100, group="aot.dp", kind="all_reduce"):
    return CommSite(name, kind, group, nbytes, nbytes, "float32", issue_at, wait_at, input_numel=nbytes // 4)


@pytest.mark.parametrize(
    "comm_ms,overlap,step_ms,exposed_ms",
    [
        # A 0-1 | X issued at 1 | B 1-3, C 3-4 | wait X before D | D
        (2.5, True, 5.0, 0.0),  # X ends at 3.5, before D starts at 4: hidden
        (4.0, True, 6.0, 1.0),  # X ends at 5: D waits 1 ms
        (2.5, False, 7.5, 2.5),  # no overlap: X holds compute from 1 to 3.5
    ],
)
def test_overlap_between_issue_and_wait(comm_ms, overlap, step_ms, exposed_ms):
    compute = CpuGlooModel({"default": 1.0}, 1.0, 0.0)
    step = _step([1e-3, 2e-3, 1e-3, 1e-3], [_site("X", 1, 3)])
    p = simulate(step, compute, lambda c: ("ring", comm_ms * 1e-3), overlap=overlap, op_times=[1e-3, 2e-3, 1e-3, 1e-3])
    assert p.step_s == pytest.approx(step_ms * 1e-3) and p.exposed_comm_s == pytest.approx(exposed_ms * 1e-3)
    assert p.compute_s == pytest.approx(5e-3) and p.collectives == 1 and p.algorithms == {("all_reduce", "ring"): 1}


def test_collectives_queue_on_one_stream():
    compute = CpuGlooModel({"default": 1.0}, 1.0, 0.0)
    # X and Y both issued after op 0 (t = 1 ms), 2 ms each: Y runs 3-5; D (op 3) waits for Y
    step = _step([1e-3] * 4, [_site("X", 1, 3), _site("Y", 1, 3)])
    p = simulate(step, compute, lambda c: ("ring", 2e-3), op_times=[1e-3] * 4, trace=True)
    assert p.step_s == pytest.approx(6e-3) and p.exposed_comm_s == pytest.approx(2e-3)
    comm = [e for e in p.events if e[0] == "comm"]
    assert [(e[1], e[3], e[4]) for e in comm] == [("X", pytest.approx(1e-3), 2e-3), ("Y", pytest.approx(3e-3), 2e-3)]


def test_rebucket_packs_in_input_order_until_full_or_needed():
    step = _step([0.0] * 8, [_site("a", 1, 5), _site("b", 2, 5), _site("c", 3, 5), _site("d", 6, 7)])
    b = rebucket(step, 150)
    # a + b reach 200 >= 150; c starts a bucket; d's input comes after c's result is needed: its own
    assert [(c.members, c.bytes, c.issue_at, c.wait_at) for c in b.comms] == [(2, 200, 2, 5), (1, 100, 3, 5), (1, 100, 6, 7)]
    big = rebucket(step, 10**9)
    assert [(c.members, c.bytes) for c in big.comms] == [(3, 300), (1, 100)]
    packed = big.comms[0]
    assert [op.target for op in packed.pre_ops] == ["view"] * 3 + ["cat"] and packed.pre_ops[-1].bytes == 600
    # what packing takes at any size is found once per graph (the search tries many sizes), and
    # a graph made from it with other collectives (hierarchical_split's) finds its own
    again = rebucket(step, 150)
    assert [(c.members, c.bytes, c.issue_at, c.wait_at) for c in again.comms] == [(2, 200, 2, 5), (1, 100, 3, 5), (1, 100, 6, 7)]
    fewer = dataclasses.replace(step, comms=step.comms[2:])
    assert step.packing is not None and fewer.packing is None
    assert [(c.members, c.bytes) for c in rebucket(fewer, 10**9).comms] == [(1, 100), (1, 100)]


def _mlp_capture(dp: int, fsdp: int):
    mf = load_model_file(EXAMPLES / "mlp.py")
    state = build_training_state(mf, 0, 1)
    inputs, targets = split_batch_tensors(mf.example_batch(8), "batch()")
    layout = StepLayout(Group("aot.dp", dp) if dp > 1 else None, Group("aot.fsdp", fsdp) if fsdp > 1 else None)
    return capture_step(mf, state, inputs, targets, layout), state


def test_analytic_bucketing_matches_the_bucketing_pass():
    compute = CpuGlooModel({"default": 1e10}, 5e9, 5e-6)
    captured, _ = _mlp_capture(2, 1)
    unbucketed = analyze(plain_collectives(drop_profiler_calls(captured.graph)), captured.slots)
    cost = lambda c: ("ring", 1e-4 + c.bytes * 1e-9)  # noqa: E731
    for bucket in (1, 10_000, 25 * 2**20):
        built_capture, _ = _mlp_capture(2, 1)
        built = analyze(run_passes(built_capture.graph, PassOptions(bucket_bytes=bucket)), built_capture.slots)
        derived = rebucket(unbucketed, bucket)
        assert sorted(c.bytes for c in derived.comms) == sorted(c.bytes for c in built.comms), bucket
        a = simulate(derived, compute, cost).step_s
        b = simulate(built, compute, cost).step_s
        assert a == pytest.approx(b, rel=0.05), bucket


def test_rebucketed_memory_is_the_sweep_of_its_intervals():
    """rebucket corrects the unbucketed step's sweep by the intervals it moves (memory_with): the
    same memory as sweeping every interval again, at every bucket size, rescaled too."""
    from aot.plan.cost_model import memory_of
    from aot.plan.derived_steps import rescale, shard_scale

    captured, state = _mlp_capture(2, 2)
    step = analyze(plain_collectives(drop_profiler_calls(captured.graph)), captured.slots)
    wider = rescale(step, shard_scale([p.numel() for p in state.params.values()], 2, 6), "aot.fsdp", 6)
    for graph in (step, wider):
        for bucket in (1, 10_000, 25 * 2**20):
            got = rebucket(graph, bucket).memory
            m = graph.memory
            assert got.intervals != m.intervals or bucket == 1
            again = memory_of(m.resident_tensors, got.intervals, m.length, m.scale)
            assert got.itemized() == again.itemized() and got.at_peak == again.at_peak, bucket


def test_wider_fsdp_and_no_dp_are_derived_without_tracing():
    real, state = _mlp_capture(1, 4)
    real_step = analyze(plain_collectives(drop_profiler_calls(real.graph)), real.slots)
    base, _ = _mlp_capture(2, 2)
    base_step = analyze(plain_collectives(drop_profiler_calls(base.graph)), base.slots)
    numels = [p.numel() for p in state.params.values()]
    derived = rescale(drop_group(base_step, "aot.dp"), shard_scale(numels, 2, 4), "aot.fsdp", 4)
    kinds = lambda s: Counter((c.kind, c.group) for c in s.comms)  # noqa: E731
    assert kinds(derived) == kinds(real_step)
    assert sorted(c.bytes for c in derived.comms) == sorted(c.bytes for c in real_step.comms)
    assert sorted(c.input_bytes for c in derived.comms) == sorted(c.input_bytes for c in real_step.comms)
    assert (derived.memory.params, derived.memory.optimizer) == (real_step.memory.params, real_step.memory.optimizer)
    assert len(derived.ops) == len(real_step.ops)
    assert sum(op.bytes for op in derived.ops) == pytest.approx(sum(op.bytes for op in real_step.ops), rel=0.02)


def test_blocking_collectives_pay_the_calibrated_stall():
    """CPU ranks (no overlap): each collective costs its isolated time plus the stall calibration
    measured inside a step; overlapping ranks (GPUs) do not pay it."""
    stalled = CpuGlooModel({"default": 1.0}, 1.0, 0.0, collective_stall_s=0.5e-3)
    step = _step([1e-3] * 4, [_site("X", 1, 3), _site("Y", 2, 3)])
    times = [1e-3] * 4
    blocking = simulate(step, stalled, lambda c: ("ring", 1e-3), overlap=False, op_times=times)
    assert blocking.step_s == pytest.approx(4e-3 + 2 * 1.5e-3) and blocking.comm_s == pytest.approx(3e-3)
    overlapped = simulate(step, stalled, lambda c: ("ring", 1e-3), overlap=True, op_times=times)
    assert overlapped.step_s == pytest.approx(4e-3)


def test_a_bimodal_stall_is_priced_as_the_median_step_pays_it():
    """The calibrated stall is a distribution: here 7 of 10 collectives pay nothing and 3 a 3.5 ms
    scheduler tick. The number of slow ones in a step of k is Binomial(k, 0.3); its median is
    0 for k=1, 1 for k=2 (P(0) = 0.49), 1 for k=3 (P(0) = 0.343, P(<=1) = 0.784), 3 for k=10
    (P(<=2) = 0.383, P(<=3) = 0.650) and 30 for k=100."""
    bimodal = (0.0,) * 7 + (3.5e-3,) * 3
    for k, slow in ((1, 0), (2, 1), (3, 1), (10, 3), (100, 30)):
        assert median_of_sum(((bimodal, k),)) == pytest.approx(slow * 3.5e-3)
    assert median_of_sum(((bimodal, 1000),)) == pytest.approx(1000 * 1.05e-3)  # past the exact range: k x mean
    assert median_of_sum((((-1e-4, 2e-4), 1),)) == pytest.approx(-1e-4)  # below the fast path counts too
    # one certain 1 ms draw and one bimodal draw: 1 ms at the median (P(no tick) = 0.7)
    assert median_of_sum((((1e-3,), 1), (bimodal, 1))) == pytest.approx(1e-3)
    cpu = CpuGlooModel({"default": 1.0}, 1.0, 0.0, collective_stall_s=1.05e-3, collective_stall_by_segment=((1e-3, bimodal),))
    times = [1e-3] * 4
    one = simulate(_step([1e-3] * 4, [_site("X", 1, 3)]), cpu, lambda c: ("ring", 1e-3), overlap=False, op_times=times)
    assert one.step_s == pytest.approx(4e-3 + 1e-3)  # a single collective usually escapes the tick
    three = [_site(name, 1, 3) for name in "XYZ"]
    many = simulate(_step([1e-3] * 4, three), cpu, lambda c: ("ring", 1e-3), overlap=False, op_times=times)
    assert many.step_s == pytest.approx(4e-3 + 3e-3 + 3.5e-3)


def test_the_stall_follows_the_compute_before_each_collective():
    """A collective after a long run of compute stalls more: each draws from the distribution
    calibrated at its compute length, each quantile interpolated between the two calibrated
    lengths around it on a log scale (in eighths); outside them, the nearest's."""
    short, long_ = (0.0,) * 10, (2e-3,) * 10
    cpu = CpuGlooModel({"default": 1.0}, 1.0, 0.0, collective_stall_by_segment=((1e-4, short), (1e-2, long_)))
    assert cpu.blocking_stall([5e-5]) == 0.0 and cpu.blocking_stall([0.05]) == pytest.approx(2e-3)  # outside: the end's
    assert cpu.blocking_stall([1e-3]) == pytest.approx(1e-3)  # halfway on a log scale: halfway between
    assert cpu.stall_distribution(1e-3) == pytest.approx((1e-3,) * 10)
    # 2e-4 s is 0.15 of the way (to the nearest eighth: 1/8), 8e-3 s 0.95 (8/8)
    assert cpu.blocking_stall([5e-5, 2e-4, 8e-3, 0.05]) == pytest.approx(2e-3 / 8 + 2e-3 + 2e-3)
    assert cpu.blocking_stall([]) == 0.0
    # X is issued after 10 ms of compute and pays 2 ms; Y, issued right after it, pays nothing:
    # the step pays 2 ms, spread over both
    step = _step([5e-3] * 4, [_site("X", 2, 3), _site("Y", 2, 3)])
    p = simulate(step, cpu, lambda c: ("ring", 0.0), overlap=False, op_times=[5e-3] * 4)
    assert p.step_s == pytest.approx(20e-3 + 2e-3)
    # each issued after 1 ms of compute: 1 ms each
    step = _step([0.5e-3] * 4, [_site("X", 2, 3), _site("Y", 4, 3)])
    p = simulate(step, cpu, lambda c: ("ring", 0.0), overlap=False, op_times=[0.5e-3] * 4)
    assert p.step_s == pytest.approx(2e-3 + 2e-3)


def test_the_first_collective_counts_the_compute_since_the_step_before_met():
    """Steps run back to back with only their collectives joining the ranks: a step's first
    collective comes after the previous step's tail as well as this step's head. One all_reduce
    issued after 1 of 4 ms of compute is priced at 4 ms of running apart, not 1; with two, the
    first counts the 1 ms after the second (of the step before) and the 1 ms before it."""
    short, long_ = (0.0,) * 10, (2e-3,) * 10
    cpu = CpuGlooModel({"default": 1.0}, 1.0, 0.0, collective_stall_by_segment=((1e-3, short), (4e-3, long_)))
    step = _step([1e-3] * 4, [_site("X", 1, 2)])
    p = simulate(step, cpu, lambda c: ("ring", 0.0), overlap=False, op_times=[1e-3] * 4)
    assert p.step_s == pytest.approx(4e-3 + 2e-3)
    # X after op 0 (and the step before's op 3), Y after ops 1 and 2: 2 ms apart before each,
    # halfway from 1 to 4 ms on a log scale: 1 ms each
    step = _step([1e-3] * 4, [_site("X", 1, 2), _site("Y", 3, 3)])
    p = simulate(step, cpu, lambda c: ("ring", 0.0), overlap=False, op_times=[1e-3] * 4)
    assert p.step_s == pytest.approx(4e-3 + 2e-3)
    step = _step([1e-3] * 4, [])
    assert simulate(step, cpu, lambda c: ("ring", 0.0), overlap=False, op_times=[1e-3] * 4).step_s == pytest.approx(4e-3)


def test_a_stall_between_calibrated_lengths_is_interpolated_quantile_by_quantile():
    """A bimodal distribution (most collectives free, some a tick) stays bimodal in between: the
    i-th smallest stall moves from one length's to the next's, so a median of draws follows."""
    free_then_tick = (0.0,) * 7 + (4e-3,) * 3
    ticks = (0.0,) * 3 + (4e-3,) * 7
    cpu = CpuGlooModel({"default": 1.0}, 1.0, 0.0, collective_stall_by_kind={"all_reduce": ((1e-3, free_then_tick), (16e-3, ticks))})
    middle = cpu.stall_distribution(4e-3, "all_reduce")  # half way from 1 to 16 ms on a log scale
    assert middle == pytest.approx((0.0,) * 3 + (2e-3,) * 4 + (4e-3,) * 3)
    assert cpu.stall_distribution(4e-3, "reduce_scatter") == middle  # a kind without its own table: the default
    assert cpu.blocking_stall([4e-3], ["all_reduce"]) == pytest.approx(2e-3)


def test_each_collective_kind_draws_its_own_stall():
    """gloo's all_gathers issued back to back (FSDP's) stall less than its all_reduces: a profile
    with a table per kind prices each collective from its kind's, others from the default one."""
    zero, tick = (0.0,) * 10, (1e-3,) * 10
    cpu = CpuGlooModel(
        {"default": 1.0},
        1.0,
        0.0,
        collective_stall_by_segment=((1e-6, tick), (1e-2, tick)),
        collective_stall_by_kind={"all_gather": ((1e-6, zero), (1e-2, tick)), "all_reduce": ((1e-6, tick), (1e-2, tick))},
    )
    assert cpu.blocking_stall([0.0, 0.0, 0.0], ["all_gather", "all_gather", "all_reduce"]) == pytest.approx(1e-3)
    assert cpu.blocking_stall([0.0, 0.0], ["all_to_all", "all_to_all"]) == pytest.approx(2e-3)  # no table: the default
    assert cpu.blocking_stall([0.02, 0.0], ["all_gather", "all_gather"]) == pytest.approx(1e-3)  # after 20 ms: its tick
    assert cpu.blocking_stall([0.0, 0.0]) == pytest.approx(2e-3)  # kinds unknown: the default table
    # a step's all_reduce (after the step before's 3 ms), then two all_gathers right behind it:
    # only the all_reduce pays
    step = _step([1e-3] * 3, [_site("R", 0, 3), _site("G1", 0, 1, kind="all_gather"), _site("G2", 0, 1, kind="all_gather")])
    p = simulate(step, cpu, lambda c: ("ring", 0.0), overlap=False, op_times=[1e-3] * 3)
    assert p.step_s == pytest.approx(3e-3 + 1e-3)


def test_the_stall_table_takes_the_median_round_not_a_bursty_one():
    """A round that hit a burst of contention (its stalls 4 ms) does not set the table: each run
    length takes the round whose samples' mean is the median of the rounds'."""
    from aot.plan.calibrate import STALL_QUANTILES, stall_table

    def round_(stall, seconds=1e-5):  # two ranks, two run lengths, 10 samples each
        return [[(seconds, [stall] * 10), (2 * seconds, [stall / 2] * 10)] for _ in range(2)]

    table = stall_table([round_(0.1e-3), round_(4e-3), round_(0.2e-3)])
    assert [s for s, _ in table] == [1e-5, 2e-5]
    assert table[0][1] == [0.2e-3] * STALL_QUANTILES and table[1][1] == [0.1e-3] * STALL_QUANTILES
    assert stall_table([round_(0.1e-3), round_(4e-3)])[0][1] == [0.1e-3] * STALL_QUANTILES  # of two: the lower
