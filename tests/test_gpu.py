"""The GPU path (marker `gpu`): CUDA and NCCL, through the same commands a user runs.

Every test here needs a CUDA device and is skipped, with one line, where there is none (CI, the
developers' machines): `scripts/gpu_check.sh` runs them on a GPU machine, with a benchmark, and
collects their figures. Nothing here passes without a GPU: a skip is reported as a skip.

What runs (examples/gpt.py, batch 4 per rank, 5 steps on examples/prepare_data.py's data):
- the topology probe on the real NVML (`aot topology probe`), `aot topology verify` and
  `verify_live` accepting the probed profile and refusing an 8-GPU one; the probed profile is the
  `--topology` of every CUDA build below (the built-in hgx_h200 with --allow-topology-mismatch
  only if the probe itself fails, so the other tests still report);
- one-rank runs under torchrun of dp and fsdp artifacts built for that profile: the programs move
  to cuda:0 and train to the losses and weights of the same model built for the `cpu` profile and
  run on the CPU. A one-rank artifact has no process group (the runner starts none), so NCCL is
  exercised on its own: a one-rank NCCL group bound by runner.execution.groups under the graph's group
  name runs the functional collectives the programs hold (all_reduce, all_gather, reduce_scatter);
- `--precision bf16` on CUDA against eager `torch.autocast("cuda", torch.bfloat16)` on the GPU;
- `aot build --compile aoti` on the GPU machine: a CUDA package, and the compiled tier trains like
  the portable one;
- `aot infer --provider cuda` (and `tensorrt` where ONNX Runtime has it and TensorRT's libraries
  load) against eager PyTorch.

Bounds: the CPU suite's bounds are measured on CPU; these start from them, widened where the
device adds differences of its own (other kernels and reduction orders: a CUDA run is not the
CPU run to the last bit), and are stated at each constant. Each test records what it measured in
the figures file named by $AOT_GPU_FIGURES (scripts/gpu_check.sh sets it) before it asserts, so
one device run gives the numbers to set tighter bounds from.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.commands import EXAMPLES, aot, ok, show, torchrun
from helpers.inference import eager_model, load_user, max_diff
from runner.format.checkpoint import merge_checkpoint
from test_mixed_precision import _mean, _worst  # the weight differences the CPU precision tests bound

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: run scripts/gpu_check.sh on a GPU machine")]

GPT = EXAMPLES / "gpt.py"
STEPS = 5
BATCH = 4

# CUDA run against the CPU run of the same model, fp32 (CPU suite: artifact vs eager DDP 1e-5).
# cuBLAS and the CPU's BLAS sum in other orders (about 1e-7 relative per matmul); AdamW turns a
# near-zero gradient's rounding into up to a step of the learning rate (gpt.py: at most 1e-3).
FP32_FIRST_LOSS_TOL, FP32_LOSS_TOL, FP32_WEIGHT_TOL, FP32_MEAN_TOL = 1e-5, 1e-4, 2e-3, 1e-6
# bf16 against eager autocast on the same GPU (CPU suite, module docstring of
# test_mixed_precision.py: first loss 1e-6, losses 2e-4, mean weight 1e-5, largest 1e-2). The first
# loss is widened to 1e-5: eager runs fused CUDA kernels where the program runs their decompositions.
BF16_FIRST_LOSS_TOL, BF16_LOSS_TOL, BF16_MEAN_TOL, BF16_WEIGHT_TOL = 1e-5, 2e-4, 1e-5, 1e-2
# Compiled tier (Triton kernels, other fusion and reduction orders) against the portable tier, fp32
# (CPU suite: 1e-5 for C++ kernels).
TIER_LOSS_TOL, TIER_WEIGHT_TOL = 1e-4, 2e-3
# ONNX Runtime on the GPU against eager fp32 on the CPU (CPU provider: 1e-4). ONNX Runtime's CUDA
# provider may run fp32 matmuls in TF32 (10-bit mantissa): gpt.py's logits are below 2 in
# magnitude, so 2e-3 is a few TF32 roundings.
GPU_INFER_TOL = 2e-3

PROBE_NAME = "gpu-check"


# -- shared state ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def figures():
    """record(test, **values): what a test measured, written at once to $AOT_GPU_FIGURES (JSON)."""
    path = os.environ.get("AOT_GPU_FIGURES")
    data: dict = json.loads(Path(path).read_text()) if path and Path(path).is_file() else {}

    def record(name: str, **values):
        data.setdefault(name, {}).update(values)
        if path:
            Path(path).write_text(json.dumps(data, indent=1, default=str))

    return record


@pytest.fixture(scope="module")
def target(tmp_path_factory, figures):
    """(--topology value, extra `aot run` arguments): this machine's probed profile, or the built-in
    hgx_h200 with --allow-topology-mismatch where the probe fails (test_probe fails then)."""
    path = tmp_path_factory.mktemp("probe") / "live.json"
    r = aot("topology", "probe", "-o", path, "--name", PROBE_NAME)
    if r.returncode == 0 and json.loads(path.read_text()).get("device_kind") == "cuda":
        figures("target", topology="probed")
        return str(path), []
    figures("target", topology="hgx_h200 (the probe failed)", probe_stderr=r.stderr[-2000:])
    return "hgx_h200", ["--allow-topology-mismatch"]


@pytest.fixture(scope="module")
def builds(target, tmp_path_factory):
    """name -> future of (artifact folder, `aot build` result): every artifact these tests use, built
    at once (a GPU machine has the cores: each build is mostly one core's work)."""
    root = tmp_path_factory.mktemp("gpu_builds")
    topology, _ = target
    common = ("--world-size", 1, "--batch-size", BATCH, "--quiet")
    specs = {
        "cuda-dp": ("--topology", topology, "--strategy", "dp=1", "--no-onnx"),
        "cuda-fsdp": ("--topology", topology, "--strategy", "fsdp=1", "--no-onnx"),
        "cpu-dp": ("--topology", "cpu", "--strategy", "dp=1", "--no-onnx"),
        "cpu-fsdp": ("--topology", "cpu", "--strategy", "fsdp=1", "--no-onnx"),
        "cuda-bf16": ("--topology", topology, "--precision", "bf16", "--no-onnx"),
        "cuda-fp16": ("--topology", topology, "--precision", "fp16", "--no-onnx"),
        "cuda-aoti": ("--topology", topology, "--compile", "aoti", "--no-onnx"),
        "cuda-onnx": ("--topology", topology, "--onnx"),
    }
    pool = ThreadPoolExecutor(len(specs))

    def build(name, args):
        art = root / name
        return art, aot("build", GPT, *common, *args, "-o", art)

    futures = {name: pool.submit(build, name, args) for name, args in specs.items()}
    yield lambda name: _built(*futures[name].result())
    pool.shutdown(wait=True)


def _built(art: Path, r) -> Path:
    ok(r)
    return art


def _train(art: Path, folder: Path, data: Path, *extra) -> tuple[list[dict], dict[str, torch.Tensor], str]:
    """`torchrun --nproc-per-node 1 -m aot run ART --steps 5 --data DATA --metrics ... --save ...`:
    (metrics records, merged final weights, stderr)."""
    folder.mkdir(parents=True, exist_ok=True)
    metrics, ckpt = folder / "metrics.jsonl", folder / "ckpt"
    r = ok(torchrun(1, "run", art, "--steps", STEPS, "--data", data, "--metrics", metrics, "--save", ckpt, *extra))
    merge_checkpoint(ckpt, folder / "merged.safetensors")  # what `aot checkpoint merge` runs
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(records) == STEPS, show(r)
    return records, load_file(folder / "merged.safetensors"), r.stderr


def _both(*runs):
    """The runs (argument tuples of _train) at once: a CPU run and a GPU run do not compete."""
    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda args: _train(*args), runs))


