"""`aot topology calibrate`: measure alpha and beta of each collective kind, and compute rates, on
the live ranks (under torchrun), and write them into a copy of a profile.

Collectives: for all_reduce, all_gather and reduce_scatter over all ranks, through the same
functional collectives the compiled step issues, at sizes from `min_bytes` to `max_bytes` (powers
of two); each size is repeated (at least `reps` times and for at least `min_seconds`) and each
repetition timed as the slowest rank saw it (ranks start together after a barrier); the median
repetition counts on GPUs, the lower quartile on CPU ranks (the fast path of a bimodal time; the
slow path is the in-step stall, measured as a distribution: measure_collective_stall). A straight
line t = a + b n is fitted per kind, weighting each point by 1/t (relative error, so small and
large messages count alike), and read through the ring formula of that kind at p ranks
(aot.plan.collectives): all_reduce t = 2(p-1) alpha + 2((p-1)/p) n beta (the reduction's gamma
folded into beta), all_gather and reduce_scatter t = (p-1) alpha + ((p-1)/p) n beta. The profile's
`calibration` gets the link class the ranks span (`loopback` for cpu ranks, `nvlink`/`pcie` inside
a node, `network` across nodes) with the all_reduce alpha and beta and a `per_kind` table.

Point-to-point (`send_recv` in that table, what a pipeline's stage transfers cost): ranks 0 and 1
pass a tensor back and forth with the functional isend / irecv a pipeline program issues (the
runner's send kernel installed, as the runner does), the other ranks idle, timed as the
collectives are; one transfer is half the round trip, and the line t = alpha + beta n is the
transfer itself (no ring formula). Between two ranks of one node that is the pair's link. Like
the collectives' it is the fast path on CPU ranks: what a blocking wait adds inside a step is the
stall, which the pipeline timeline charges apart (aot/plan/pipeline_timeline.py).

Compute, on every rank at once (as in training): matrix multiply FLOP/s (float32; bfloat16 too on
GPUs), memory bandwidth on a copy much larger than the caches and, on CPUs, on copies of 64 KiB to
16 MiB (what fits in the caches moves faster); on CPUs also the time per element of
arithmetic-bound elementwise kernels (GELU, softmax, masked_fill, ...), the dispatch of a view and
what each tensor of a foreach op adds, each timed on its own; and the cost of one op: a small
reference training step (a one-block transformer with Adam, traced and exported like a build, run
as the runner runs programs) is timed at two sizes, one where dispatch dominates and one where work
does: time = ops x per-op cost + what the separately timed pieces give + roofline work / efficiency
gives both. Every timing is the median of its repetitions, as a training run's step time is: on a
shared machine the profile describes the machine as the ranks find it, so calibrate right before
the runs it should predict. Compute (and the stall) is measured in rounds, 5 on CPU ranks, after
the collectives: the median over ranks, then over rounds, goes into the profile's `compute` entry.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from aot.plan.collectives import SEND_RECV
from aot.plan.cpu_op_costs import measure_dispatch_seconds, measure_element_seconds, measure_foreach_tensor_seconds, measure_view_seconds
from aot.plan.timing import per_call, sync, timed
from runner.execution.groups import leave_process_group, yield_gloo_poll_threads

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
STALL_QUANTILES = 40  # values kept of the in-step stall's distribution
DEFAULT_CPU_ROUNDS = 5  # rounds of compute and stall measurements on CPU ranks (about 5 s each)


# -- collectives -----------------------------------------------------------------------------------


def _collective(kind: str, t: torch.Tensor, group_name: str, world: int):
    funcol = torch.ops._c10d_functional
    if kind == SEND_RECV:  # there and back between ranks 0 and 1 (the others take no part)
        rank = dist.get_rank()
        if rank == 0:
            funcol.wait_tensor(funcol.isend(t, 1, 0, group_name))
            return funcol.wait_tensor(funcol.irecv(t, 1, 1, group_name))
        if rank == 1:
            funcol.wait_tensor(funcol.irecv(t, 0, 0, group_name))
            return funcol.wait_tensor(funcol.isend(t, 0, 1, group_name))
        return t
    if kind == "all_reduce":
        return funcol.wait_tensor(funcol.all_reduce(t, "sum", group_name))
    if kind == "all_gather":
        return funcol.wait_tensor(funcol.all_gather_into_tensor(t, world, group_name))
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(t, "sum", world, group_name))


def measure_collectives(
    device, sizes: list[int], reps: int, warmup: int = 2, min_seconds: float = 0.0, max_reps: int = 400, kinds: tuple[str, ...] = KINDS
) -> dict[str, list[tuple[int, float]]]:
    """kind -> [(n bytes, seconds as the slowest rank saw it)]; n as in the cost model. SEND_RECV
    (ranks 0 and 1 send the tensor there and back with the functional isend / irecv a pipeline
    program issues, the runner's send kernel installed): one transfer, half the round trip.

    Seconds are the median repetition on GPUs and the lower quartile on CPU ranks: there a small
    gloo collective's time is bimodal (on this 2-core machine about 60% near 0.5 ms, 30% a
    scheduler tick of ~4 ms later), a median of a few repetitions lands in either mode and the
    alpha-beta line fitted through it jumps between runs. The quartile is the fast path; what the
    slow mode adds inside a step is measured on its own (measure_collective_stall). Each size is
    repeated at least `reps` times and until `min_seconds` of samples are in, at most `max_reps`
    times; every rank sees the same samples (each is the max over ranks), so all stop together."""
    world = dist.get_world_size()
    group_name = _world_group_name()
    if SEND_RECV in kinds:
        from runner.execution.p2p import install_kernels

        install_kernels()  # the runner's: each send's placeholder is waited once
    results: dict[str, list[tuple[int, float]]] = {k: [] for k in kinds}
    clock = torch.zeros(1, dtype=torch.float64)
    for kind in kinds:
        for n in sizes:
            t, nbytes = _collective_input(kind, n, world, device)
            for _ in range(warmup):
                _collective(kind, t, group_name, world)
            samples: list[float] = []
            while len(samples) < reps or (sum(samples) < min_seconds and len(samples) < max_reps):
                dist.barrier()
                sync(device)
                start = time.perf_counter()
                _collective(kind, t, group_name, world)
                sync(device)
                clock[0] = time.perf_counter() - start
                dist.all_reduce(clock, op=dist.ReduceOp.MAX)
                samples.append(float(clock[0]))
            seconds = _quantile(samples, 0.5 if device.type == "cuda" else 0.25)
            results[kind].append((nbytes, seconds / 2 if kind == SEND_RECV else seconds))
    return results


def _world_group_name() -> str:
    world = dist.group.WORLD
    assert world is not None  # callers run after init_process_group
    return world.group_name


def _collective_input(kind: str, nbytes: int, world: int, device) -> tuple[torch.Tensor, int]:
    """One rank's float32 input for a collective of about `nbytes` as the cost model counts n (the
    whole tensor gathered, reduced or scattered), and that n exactly: all_gather takes one rank's
    share and returns n; the others take n."""
    elems = max(world, nbytes // 4 // world * world)
    return torch.ones(elems // world if kind == "all_gather" else elems, dtype=torch.float32, device=device), elems * 4


def _quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def quantiles(samples: list[float], count: int) -> list[float]:
    """`count` equally likely values standing for the samples' distribution (bin midpoints)."""
    ordered = sorted(samples)
    return [ordered[min(len(ordered) - 1, int((i + 0.5) * len(ordered) / count))] for i in range(count)]


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of t = a + b n minimizing the sum of ((t - a - b n) / t)^2; both clipped at 0."""
    if len(points) == 1:
        n, t = points[0]
        return 0.0, t / n if n else 0.0
    # weighted least squares with weights 1/t^2
    sw = sx = sy = sxx = sxy = 0.0
    for n, t in points:
        w = 1.0 / (t * t) if t > 0 else 0.0
        sw += w
        sx += w * n
        sy += w * t
        sxx += w * n * n
        sxy += w * n * t
    det = sw * sxx - sx * sx
    if det <= 0:
        return 0.0, 0.0
    a = (sy * sxx - sx * sxy) / det
    b = (sw * sxy - sx * sy) / det
    if a < 0:  # no latency measurable: a line through the origin
        a, b = 0.0, sum(w_t for w_t in (t / n for n, t in points if n)) / len(points)
    if b < 0:
        a, b = statistics.median(t for _, t in points), 0.0
    return a, b


def alpha_beta(kind: str, p: int, a: float, b: float) -> tuple[float, float]:
    """A fitted line read through the ring formula of `kind` at p ranks."""
    if p <= 1:
        return a, b
    if kind == "all_reduce":
        return a / (2 * (p - 1)), b / (2 * (p - 1) / p)
    return a / (p - 1), b / ((p - 1) / p)


# -- compute ------------------------------------------------------------------------------------


def _reference_step(device, width: int, rows: int):
    """A training step of a one-block transformer (layer norm, attention with a causal mask and
    softmax, GELU MLP, output head, cross-entropy) with Adam, `rows` sequences of `width` tokens
    and width `width`, traced as the build traces steps and run with real tensors: the mix of ops
    (matmuls, elementwise, reductions, views, optimizer updates) training programs are made of."""
    import math

    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    d, t, heads = width, width, 2
    shapes = {
        "ln1.w": (d,),
        "ln1.b": (d,),
        "qkv.w": (3 * d, d),
        "qkv.b": (3 * d,),
        "proj.w": (d, d),
        "proj.b": (d,),
        "ln2.w": (d,),
        "ln2.b": (d,),
        "fc.w": (4 * d, d),
        "fc.b": (4 * d,),
        "out.w": (d, 4 * d),
        "out.b": (d,),
        "head.w": (d, d),
    }
    params = [(torch.randn(*s, device=device) * 0.02).requires_grad_(True) for s in shapes.values()]
    exp_avg = [torch.zeros_like(p) for p in params]
    exp_avg_sq = [torch.zeros_like(p) for p in params]
    steps = [torch.zeros(()) for _ in params]  # step counters stay on the CPU, as the runner keeps them
    x = torch.randn(rows, t, d, device=device)
    y = torch.randint(0, d, (rows, t), device=device)
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=device))
    F = torch.nn.functional

    def step(*flat):
        k = len(params)
        ps, m, v, st = list(flat[:k]), flat[k : 2 * k], flat[2 * k : 3 * k], flat[3 * k : 4 * k]
        h, target, causal = flat[4 * k], flat[4 * k + 1], flat[4 * k + 2]
        w = dict(zip(shapes, ps))
        a = F.layer_norm(h, (d,), w["ln1.w"], w["ln1.b"])
        q, kk, vv = F.linear(a, w["qkv.w"], w["qkv.b"]).split(d, dim=2)
        q, kk, vv = (z.view(rows, t, heads, d // heads).transpose(1, 2) for z in (q, kk, vv))
        att = (q @ kk.transpose(-2, -1)) * (1.0 / math.sqrt(d // heads))
        att = F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
        h = h + F.linear((att @ vv).transpose(1, 2).reshape(rows, t, d), w["proj.w"], w["proj.b"])
        h = h + F.linear(F.gelu(F.linear(F.layer_norm(h, (d,), w["ln2.w"], w["ln2.b"]), w["fc.w"], w["fc.b"])), w["out.w"], w["out.b"])
        logits = F.linear(h, w["head.w"])
        loss = F.cross_entropy(logits.reshape(-1, d), target.reshape(-1))
        grads = torch.autograd.grad(loss, ps)
        # foreach, as aot.capture steps optimizers that leave foreach unset
        opt = torch.optim.Adam(ps, lr=1e-3, foreach=True, capturable=True)
        for p, g, ea, eb, s_ in zip(ps, grads, m, v, st):
            p.grad = g
            opt.state[p] = {"step": s_, "exp_avg": ea, "exp_avg_sq": eb}
        opt.step()
        return loss.detach()

    args = [*params, *exp_avg, *exp_avg_sq, *steps, x, y, mask]
    from aot.capture.step import traced_as_compiled

    with traced_as_compiled():  # tensor step counters, as aot.capture traces them
        gm = make_fx(step, tracing_mode="fake")(*[a.detach().clone().requires_grad_(a.requires_grad) for a in args])
    args = [a.detach().clone() for a in args]
    # run it as the runner runs programs: exported, stored and loaded as FX code (the unlifted
    # module torch.export gives checks its inputs on every call: 0.8 of this step's 3.9 ms here)
    from runner.execution.graph_loader import load_graph_module
    from runner.format.program import encode_program

    exported = torch.export.export(gm, tuple(a.clone() for a in args), strict=False)
    module = load_graph_module(encode_program(exported)[0]) or exported.module()
    return gm, module, args


def measure_compute(device, reps: int = 7) -> dict:
    """This rank's matmul FLOP/s, memory bandwidth (by bytes touched, on CPUs) and per-op cost."""
    from aot.plan.step_reading import analyze
    from aot.plan.cpu_gloo_model import CpuGlooModel
    from aot.plan.gpu_model import GpuModel

    result: dict = {"flops_per_s": {}}
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    size = 2048 if device.type == "cuda" else 256
    for dtype in dtypes:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        t = per_call(lambda: a @ b, device, reps, inner=20 if device.type == "cuda" else 4)
        result["flops_per_s"][str(dtype).replace("torch.", "")] = 2 * size**3 / t

    def bandwidth(nbytes: int) -> float:
        """bytes/s of a copy that reads nbytes/2 and writes nbytes/2."""
        x = torch.empty(max(1, nbytes // 8), device=device)
        y = torch.empty_like(x)
        inner = max(1, min(200, (64 * 2**20) // max(nbytes, 1)))
        return 2 * x.numel() * 4 / per_call(lambda: y.copy_(x), device, reps, inner)

    big = 512 * 2**20 if device.type == "cuda" else 128 * 2**20
    result["memory_bytes_per_s"] = bandwidth(big)
    if device.type == "cpu":
        result["bandwidth_by_bytes"] = [[n, bandwidth(n)] for n in (2**16, 2**18, 2**20, 2**22, 2**24)]

    if device.type == "cpu":
        result["element_seconds"] = measure_element_seconds(device)
        result["view_overhead_s"] = measure_view_seconds(device)
        result["foreach_tensor_s"] = measure_foreach_tensor_seconds(device)

    # Per-op cost and efficiency: one reference step small enough that dispatch dominates and one
    # large enough that work does, the same ops in both:
    #   T = ops * overhead + views * view cost + each op's measured call cost (CPU: dispatch_s)
    #       + measured-rate work + roofline work / efficiency.
    # On CPUs `overhead` is then what an op costs in a whole step beyond its call timed alone.
    references = [_reference_step(device, width, rows) for width, rows in ((4, 1), (128, 8) if device.type == "cpu" else (512, 16))]
    if device.type == "cpu":
        gm, _, args = references[0]
        result["dispatch_s"] = measure_dispatch_seconds(device, gm, args)
    flops = dict(result["flops_per_s"], default=result["flops_per_s"]["float32"])
    partial: GpuModel | CpuGlooModel
    if device.type == "cuda":  # the device model `aot plan` will read this entry with
        partial = GpuModel(flops, result["memory_bytes_per_s"], 0.0, elementwise_flops_per_s=flops["default"])
    else:
        partial = CpuGlooModel(
            flops,
            result["memory_bytes_per_s"],
            0.0,
            bandwidth_by_bytes=tuple(tuple(x) for x in result.get("bandwidth_by_bytes", ())),
            foreach_tensor_s=result.get("foreach_tensor_s", 0.0),
            dispatch_s={k: tuple(v) for k, v in result.get("dispatch_s", {}).items()},
        )
    rates = result.get("element_seconds") or {}
    view_s = result.get("view_overhead_s")
    points: list[tuple[float, float, float, int]] = []
    for gm, module, args in references:
        step = analyze(gm)
        computes = [op for op in step.ops if op.kind == "compute"]
        work = sum(partial.op_seconds(op.flops, op.bytes, op.dtype, overhead=False) for op in computes if op.target not in rates)
        fixed = sum(rates[op.target] * op.elements for op in computes if op.target in rates)
        views = sum(1 for op in step.ops if op.kind == "view")
        if device.type == "cpu":
            assert isinstance(partial, CpuGlooModel)  # every device but cuda gets one
            fixed += sum(partial.dispatch_seconds(op.target, op.launches) for op in computes)
        if view_s is not None:
            fixed += views * view_s
            kernels = len(computes)
        else:  # views cost what an op does
            kernels = len(computes) + views
        module(*[a.clone() for a in args])
        times = []
        for _ in range(reps * (16 if len(points) == 0 else 4)):  # the small step: 3 ms, and its noise is the per-op cost's
            fresh = [a.clone() for a in args]
            times.append(timed(lambda: module(*fresh), device, 1)[0])
        points.append((statistics.median(times), fixed, work, kernels))
    result["reference_steps"] = [{"seconds": t, "measured_s": f, "roofline_work_s": w, "ops": n} for t, f, w, n in points]
    (t1, w1, n1), (t2, w2, n2) = ((t - f, w, n) for t, f, w, n in points)
    # t = n * overhead + w * slowdown at both sizes (slowdown = 1 / efficiency)
    det = n1 * w2 - n2 * w1
    slowdown = (n1 * t2 - n2 * t1) / det if det > 0 else 1.0
    slowdown = max(slowdown, 1.0)
    result["efficiency"] = 1.0 / slowdown
    result["op_overhead_s"] = max(t1 - w1 * slowdown, 0.0) / n1
    result.setdefault("view_overhead_s", result["op_overhead_s"])
    return result


# small ops between two collectives: none (issued back to back, as FSDP's all_gathers are), then
# 0.02 to 20 ms on 2 ranks here: a data-parallel step's one all_reduce comes after its whole
# backward (examples/gpt.py: 11 ms at 2 ranks, 25 at 4), and the stall keeps growing past 4 ms of
# compute (2 ranks here, side by side: a mean of 0.8-1.9 ms after 5-7 ms, 3.8-6.1 after 17-19 ms)
STALL_SEGMENTS = (0, 10, 40, 160, 640, 2560, 10240)
STALL_BYTES = 4096  # the collectives' size (n as the cost model counts it); what a step pays beyond n beta


def measure_collective_stall(
    device, isolated_s: dict[str, float], reps: int = 100, budget_s: float = 0.5, min_reps: int = 30
) -> dict[str, list[tuple[float, list[float]]]]:
    """kind -> [(seconds of compute before the collective, [stall samples])] for runs of 0 to 10,240
    ops: what a blocking collective of STALL_BYTES costs inside a step beyond `isolated_s[kind]` (its fast
    time when the ranks start it together after a barrier, read off the kind's fitted line). Every
    rank runs a run of small ops (as CPU training steps are made of: dispatch-bound, a few
    microseconds each), then the collective, `reps` times with no barrier in between; each
    iteration, less the median time of the run in those iterations (on that rank), less the
    collective's isolated time, is a sample: what the step pays beyond its typical compute and the
    collective's fast time, the other ranks' lateness included. The ranks drift out of step and
    gloo's threads wait for a core, often a whole scheduler tick; where ranks share cores (4 on 2
    here) a longer run is more often preempted midway, so the stall grows with it. The planner sums
    draws from the samples of the kind at each collective's run length, interpolated between the
    measured ones (aot.plan.cpu_gloo_model.CpuGlooModel.blocking_stall). Each kind and run length
    is repeated `reps` times, or as often as fits in about `budget_s` (at least `min_reps`): a run
    of 10,240 ops takes 17-20 ms at 2 ranks here, about 40 at 4.

    Each kind is measured on its own: measured side by side in one run on this 2-core machine
    (2 ranks, five rounds), all_gathers issued back to back ran 0.11-0.17 ms under their fitted
    line in the median (mean +0.03..+0.21 ms) while all_reduces back to back ran +0.04..+0.25 ms
    over theirs (mean +0.29..+0.69 ms); priced with the all_reduce's stall, FSDP's all_gathers made
    examples/mlp.py's fsdp=2 step 22-81% too slow. Collectives issued back to back (no ops
    between) find the ranks in step from the previous one, so that run length is measured too.
    Measured on this machine, 2 ranks: a mean of 1.0-1.6 ms after 0.04-0.7 ms of compute with
    gloo's poll threads as gloo starts them, 0.3-0.5 ms with them yielded (as the runner and
    `calibrate` now do: runner.execution.groups.yield_gloo_poll_threads)."""
    torch.manual_seed(0)
    pool = [torch.randn(256, device=device) for _ in range(4)]
    group_name, world = _world_group_name(), dist.get_world_size()
    buffers = {kind: _collective_input(kind, STALL_BYTES, world, device)[0] for kind in isolated_s}

    def segment(n: int):
        y = pool[0]
        for i in range(n):
            y = torch.add(y, pool[i % len(pool)])
        return y

    def then_collective(n: int, kind: str) -> tuple[float, float]:
        """(seconds of the run of ops, seconds of the run and the collective)"""
        start = time.perf_counter()
        segment(n)
        ran = time.perf_counter()
        _collective(kind, buffers[kind], group_name, world)
        return ran - start, time.perf_counter() - start

    out: dict[str, list] = {kind: [] for kind in isolated_s}
    for n in STALL_SEGMENTS:
        dist.barrier()
        alone = statistics.fmean(timed(lambda: segment(n), device, 5))
        # every rank must repeat as often (or they deadlock): count from the slowest rank's run
        slowest = torch.tensor([alone + isolated_s["all_reduce"]], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        count = max(min_reps, min(reps, int(budget_s / max(float(slowest[0]), 1e-6))))
        for kind, isolated in isolated_s.items():
            dist.barrier()
            for _ in range(3):
                then_collective(n, kind)
            iterations = [then_collective(n, kind) for _ in range(count)]
            # the run's typical time in these same iterations: a run timed apart, seconds earlier,
            # differed from them by the machine's drift (+-15% of 18 ms here), more than the stall
            typical = statistics.median(ran for ran, _ in iterations)
            out[kind].append((typical, [total - typical - isolated for _, total in iterations]))
    return out


def stall_table(rounds: list[list[list[tuple[float, list[float]]]]]) -> list:
    """[[compute seconds, [STALL_QUANTILES stalls]], ...] per run length, from one kind's
    measurements: rounds -> ranks -> run lengths -> (compute seconds, samples). Each run length
    takes the round whose samples (every rank's) have the median mean, not all rounds pooled: the
    stall is heavy-tailed and its tail comes and goes with the machine's minute (on this VM one
    round in five could stall 2-4x the others' mean, and pooled it priced examples/mlp.py's
    fsdp=2 step 90% over), where the runs a profile predicts see the typical minute, as every
    other figure of the calibration is the median over rounds."""
    table = []
    for i in range(len(rounds[0][0])):
        per_round = []
        for every in rounds:  # every rank's runs in one round
            samples = [t for runs in every for t in runs[i][1]]
            per_round.append((statistics.fmean(samples), statistics.median(runs[i][0] for runs in every), samples))
        _, seconds, samples = sorted(per_round, key=lambda r: r[0])[(len(per_round) - 1) // 2]
        table.append([seconds, quantiles(samples, STALL_QUANTILES)])
    return table


def _gather(mine, world: int) -> list:
    """Every rank's `mine`, in rank order."""
    if world == 1:
        return [mine]
    every = [None] * world
    dist.all_gather_object(every, mine)
    return every


def _median_of(results: list[dict]) -> dict:
    """Each number the median over `results` (the ranks' measurements, or the rounds'); bandwidth_by_bytes
    per size; the reference steps the first's (rank 0's, the first round's)."""
    first = results[0]
    out: dict[str, Any] = {"flops_per_s": {k: statistics.median(r["flops_per_s"][k] for r in results) for k in first["flops_per_s"]}}
    for key, value in first.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in results)
    if "bandwidth_by_bytes" in first:
        out["bandwidth_by_bytes"] = [
            [n, statistics.median(r["bandwidth_by_bytes"][i][1] for r in results)] for i, (n, _) in enumerate(first["bandwidth_by_bytes"])
        ]
    if "element_seconds" in first:
        out["element_seconds"] = {k: statistics.median(r["element_seconds"][k] for r in results) for k in first["element_seconds"]}
    if "dispatch_s" in first:
        out["dispatch_s"] = {k: [statistics.median(r["dispatch_s"][k][i] for r in results) for i in (0, 1)] for k in first["dispatch_s"]}
    out["reference_steps"] = first.get("reference_steps")
    return out


# -- the run --------------------------------------------------------------------------------------


def calibrate(base: dict, *, min_bytes: int, max_bytes: int, reps: int, min_seconds: float = 0.0, rounds: int | None = None, log=print) -> dict | None:
    """Run on every rank under torchrun; returns the calibrated profile on rank 0 (None elsewhere).

    Compute (and on CPU ranks the in-step stall) is measured in `rounds` rounds, one after another
    (default: DEFAULT_CPU_ROUNDS on CPU ranks, 1 on GPUs); each figure is the median over rounds and
    the stall's distribution is the median round's (stall_table). One round times a few seconds of a shared
    machine; on this project's VM the host's speed changes from one ten seconds to the next with no
    load /proc/stat shows, and one round's prediction of a step varied by -20%..+12% between
    calibrations taken a minute apart (BENCHMARKS.md)."""
    from aot.plan.machine import Machine, NETWORK

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = base["device_kind"] == "cuda" and torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    started = False
    if world > 1 and not dist.is_initialized():
        # on GPUs the timings' bookkeeping (each sample's max over ranks, when to stop, the
        # gathered results) is CPU tensors and objects: gloo carries those, NCCL the measured ones
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=world)
        started = True
    if world > 1 and not cuda:  # as the runner does: the stall measured is the one its steps pay
        yield_gloo_poll_threads()
    rounds = rounds or (1 if cuda else DEFAULT_CPU_ROUNDS)
    try:
        sizes = []
        n = min_bytes
        while n <= max_bytes:
            sizes.append(n)
            n *= 2
        compute_rounds, stall_rounds = [], []  # per round: the median over ranks; every rank's stall samples
        per_kind, measurements, isolated_s = {}, {}, {}
        if world > 1:
            log(f"measuring {', '.join(KINDS)} and {SEND_RECV} (ranks 0 and 1) at {len(sizes)} sizes from {min_bytes} to {max_bytes} bytes")
            points = measure_collectives(device, sizes, reps, min_seconds=min_seconds, kinds=(*KINDS, SEND_RECV))
            for kind, pts in points.items():
                a, b = fit_line(pts)
                alpha, beta = alpha_beta(kind, world, a, b) if kind in KINDS else (a, b)  # send_recv: the line is one transfer
                per_kind[kind] = {"alpha_s": alpha, "beta_s_per_byte": beta, "gamma_s_per_byte": 0.0}
                measurements[kind] = [[n, t] for n, t in pts]
                if kind in KINDS:
                    isolated_s[kind] = a + b * STALL_BYTES
        stall = world > 1 and device.type == "cpu"  # GPU collectives overlap compute on their own stream
        for r in range(rounds):
            log(
                f"measuring compute{' and what a blocking collective costs inside a step' if stall else ''} "
                f"on {world} rank(s) ({device.type})" + (f", round {r + 1} of {rounds}" if rounds > 1 else "")
            )
            compute_rounds.append(_median_of(_gather(measure_compute(device), world)))
            if stall:
                stall_rounds.append(_gather(measure_collective_stall(device, isolated_s), world))
        compute = _median_of(compute_rounds)
        if stall_rounds:
            by_kind = {kind: stall_table([[rank_runs[kind] for rank_runs in every] for every in stall_rounds]) for kind in KINDS}
            compute["collective_stall_by_kind"] = by_kind
            # the all_reduce's, as profiles before the per-kind table have it (and other kinds fall back to)
            compute["collective_stall_by_segment"] = by_kind["all_reduce"]
            compute["collective_stall_s"] = max(0.0, statistics.fmean(t for _, stall in by_kind["all_reduce"] for t in stall))
        if rounds > 1:
            compute["rounds"] = rounds
    finally:
        if started:
            leave_process_group()
    if rank != 0:
        return None
    profile = dict(base)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE") or 0) or max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE") or world))
    machine = Machine({**base, "nodes": nodes}, world)
    if per_kind:
        if nodes > 1:
            cls = NETWORK
        else:
            cls = machine.pair(0, 1)[0] if world > 1 else "loopback"
        calibration = dict(base.get("calibration") or {})
        calibration[cls] = {
            "alpha_s": per_kind["all_reduce"]["alpha_s"],
            "beta_s_per_byte": per_kind["all_reduce"]["beta_s_per_byte"],
            "gamma_s_per_byte": 0.0,
            "per_kind": per_kind,
            "ranks": world,
            "measured": measurements,
        }
        profile["calibration"] = calibration
    profile["compute"] = {**compute, "ranks": world, "device": device.type}
    profile["calibrated"] = {
        "by": "aot topology calibrate",
        "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ranks": world,
        "nodes": nodes,
        "sizes_bytes": [min_bytes, max_bytes],
        "repetitions": reps,
    }
    return profile
