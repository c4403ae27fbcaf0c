"""`aot topology calibrate`: measure alpha and beta of each collective kind, and compute rates, on
the live ranks (under torchrun), and write them into a copy of a profile.

Collectives: for all_reduce, all_gather and reduce_scatter over all ranks, through the same
functional collectives the compiled step issues, at sizes from `min_bytes` to `max_bytes` (powers
of two); each size is repeated and each repetition timed as the slowest rank saw it (ranks start
together after a barrier); the median repetition counts. A straight line t = a + b n is fitted
per kind, weighting each point by 1/t (relative error, so small and large messages count alike),
and read through the ring formula of that kind at p ranks (aot.plan.collectives): all_reduce
t = 2(p-1) alpha + 2((p-1)/p) n beta (the reduction's gamma folded into beta), all_gather and
reduce_scatter t = (p-1) alpha + ((p-1)/p) n beta. The profile's `calibration` gets the link class
the ranks span (`loopback` for cpu ranks, `nvlink`/`pcie` inside a node, `network` across nodes)
with the all_reduce alpha and beta and a `per_kind` table.

Compute, on every rank at once (as in training): matrix multiply FLOP/s (float32; bfloat16 too on
GPUs), memory bandwidth on a copy much larger than the caches and, on CPUs, on copies of 64 KiB to
16 MiB (what fits in the caches moves faster), and the cost of one op: a small reference training
step (a one-block transformer with Adam, traced and exported like a build, run as the runner
runs programs) is timed at two sizes,
one where dispatch dominates and one where work does: time = ops x per-op cost + roofline work /
efficiency gives both. Every timing is the
median of its repetitions, as a training run's step time is: on a shared machine the profile
describes the machine as the ranks find it, so calibrate right before the runs it should predict.
The median over ranks goes into the profile's `compute` entry.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

from runner.groups import leave_process_group

KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - start)
    return out


# -- collectives -----------------------------------------------------------------------------------

def _collective(kind: str, t: torch.Tensor, group_name: str, world: int):
    funcol = torch.ops._c10d_functional
    if kind == "all_reduce":
        return funcol.wait_tensor(funcol.all_reduce(t, "sum", group_name))
    if kind == "all_gather":
        return funcol.wait_tensor(funcol.all_gather_into_tensor(t, world, group_name))
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(t, "sum", world, group_name))


def measure_collectives(device, sizes: list[int], reps: int, warmup: int = 2) -> dict[str, list[tuple[int, float]]]:
    """kind -> [(n bytes, median seconds as the slowest rank saw it)]; n as in the cost model."""
    world = dist.get_world_size()
    group_name = dist.group.WORLD.group_name
    results: dict[str, list[tuple[int, float]]] = {k: [] for k in KINDS}
    clock = torch.zeros(1, dtype=torch.float64)
    for kind in KINDS:
        for n in sizes:
            elems = max(world, n // 4 // world * world)
            # all_gather takes one rank's share and returns n; the others take n
            t = torch.ones(elems // world if kind == "all_gather" else elems, dtype=torch.float32, device=device)
            nbytes = elems * 4
            for _ in range(warmup):
                _collective(kind, t, group_name, world)
            samples = []
            for _ in range(reps):
                dist.barrier()
                _sync(device)
                start = time.perf_counter()
                _collective(kind, t, group_name, world)
                _sync(device)
                clock[0] = time.perf_counter() - start
                dist.all_reduce(clock, op=dist.ReduceOp.MAX)
                samples.append(float(clock[0]))
            results[kind].append((nbytes, statistics.median(samples)))
    return results


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
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
    shapes = {"ln1.w": (d,), "ln1.b": (d,), "qkv.w": (3 * d, d), "qkv.b": (3 * d,), "proj.w": (d, d), "proj.b": (d,),
              "ln2.w": (d,), "ln2.b": (d,), "fc.w": (4 * d, d), "fc.b": (4 * d,), "out.w": (d, 4 * d), "out.b": (d,),
              "head.w": (d, d)}
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
        ps, m, v, st = list(flat[:k]), flat[k:2 * k], flat[2 * k:3 * k], flat[3 * k:4 * k]
        h, target, causal = flat[4 * k], flat[4 * k + 1], flat[4 * k + 2]
        w = dict(zip(shapes, ps))
        a = F.layer_norm(h, (d,), w["ln1.w"], w["ln1.b"])
        q, kk, vv = F.linear(a, w["qkv.w"], w["qkv.b"]).split(d, dim=2)
        q, kk, vv = (z.view(rows, t, heads, d // heads).transpose(1, 2) for z in (q, kk, vv))
        att = (q @ kk.transpose(-2, -1)) * (1.0 / math.sqrt(d // heads))
        att = F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
        h = h + F.linear((att @ vv).transpose(1, 2).reshape(rows, t, d), w["proj.w"], w["proj.b"])
        h = h + F.linear(F.gelu(F.linear(F.layer_norm(h, (d,), w["ln2.w"], w["ln2.b"]), w["fc.w"], w["fc.b"])),
                         w["out.w"], w["out.b"])
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
    previous = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True  # tensor step counters, as aot.capture traces them
    try:
        gm = make_fx(step, tracing_mode="fake")(*[a.detach().clone().requires_grad_(a.requires_grad) for a in args])
    finally:
        torch.compiler._is_compiling_flag = previous
    args = [a.detach().clone() for a in args]
    # run it as the runner runs programs: exported, then unlifted to a module
    module = torch.export.export(gm, tuple(a.clone() for a in args), strict=False).module()
    return gm, module, args


def measure_compute(device, reps: int = 7) -> dict:
    """This rank's matmul FLOP/s, memory bandwidth (by bytes touched, on CPUs) and per-op cost."""
    from aot.plan.cost_model import analyze
    from aot.plan.machine import Compute

    result: dict = {"flops_per_s": {}}
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    size = 2048 if device.type == "cuda" else 256
    for dtype in dtypes:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        inner = 20 if device.type == "cuda" else 4
        for _ in range(2):
            a @ b
        def mm():
            for _ in range(inner):
                a @ b
        t = statistics.median(_timed(mm, device, reps)) / inner
        result["flops_per_s"][str(dtype).replace("torch.", "")] = 2 * size**3 / t

    def bandwidth(nbytes: int) -> float:
        """bytes/s of a copy that reads nbytes/2 and writes nbytes/2."""
        x = torch.empty(max(1, nbytes // 8), device=device)
        y = torch.empty_like(x)
        y.copy_(x)
        inner = max(1, min(200, (64 * 2**20) // max(nbytes, 1)))
        def copy():
            for _ in range(inner):
                y.copy_(x)
        return 2 * x.numel() * 4 * inner / statistics.median(_timed(copy, device, reps))

    big = 512 * 2**20 if device.type == "cuda" else 128 * 2**20
    result["memory_bytes_per_s"] = bandwidth(big)
    if device.type == "cpu":
        result["bandwidth_by_bytes"] = [[n, bandwidth(n)] for n in (2**16, 2**18, 2**20, 2**22, 2**24)]

    # Per-op cost and efficiency: one reference step small enough that dispatch dominates and one
    # large enough that work does, the same ops in both: T = n_ops * overhead + work / efficiency.
    partial = Compute(dict(result["flops_per_s"], default=result["flops_per_s"]["float32"]), result["memory_bytes_per_s"],
                      0.0, device.type == "cuda", bandwidth_by_bytes=tuple(tuple(x) for x in result.get("bandwidth_by_bytes", ())))
    points = []
    for width, rows in ((4, 1), (128, 8) if device.type == "cpu" else (512, 16)):
        gm, module, args = _reference_step(device, width, rows)
        step = analyze(gm)
        work = sum(partial.op_seconds(op.flops, op.bytes, op.dtype, overhead=False) for op in step.ops if op.kind == "compute")
        counted = sum(1 for op in step.ops if op.kind != "free")
        module(*[a.clone() for a in args])
        times = []
        for _ in range(reps * 4):
            fresh = [a.clone() for a in args]
            times.append(_timed(lambda: module(*fresh), device, 1)[0])
        points.append((statistics.median(times), work, counted))
    (t1, w1, n1), (t2, w2, n2) = points
    # t = n * overhead + w * slowdown at both sizes (slowdown = 1 / efficiency)
    det = n1 * w2 - n2 * w1
    slowdown = (n1 * t2 - n2 * t1) / det if det > 0 else 1.0
    slowdown = max(slowdown, 1.0)
    result["efficiency"] = 1.0 / slowdown
    result["op_overhead_s"] = max(t1 - w1 * slowdown, 0.0) / n1
    result["view_overhead_s"] = result["op_overhead_s"]
    result["reference_steps"] = [{"seconds": t, "roofline_work_s": w, "ops": c} for t, w, c in points]
    return result


def measure_collective_stall(device, isolated_s: float, reps: int = 30) -> float:
    """Seconds a blocking all_reduce of 4 KiB costs inside a step beyond `isolated_s` (its time
    when the ranks start it together after a barrier): every rank runs a small reference step,
    then the all_reduce, `reps` times with no barrier in between, as a training step interleaves
    compute and blocking collectives; the median iteration, less the median step run alone at the
    same time on every rank, less `isolated_s`. On CPU ranks the ranks drift out of step and gloo's
    transport threads wait for the cores the ranks compute on; this is what that costs."""
    _, module, args = _reference_step(device, 4, 1)
    buffer = torch.ones(1024, dtype=torch.float32, device=device)
    group_name, world = dist.group.WORLD.group_name, dist.get_world_size()
    fresh = [a.clone() for a in args]
    module(*fresh)

    def alone():
        module(*fresh)

    def with_collective():
        module(*fresh)
        _collective("all_reduce", buffer, group_name, world)

    dist.barrier()
    compute = statistics.median(_timed(alone, device, reps))
    dist.barrier()
    _timed(with_collective, device, 3)
    both = statistics.median(_timed(with_collective, device, reps))
    return max(0.0, both - compute - isolated_s)


def _median_over_ranks(results: list[dict]) -> dict:
    """Each number the median over ranks; bandwidth_by_bytes per size; the reference steps rank 0's."""
    first = results[0]
    out = {"flops_per_s": {k: statistics.median(r["flops_per_s"][k] for r in results) for k in first["flops_per_s"]}}
    for key, value in first.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in results)
    if "bandwidth_by_bytes" in first:
        out["bandwidth_by_bytes"] = [[n, statistics.median(r["bandwidth_by_bytes"][i][1] for r in results)]
                                     for i, (n, _) in enumerate(first["bandwidth_by_bytes"])]
    out["reference_steps"] = first.get("reference_steps")
    return out


# -- the run --------------------------------------------------------------------------------------

def calibrate(base: dict, *, min_bytes: int, max_bytes: int, reps: int, log=print) -> dict | None:
    """Run on every rank under torchrun; returns the calibrated profile on rank 0 (None elsewhere)."""
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
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
        started = True
    try:
        sizes = []
        n = min_bytes
        while n <= max_bytes:
            sizes.append(n)
            n *= 2
        log(f"measuring compute on {world} rank(s) ({device.type})")
        mine = measure_compute(device)
        gathered = [None] * world
        if world > 1:
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        compute = _median_over_ranks(gathered)
        per_kind, measurements = {}, {}
        if world > 1:
            log(f"measuring {', '.join(KINDS)} at {len(sizes)} sizes from {min_bytes} to {max_bytes} bytes")
            points = measure_collectives(device, sizes, reps)
            for kind, pts in points.items():
                a, b = fit_line(pts)
                alpha, beta = alpha_beta(kind, world, a, b)
                per_kind[kind] = {"alpha_s": alpha, "beta_s_per_byte": beta, "gamma_s_per_byte": 0.0}
                measurements[kind] = [[n, t] for n, t in pts]
            if device.type == "cpu":  # GPU collectives overlap compute on their own stream
                log("measuring what a blocking collective costs inside a step")
                a, b = fit_line(points["all_reduce"])
                stall = measure_collective_stall(device, a + b * 4096)
                stalls = [None] * world
                dist.all_gather_object(stalls, stall)
                compute["collective_stall_s"] = statistics.median(stalls)
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
    profile["calibrated"] = {"by": "aot topology calibrate", "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                             "ranks": world, "nodes": nodes, "sizes_bytes": [min_bytes, max_bytes], "repetitions": reps}
    return profile