def _losses(records) -> list[float]:
    return [r["loss"] for r in records]


def _step_ms(records) -> float:
    """Median step time after the first step, in ms."""
    return statistics.median(r["step_time_s"] for r in records[1:]) * 1e3


# -- topology ------------------------------------------------------------------------------------


def test_probe_reads_this_gpu_through_nvml_and_verify_live_accepts_it(target, builds, tmp_path, figures):
    """(`builds` only starts the builds the later tests wait for.)"""
    from runner.hardware.topology import load_profile
    from runner.hardware.topology_check import TopologyMismatch, verify_live

    path = tmp_path / "probe.json"
    r = ok(aot("topology", "probe", "-o", path, "--name", PROBE_NAME))
    profile = json.loads(path.read_text())
    gpus = list(profile["node"]["gpus"].values())
    figures(
        "probe",
        source=profile["probe"]["source"],
        driver=profile["probe"]["driver_version"],
        gpus=[{k: g[k] for k in ("name", "compute_capability", "memory_bytes", "numa_node", "pcie")} for g in gpus],
        notes=profile["probe"]["notes"],
    )
    assert profile["device_kind"] == "cuda" and profile["backend"] == "nccl", show(r)
    assert profile["probe"]["source"] == "nvml", profile["probe"]  # the real NVML, not torch's fallback
    assert len(gpus) == torch.cuda.device_count()
    for index, g in enumerate(sorted(gpus, key=lambda g: g["index"])):
        assert g["name"] == torch.cuda.get_device_name(index)
        assert tuple(g["compute_capability"]) == torch.cuda.get_device_capability(index)
        total = torch.cuda.get_device_properties(index).total_memory
        assert abs(g["memory_bytes"] - total) <= 0.02 * total, (g["memory_bytes"], total)

    # the start-up check: this machine against its own probe, then against 8 GPUs it does not have
    warnings = []
    assert verify_live(load_profile(str(path)), warn=warnings.append, env={"LOCAL_RANK": "0"}) == []
    figures("probe", verify_live_warnings=warnings)
    r = ok(aot("topology", "verify", path))
    assert f"this machine matches topology {PROBE_NAME!r}" in r.stdout, show(r)
    if torch.cuda.device_count() != 8:
        with pytest.raises(TopologyMismatch, match="GPU count"):
            verify_live(load_profile("hgx_h200"), env={"LOCAL_RANK": "0"})
    assert target[1] == []  # the builds below used this probe


# -- one rank on CUDA against the CPU --------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_one_rank_cuda_run_trains_like_the_cpu_build(strategy, builds, target, gpt_data, tmp_path, figures):
    cuda_art, cpu_art = builds(f"cuda-{strategy}"), builds(f"cpu-{strategy}")
    manifest = json.loads((cuda_art / "manifest.json").read_text())
    assert manifest["topology"]["profile"]["device_kind"] == "cuda" and manifest["mesh"]["axes"] == [strategy]
    (cuda, cuda_w, cuda_err), (cpu, cpu_w, cpu_err) = _both((cuda_art, tmp_path / "cuda", gpt_data, *target[1]), (cpu_art, tmp_path / "cpu", gpt_data))
    ready = [line for line in cuda_err.splitlines() if " ready in " in line]
    assert ready and "(cuda:0, " in ready[0], cuda_err  # the programs moved to the GPU
    assert "(cpu, " in next(line for line in cpu_err.splitlines() if " ready in " in line)
    assert "topology mismatch" not in cuda_err or target[1], cuda_err
    losses, ref = _losses(cuda), _losses(cpu)
    figures(
        f"one_rank_{strategy}",
        process_groups=manifest["process_groups"],
        collectives=[c["kind"] for c in manifest["programs"]["train"]["collectives"]],
        cuda_losses=losses,
        cpu_losses=ref,
        max_loss_diff=max(abs(a - b) for a, b in zip(losses, ref)),
        worst_weight_diff=_worst(cuda_w, cpu_w),
        mean_weight_diff=_mean(cuda_w, cpu_w),
        cuda_step_ms=_step_ms(cuda),
        cpu_step_ms=_step_ms(cpu),
    )
    assert abs(losses[0] - ref[0]) <= FP32_FIRST_LOSS_TOL, (losses, ref)
    assert max(abs(a - b) for a, b in zip(losses, ref)) <= FP32_LOSS_TOL, (losses, ref)
    assert _worst(cuda_w, cpu_w) <= FP32_WEIGHT_TOL and _mean(cuda_w, cpu_w) <= FP32_MEAN_TOL
    assert all(w.dtype == torch.float32 and w.device.type == "cpu" for w in cuda_w.values())
    assert losses[-1] < losses[0]  # it trains


NO_SYNC_SCRIPT = """
import json, sys
import torch
from runner.execution.groups import leave_process_group
from runner.execution.trainer import Trainer

artifact, out, allow = sys.argv[1], sys.argv[2], sys.argv[3:]
trainer = Trainer(artifact, allow_topology_mismatch=bool(allow))
source = trainer.data_source()
batches = []
for step in range(4):  # on the device before the loop: copying a batch in is the data pipeline's business
    inputs, targets = source.batch(step)
    inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    batches.append(([t.to(trainer.device) for t in inputs], targets.to(trainer.device)))
trainer.step(*batches[0])  # warm-up: allocations, the first launch of every kernel
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")  # any wait for the device while queueing raises
launched = [trainer.launch(*b) for b in batches[1:]]
torch.cuda.set_sync_debug_mode("default")
json.dump({"losses": [s.loss() for s in launched], "seconds": [s.seconds() for s in launched]}, open(out, "w"))
leave_process_group()
"""


@pytest.mark.parametrize("name", ["cuda-dp", "cuda-fp16"])
def test_queueing_steps_never_waits_for_the_gpu(name, builds, target, tmp_path, figures):
    """Issue #46 item 3: launching a step (learning rates, inputs already on the device, the seed,
    the program, its timing events) issues no host-device synchronization, so the host queues step
    n+1 while step n runs; torch's sync debug mode raises on any. fp16 with gpt.py's varying
    schedule too: the schedule's position (steps less skipped updates) is picked on the device."""
    script, out = tmp_path / "no_sync.py", tmp_path / "no_sync.json"
    script.write_text(NO_SYNC_SCRIPT)
    r = torchrun(1, script, builds(name), out, *(["allow"] if target[1] else []), module=None)
    figures(f"no_sync_{name}", ok=r.returncode == 0, stderr=r.stderr[-2000:])
    ok(r)
    result = json.loads(out.read_text())
    figures(f"no_sync_{name}", losses=result["losses"], step_ms=[s * 1e3 for s in result["seconds"]])
    assert all(s > 0 for s in result["seconds"])


# A replayed step runs the kernels of an uncaptured one on the same values: equal, but for a kernel
# that is itself nondeterministic (atomics); far below the CPU-vs-CUDA bounds above.
GRAPHS_TOL = 1e-6


@pytest.mark.parametrize("name", ["cuda-dp", "cuda-bf16"])
def test_cuda_graphs_train_like_the_uncaptured_step(name, builds, target, gpt_data, tmp_path, figures):
    """Issue #46 item 2: `aot run --cuda-graphs on` captures the whole step after its eager warm-up
    and replays it. The replays run the kernels the uncaptured steps run, on the same inputs, the
    batch and learning rates copied into the graph's buffers and dropout drawing the masks of each
    step's seed: 5 steps train to the losses and weights of `--cuda-graphs off`. The two runs are
    made one after the other, so their step times compare."""
    art = builds(name)
    on, on_w, on_err = _train(art, tmp_path / "graphs", gpt_data, "--cuda-graphs", "on", *target[1])
    off, off_w, off_err = _train(art, tmp_path / "eager", gpt_data, "--cuda-graphs", "off", *target[1])
    captured = [line for line in on_err.splitlines() if "cuda graphs:" in line]
    losses, ref = _losses(on), _losses(off)
    figures(
        f"cuda_graphs_{name}",
        lines=captured,
        losses=losses,
        uncaptured_losses=ref,
        max_loss_diff=max(abs(a - b) for a, b in zip(losses, ref)),
        worst_weight_diff=_worst(on_w, off_w),
        replayed_step_ms=statistics.median(r["step_time_s"] for r in on[4:]) * 1e3,
        uncaptured_step_ms=statistics.median(r["step_time_s"] for r in off[4:]) * 1e3,
    )
    assert captured and "captured after 3 eager step(s)" in captured[0], on_err
    assert "cuda graphs:" not in off_err
    # the same kernels on the same inputs: equal but for the kernels' own nondeterminism
    assert max(abs(a - b) for a, b in zip(losses, ref)) <= GRAPHS_TOL, (losses, ref)
    assert _worst(on_w, off_w) <= GRAPHS_TOL, _worst(on_w, off_w)


NCCL_SCRIPT = """
import os
import torch
import torch.distributed as dist
from runner.execution.groups import bind_process_groups

device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
assert dist.get_backend() == "nccl"
bound = bind_process_groups({"aot.dp": {"axis": "dp", "groups": [[0]]}}, dist.get_rank(), dist.get_world_size())
assert list(bound) == ["aot.dp"]
f = torch.ops._c10d_functional
x = torch.arange(1, 9, dtype=torch.float32, device=device)
results = {
    "all_reduce": f.wait_tensor(f.all_reduce(x, "avg", "aot.dp")),
    "all_gather_into_tensor": f.wait_tensor(f.all_gather_into_tensor(x, 1, "aot.dp")),
    "reduce_scatter_tensor": f.wait_tensor(f.reduce_scatter_tensor(x, "sum", 1, "aot.dp")),
    "all_reduce_bf16": f.wait_tensor(f.all_reduce(x.bfloat16(), "sum", "aot.dp")).float(),
}
for name, y in results.items():
    assert y.device == device and torch.equal(y, x), (name, y)
torch.cuda.synchronize()
dist.destroy_process_group()
print("nccl ok:", ", ".join(results), "; NCCL", torch.cuda.nccl.version())
"""


def test_nccl_group_bound_by_name_runs_the_graphs_collectives(tmp_path, figures):
    """A one-rank artifact starts no process group, so NCCL gets its own check: the runner's binding
    (runner.execution.groups.bind_process_groups, as aot run calls it) of a one-rank NCCL group under the name
    graphs use, and the functional collectives of aot's programs over it on cuda:0."""
    script = tmp_path / "nccl_check.py"
    script.write_text(NCCL_SCRIPT)
    r = torchrun(1, script, module=None)
    figures("nccl", returncode=r.returncode, stdout=r.stdout[-500:], stderr=r.stderr[-1500:])
    ok(r)
    assert "nccl ok: all_reduce, all_gather_into_tensor, reduce_scatter_tensor" in r.stdout, show(r)


# -- bf16 on CUDA against eager autocast -------------------------------------------------------------


def eager_cuda(model_file: Path, data_file: Path, precision: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Eager PyTorch on cuda:0, one rank, as tests/helpers/ddp_reference.py trains on the CPU: the same
    initial weights (torch.manual_seed(0); model() on the CPU, then moved), data order, per-step seed,
    optimizer, schedule and clipping; forward and loss under torch.autocast("cuda", bf16) for bf16."""
    import torch.nn.functional as F

    device = torch.device("cuda", 0)
    user = load_user(model_file)
    torch.manual_seed(0)
    model = user.model().to(device)
    params = list(model.parameters())
    opt = user.optimizer(params) if hasattr(user, "optimizer") else torch.optim.AdamW(params, lr=1e-3)
    sched = user.scheduler(opt) if hasattr(user, "scheduler") else None
    loss_fn = getattr(user, "loss", None) or (lambda o, t: F.cross_entropy(o.reshape(-1, o.size(-1)), t.reshape(-1)))
    clip = getattr(user, "max_grad_norm", None)
    data = load_file(data_file)
    inputs, targets = data["inputs"], data["targets"]
    rows, losses = targets.shape[0], []
    for step in range(STEPS):
        idx = (torch.arange(BATCH) + step * BATCH) % rows
        x, y = inputs[idx].to(device), targets[idx].to(device)
        opt.zero_grad()
        torch.manual_seed((step * 1_009) % 2**63)  # the runner's per-step seed at seed 0, rank 0
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def test_bf16_on_cuda_matches_eager_autocast(builds, target, gpt_data, tmp_path, figures):
    art = builds("cuda-bf16")
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["precision"]["compute"] == "bf16" and manifest["precision"]["autocast_rules"] == "cuda"
    records, weights, err = _train(art, tmp_path / "run", gpt_data, *target[1])
    assert "(cuda:0, " in err, err
    losses = _losses(records)
    ref_losses, ref_weights = eager_cuda(GPT, gpt_data, "bf16")
    fp32_losses, fp32_weights = eager_cuda(GPT, gpt_data, "fp32")
    figures(
        "bf16",
        losses=losses,
        eager_autocast_losses=ref_losses,
        eager_fp32_losses=fp32_losses,
        first_loss_diff=abs(losses[0] - ref_losses[0]),
        max_loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)),
        worst_weight_diff=_worst(weights, ref_weights),
        mean_weight_diff=_mean(weights, ref_weights),
        fp32_first_loss_diff=abs(losses[0] - fp32_losses[0]),
        fp32_mean_weight_diff=_mean(weights, fp32_weights),
        step_ms=_step_ms(records),
    )
    assert abs(losses[0] - ref_losses[0]) <= BF16_FIRST_LOSS_TOL, (losses, ref_losses)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= BF16_LOSS_TOL, (losses, ref_losses)
    assert _mean(weights, ref_weights) <= BF16_MEAN_TOL and _worst(weights, ref_weights) <= BF16_WEIGHT_TOL
    assert all(w.dtype == torch.float32 for w in weights.values())  # fp32 master weights
    # the bounds can fail: eager fp32 is outside them
    assert abs(losses[0] - fp32_losses[0]) > 10 * BF16_FIRST_LOSS_TOL or _mean(weights, fp32_weights) > BF16_MEAN_TOL
    assert losses[-1] < losses[0]


# -- compiled tier on the GPU ------------------------------------------------------------------------


def test_aoti_cuda_package_trains_like_the_portable_tier(builds, target, gpt_data, tmp_path, figures):
    art = builds("cuda-aoti")
    manifest = json.loads((art / "manifest.json").read_text())
    entry = manifest["compiled"]
    major, minor = torch.cuda.get_device_capability(0)
    assert entry["device"]["kind"] == "cuda" and entry["device"]["capability"] == f"{major}.{minor}", entry
    assert entry["torch_version"] == torch.__version__
    package = entry["programs"]["train"]["file"]
    assert package in manifest["files"] and (art / package).is_file()
    summary = json.loads(ok(aot("inspect", art, "--json")).stdout)
    assert summary["compiled"]["programs"]["train"]["file"] == package
    runs = {tier: _train(art, tmp_path / tier, gpt_data, "--tier", tier, *target[1]) for tier in ("compiled", "portable")}
    (c_records, c_weights, c_err), (p_records, p_weights, p_err) = runs["compiled"], runs["portable"]
    figures(
        "aoti",
        device=entry["device"],
        compiled_losses=_losses(c_records),
        portable_losses=_losses(p_records),
        max_loss_diff=max(abs(a - b) for a, b in zip(_losses(c_records), _losses(p_records))),
        worst_weight_diff=_worst(c_weights, p_weights),
        mean_weight_diff=_mean(c_weights, p_weights),
        compiled_step_ms=_step_ms(c_records),
        portable_step_ms=_step_ms(p_records),
        package_bytes=(art / package).stat().st_size,
    )
    assert [r["tier"] for r in c_records] == ["compiled"] * STEPS and [r["tier"] for r in p_records] == ["portable"] * STEPS
    assert "(cuda:0, compiled tier" in c_err and "(cuda:0, portable tier" in p_err and "notice:" not in c_err, c_err
    for a, b in zip(c_records, p_records):
        assert abs(a["loss"] - b["loss"]) <= TIER_LOSS_TOL, (a, b)
    assert _worst(c_weights, p_weights) <= TIER_WEIGHT_TOL
    assert c_records[-1]["loss"] < c_records[0]["loss"]


# -- exported inference on the GPU providers ----------------------------------------------------------


def _ort_providers() -> list[str]:
    try:
        import onnxruntime
    except ImportError:
        return []
    return onnxruntime.get_available_providers()


def _tensorrt_loads() -> bool:
    """Whether TensorRT's runtime library can be loaded (onnxruntime-gpu lists its provider always)."""
    for name in filter(None, (ctypes.util.find_library("nvinfer"), "libnvinfer.so.10", "libnvinfer.so")):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


PROVIDERS = [
    pytest.param("cuda", "CUDAExecutionProvider", id="cuda"),
    pytest.param("tensorrt", "TensorrtExecutionProvider", id="tensorrt"),
]


@pytest.mark.parametrize("provider,name", PROVIDERS)
def test_aot_infer_on_the_gpu_provider_matches_eager(provider, name, builds, tmp_path, figures):
    available = _ort_providers()
    figures("infer", available_providers=available)
    if name not in available:
        pytest.skip(f"this onnxruntime has no {name} (it has {', '.join(available) or 'none'}): install onnxruntime-gpu")
    if provider == "tensorrt" and not _tensorrt_loads():
        pytest.skip("TensorRT's libraries (libnvinfer) are not installed here")
    art = builds("cuda-onnx")
    gpt = load_user(GPT)
    inputs, targets = gpt.batch(3)  # not the example batch size: the batch dimension is dynamic
    batch = tmp_path / "batch.safetensors"
    save_file({"inputs": inputs, "targets": targets}, batch)
    out = tmp_path / "out.safetensors"
    r = ok(aot("infer", art, "--input", batch, "--provider", provider, "-o", out, "--warmup", 2, "--iters", 10, "--json"))
    timing = json.loads(r.stdout)
    with torch.no_grad():
        expected = eager_model(gpt)(inputs)
    diff = max_diff(load_file(out)["outputs"], expected)
    figures(f"infer_{provider}", provider=timing["provider"], max_abs_diff=diff, latency_ms_p50=timing["latency_ms_p50"])
    assert timing["provider"] == name and timing["batch_size"] == 3, timing
    assert diff <= GPU_INFER_TOL
