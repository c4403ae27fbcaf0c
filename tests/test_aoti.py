"""The compiled tier: `aot build --compile aoti` packages, and `aot run` choosing between tiers.

Real builds and real torchrun runs on CPU with gloo: the AOTInductor packages of a data-parallel
program (bucketed gradients all_reduced) and of a 2-D fsdp x tp program (all_gather, reduce_scatter
and tp's all_reduce) train to the same losses and weights as the portable programs (1e-5). A run
that cannot use the package (another device kind, a CPU below the package's level, another torch)
falls back with one notice line, or fails in one line when --tier compiled insists, before any
process group starts. Packages are checked entry by entry before they are loaded: no pickle is ever
read. A bf16 build's package (one attention layer, one rank) trains like its portable program too.
The three packages compile once per module, two at a time (about 20-40 s each on 2 cores).
"""

from __future__ import annotations

import io
import json
import math
import pickle
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.commands import EXAMPLES, REPO, TIMEOUT, aot, clean_env, ok, show, torchrun
from runner.format.artifact import Artifact, manifest_digest
from runner.format.checkpoint import merge_checkpoint
from runner.execution.compiled import choose_tier, live_device, load_compiled, mismatch, package_problem, x86_target
from runner.errors import AotError
from runner.format.integrity import sha256_bytes

MLP = EXAMPLES / "mlp.py"
AOT_FRAME = re.compile(r'File "[^"]*[/\\](aot|runner)[/\\][^"]*\.py", line \d+')
pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None, reason="AOTInductor needs a C++ compiler")


# examples/mlp.py data parallel, and fsdp x tp: every collective kind of a step in one package; tp's
# weight gradients are bare matmuls feeding SGD's weight decay (see aot.emit.aoti.ExplicitAlpha)
STRATEGIES = ("dp=2", "fsdp=2,tp=2")


def world_of(strategy: str) -> int:
    return math.prod(int(part.split("=")[1]) for part in strategy.split(","))


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, Path]:
    """STRATEGIES' builds of examples/mlp.py and ATTENTION's bf16 build (one CPU rank, batch 2),
    each with --compile aoti. Two builds run at a time: compiling is mostly one core's work, and the
    machine has two."""
    root = tmp_path_factory.mktemp("aoti")
    (root / "attention.py").write_text(ATTENTION)
    builds = {s: (MLP, "--strategy", s) for s in STRATEGIES}
    builds["bf16"] = (root / "attention.py", "--precision", "bf16", "--topology", "cpu", "--batch-size", 2)
    out = {name: root / name.replace("=", "").replace(",", "-") for name in builds}
    with ThreadPoolExecutor(2) as pool:
        results = pool.map(lambda name: aot("build", *builds[name], "--no-onnx", "--compile", "aoti", "-o", out[name], "--quiet"), builds)
        for r in results:
            ok(r)
    return out


@pytest.fixture(scope="module")
def compiled(packages):
    """strategy -> its examples/mlp.py artifact built with --compile aoti."""
    return lambda strategy: packages[strategy]


# One causal self-attention layer in bf16 (--precision bf16): its `k.transpose(-2, -1)` copy is what
# GCC 12 miscompiled at -march=x86-64-v4 (aot.emit.aoti.GCC_FLAGS). batch() slices inputs and targets
# out of one window, so the traced example batch has strides (65, 1) while the runner's are (64, 1)
# (aot.emit.aoti._contiguous_inputs).
ATTENTION = """
import math

import torch
from torch import nn
from torch.nn import functional as F

vocab, block, dim, heads = 32, 64, 64, 4


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.tril(torch.ones(block, block, dtype=torch.bool)), persistent=False)

    def forward(self, idx):
        x = self.emb(idx)
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, heads, -1).transpose(1, 2) for f in self.qkv)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(dim // heads))
        att = F.softmax(att.masked_fill(~self.mask[:T, :T], float("-inf")), dim=-1)
        return self.head((att @ v).transpose(1, 2).reshape(B, T, dim))


def model():
    return Attention()


def batch(batch_size):
    g = torch.Generator().manual_seed(0)
    window = torch.randint(0, vocab, (batch_size, block + 1), generator=g)
    return window[:, :-1], window[:, 1:]


def loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)
"""


@pytest.fixture(scope="module")
def bf16_attention(packages):
    """ATTENTION built with --precision bf16 --compile aoti for one CPU rank."""
    return packages["bf16"]


def train(art: Path, world: int, tier: str, folder: Path) -> tuple[list[dict], dict[str, torch.Tensor], str]:
    """3 steps at `world` ranks: (metrics records, merged final weights, stderr)."""
    folder.mkdir(parents=True)
    r = ok(torchrun(world, "run", art, "--steps", "3", "--tier", tier, "--metrics", folder / "m.jsonl", "--save", folder / "ck"))
    merge_checkpoint(folder / "ck", folder / "w.safetensors")  # what `aot checkpoint merge` runs
    records = [json.loads(line) for line in (folder / "m.jsonl").read_text().splitlines()]
    return records, load_file(folder / "w.safetensors"), r.stderr


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compiled_tier_trains_like_the_portable_tier(compiled, strategy, tmp_path):
    """With tp, each weight's gradient is a bare matmul feeding SGD's weight decay
    (`grad.add(param, alpha=wd)`), which inductor's add+mm -> addmm fusion computed without alpha
    before aot.emit.aoti.ExplicitAlpha."""
    art = compiled(strategy)
    manifest = json.loads((art / "manifest.json").read_text())
    entry = manifest["compiled"]
    assert entry["device"]["kind"] == "cpu" and entry["torch_version"] == torch.__version__
    package = entry["programs"]["train"]["file"]
    assert package in manifest["files"] and (art / package).is_file()
    kinds = {c["kind"] for c in manifest["programs"]["train"]["collectives"]}
    assert "all_reduce" in kinds and ("fsdp" not in strategy or {"all_gather_into_tensor", "reduce_scatter_tensor"} <= kinds)
    assert ("tp=" in strategy) == bool(manifest.get("tensor_parallel"))

    runs = {tier: train(art, world_of(strategy), tier, tmp_path / tier) for tier in ("compiled", "portable")}
    (c_records, c_weights, c_err), (p_records, p_weights, p_err) = runs["compiled"], runs["portable"]
    assert [r["tier"] for r in c_records] == ["compiled"] * 3 and [r["tier"] for r in p_records] == ["portable"] * 3
    assert "compiled tier" in c_err and "portable tier" in p_err and "notice:" not in c_err
    for a, b in zip(c_records, p_records):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)
    assert c_records[-1]["loss"] < c_records[0]["loss"]  # it trains
    assert c_weights.keys() == p_weights.keys()
    for name in c_weights:
        assert torch.allclose(c_weights[name], p_weights[name], rtol=0, atol=1e-5), name
    summary = json.loads(ok(aot("inspect", art, "--json")).stdout)
    assert summary["compiled"]["programs"]["train"]["file"] == package


def test_bf16_compiled_tier_trains_like_the_portable_tier(bf16_attention, tmp_path):
    """A bf16 package's losses match the portable program's within 1e-3 over 3 steps (measured:
    2.4e-7; examples/gpt.py at batch 4: 1e-4 over 5 steps). Before aot.emit.aoti.GCC_FLAGS the
    package's loss was NaN from step 1 (GCC 12 dropped the stores of a bf16 tile transpose), and
    before _contiguous_inputs it read its inputs with the example batch's strides and failed on an
    embedding index out of bounds."""
    manifest = json.loads((bf16_attention / "manifest.json").read_text())
    assert manifest["precision"]["compute"] == "bf16" and "train" in manifest["compiled"]["programs"]
    losses = {}
    for tier in ("compiled", "portable"):
        metrics = tmp_path / f"{tier}.jsonl"
        ok(aot("run", bf16_attention, "--steps", "3", "--tier", tier, "--metrics", metrics))
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [r["tier"] for r in records] == [tier] * 3
        losses[tier] = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses["compiled"]), losses
    for a, b in zip(losses["compiled"], losses["portable"]):
        assert abs(a - b) <= 1e-3, losses
    assert losses["compiled"][-1] < losses["compiled"][0]  # it trains


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 packages only")
def test_gcc_compiles_x86_packages_without_rtl_dead_store_elimination():
    from torch._inductor.cpp_builder import get_cpp_compiler

    from aot.emit.aoti import GCC_FLAGS, _cpu_target, _is_gcc

    device, configs = _cpu_target()
    assert configs["cpp.march"].split()[0] == device["march"]
    assert (configs["cpp.march"].split()[1:] == list(GCC_FLAGS)) == _is_gcc(get_cpp_compiler())
    assert GCC_FLAGS == ("-fno-dse",)


def test_explicit_alpha_keeps_weight_decay_through_the_addmm_fusion():
    """ExplicitAlpha (inductor's post-grad pre-pass in every aot compile) turns add's alpha into a
    mul, so the add+mm -> addmm fusion, which drops alpha, has none to drop."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from aot.emit.aoti import ExplicitAlpha

    def sgd_grad(a, b, param):  # a weight's gradient straight from a matmul, plus weight decay
        return torch.mm(a, b).add(param, alpha=1e-4)

    args = (torch.randn(8, 4), torch.randn(4, 6), torch.randn(8, 6))
    gm = make_fx(sgd_grad)(*args)
    ExplicitAlpha()(gm.graph)
    gm.recompile()
    adds = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    assert adds and all("alpha" not in n.kwargs for n in adds)
    assert torch.allclose(gm(*args), sgd_grad(*args), rtol=0, atol=1e-6)


def test_tier_choice_follows_device_kind_cpu_level_and_torch():
    cpu = {"kind": "cpu", "arch": "x86_64", "isa": "avx2", "capability": "AVX2", "march": "x86-64-v3"}
    entry = {"compiler": "aoti", "device": cpu, "torch_version": torch.__version__, "programs": {"train": {"file": "compiled/train.cpu.pt2"}}}
    here_cpu = {"kind": "cpu", "arch": "x86_64", "capability": "AVX2"}
    assert choose_tier(entry, "train", here_cpu) == ("compiled", None)
    assert choose_tier(entry, "train", {**here_cpu, "capability": "AVX512"}) == ("compiled", None)
    assert choose_tier(entry, "train", here_cpu, "portable") == ("portable", None)
    # a package for the CPU on a GPU run, and one for a GPU on a CPU run: the portable program, one notice
    tier, notice = choose_tier(entry, "train", {"kind": "cuda", "capability": "9.0"})
    assert tier == "portable"
    assert notice == "notice: compiled package is for cpu, this run is cuda; using the portable program"
    cuda = {**entry, "device": {"kind": "cuda", "capability": "9.0"}}
    assert choose_tier(cuda, "train", here_cpu)[1] == "notice: compiled package is for cuda, this run is cpu; using the portable program"
    assert choose_tier(cuda, "train", {"kind": "cuda", "capability": "9.0"}) == ("compiled", None)
    assert "compute capability 9.0, this GPU has 8.0" in choose_tier(cuda, "train", {"kind": "cuda", "capability": "8.0"})[1]
    # the CUDA runtime the kernels were compiled against (where the package says it)
    cu128 = {**entry, "device": {"kind": "cuda", "capability": "9.0", "cuda": "12.8"}}
    assert choose_tier(cu128, "train", {"kind": "cuda", "capability": "9.0", "cuda": "12.8"}) == ("compiled", None)
    assert choose_tier(cu128, "train", {"kind": "cuda", "capability": "9.0", "cuda": "12.6"})[1] == (
        "notice: compiled package was built against CUDA runtime 12.8, this run's torch has CUDA 12.6; using the portable program"
    )
    with pytest.raises(AotError, match="compiled package is for cuda, this run is cpu; .*--tier auto"):
        choose_tier(cuda, "train", here_cpu, "compiled")
    # below the package's CPU level, another architecture, another torch build
    assert "needs AVX2 CPUs" in choose_tier(entry, "train", {**here_cpu, "capability": "DEFAULT"})[1]
    assert "is for x86_64 CPUs" in choose_tier(entry, "train", {**here_cpu, "arch": "aarch64"})[1]
    assert "torch 2.99.0+cu999" in mismatch(cpu, here_cpu, "2.99.0+cu999")
    # kernels that use features beyond their level (VNNI is not part of AVX512 to ATen) need those too
    vnni = {**cpu, "isa": "avx512 avx512_vnni", "features": ["avx512", "avx512_vnni"], "capability": "AVX512", "march": "x86-64-v4"}
    skylake = {**here_cpu, "capability": "AVX512", "features": ["avx2", "avx512"]}
    assert mismatch(vnni, skylake, torch.__version__) == ("compiled package uses CPU features avx512_vnni (avx512 avx512_vnni kernels), which this CPU lacks")
    assert mismatch(vnni, {**skylake, "features": ["avx2", "avx512", "avx512_vnni"]}, torch.__version__) is None
    assert x86_target(["avx512", "avx512_vnni", "amx_tile"]) == ("x86-64-v4", "AVX512")
    assert x86_target(["avx2"]) == ("x86-64-v3", "AVX2") and x86_target([]) == ("x86-64", "DEFAULT")
    # an artifact built without --compile aoti: portable with nothing to say, or one line when insisted on
    assert choose_tier(None, "train", here_cpu) == ("portable", None)
    with pytest.raises(AotError, match="has no compiled package"):
        choose_tier(None, "train", here_cpu, "compiled")
    with pytest.raises(AotError, match="the compiled entry needs"):
        choose_tier({"device": "cpu"}, "train", here_cpu)
    assert live_device(torch.device("cpu"))["capability"] == torch.backends.cpu.get_cpu_capability()


def test_cpu_below_the_package_level_falls_back_with_one_notice(compiled, tmp_path):
    """A run whose CPU capability is below the package's (ATen told to use its baseline kernels, as
    on a CPU without AVX2): auto runs the portable program after one notice line; --tier compiled
    fails in one line on every rank."""
    art = compiled("dp=2")
    device = json.loads((art / "manifest.json").read_text())["compiled"]["device"]
    # the level the package records follows the kernels inductor generated (e.g. "avx512 avx512_vnni")
    assert device["features"] == device["isa"].split() and device["capability"] == x86_target(device["features"])[1]
    assert device["capability"] != "DEFAULT"  # this machine has AVX2 at least, and inductor used it
    baseline = {"ATEN_CPU_CAPABILITY": "default"}
    r = ok(torchrun(2, "run", art, "--steps", "1", "--metrics", tmp_path / "m.jsonl", env=baseline))
    notices = [line for line in r.stderr.splitlines() if line.startswith("notice:")]
    assert len(notices) == 1, show(r)
    assert "compiled package needs" in notices[0] and notices[0].endswith("using the portable program"), show(r)
    assert json.loads((tmp_path / "m.jsonl").read_text())["tier"] == "portable"

    r = torchrun(2, "run", art, "--steps", "1", "--tier", "compiled", env=baseline)
    assert r.returncode != 0 and not AOT_FRAME.search(r.stderr), show(r)  # torchrun's own traceback is torch's
    errors = [line for line in r.stderr.splitlines() if line.startswith("aot: error: ")]
    assert len(errors) == 2 and all("compiled package needs" in e and "--tier auto" in e for e in errors), show(r)


def test_tier_is_chosen_before_the_process_group_starts(compiled):
    """The tier is decided from the manifest and this machine before rendezvous: a rank launched
    as one of 2 with no rendezvous set (no MASTER_ADDR) reports the tier error with --tier
    compiled, and with --tier auto prints rank 0's notice before failing on the rendezvous."""
    art = compiled("dp=2")

    def run_rank(rank: int, tier: str) -> subprocess.CompletedProcess:
        return aot("run", art, "--steps", "1", "--tier", tier, env={"ATEN_CPU_CAPABILITY": "default", "WORLD_SIZE": "2", "RANK": str(rank)})

    r = run_rank(0, "compiled")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, show(r)
    assert lines[0].startswith("aot: error: ") and "compiled package needs" in lines[0] and "--tier auto" in lines[0], show(r)
    assert "rendezvous" not in r.stderr, show(r)

    r = run_rank(0, "auto")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 2, show(r)
    assert lines[0].startswith("notice: compiled package needs") and lines[0].endswith("using the portable program"), show(r)
    assert lines[1] == (
        "aot: error: [rank 0] no rendezvous set: launch multi-rank artifacts with torchrun, or give each "
        "process --master-addr and --master-port (MASTER_ADDR and MASTER_PORT under srun)"
    ), show(r)

    r = run_rank(1, "auto")  # the notice is rank 0's alone
    assert r.returncode == 1 and "notice:" not in r.stderr and "no rendezvous set" in r.stderr, show(r)


class Exploit:
    """A pickle that, if ever unpickled, writes a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _repack(data: bytes, extra: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info))
        for name, content in extra.items():
            dst.writestr(name, content)
    return out.getvalue()


def test_compiled_package_holding_a_pickle_is_refused(compiled, tmp_path):
    """A pickle planted in the package with the hashes and digest rewritten to match is refused
    before the loader sees the package, and is never unpickled."""
    art = Path(shutil.copytree(compiled("dp=2"), tmp_path / "art"))
    manifest = json.loads((art / "manifest.json").read_text())
    relpath = manifest["compiled"]["programs"]["train"]["file"]
    marker = tmp_path / "executed"
    planted = _repack((art / relpath).read_bytes(), {"train/data/aotinductor/model/constants.json": pickle.dumps(Exploit(str(marker)))})
    (art / relpath).write_bytes(planted)
    manifest["files"][relpath] = {"sha256": sha256_bytes(planted), "size": len(planted)}
    manifest["digest"] = manifest_digest(manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(AotError, match="holds a pickle") as e:
        load_compiled(Artifact(art), "train", torch.device("cpu"), len(manifest["programs"]["train"]["inputs"]))
    assert relpath in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()


def test_package_entries_are_checked_before_loading(compiled):
    data = (compiled("dp=2") / "compiled" / "train.cpu.pt2").read_bytes()
    assert package_problem(data) is None
    assert "unsafe path" in package_problem(_repack(data, {"../outside.so": b"\x7fELF"}))
    assert "not part of an AOTInductor package" in package_problem(_repack(data, {"train/data/weights.pkl": b"x"}))
    assert "nested zip" in package_problem(_repack(data, {"train/extra.json": data[:64]}))
    assert "not a zip" in package_problem(b"\x80\x04K\x01.")


def test_build_without_a_cpp_compiler_fails_in_one_line(tmp_path):
    env = {**clean_env(), "CXX": str(tmp_path / "no-such-compiler")}
    r = subprocess.run(
        [sys.executable, "-m", "aot", "build", str(MLP), "--no-onnx", "--compile", "aoti", "-o", str(tmp_path / "art"), "--quiet"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, show(r)
    assert r.stderr.strip().splitlines() == [line for line in r.stderr.strip().splitlines() if line.startswith("aot: error: ")]
    assert "needs a C++ compiler" in r.stderr, show(r)
    assert not (tmp_path / "art").exists()


def test_cuda_packages_turn_off_the_loop_reordering_torch_2_11_fails_in():
    """Torch 2.11's inductor asserts in its loop reordering on the whole step (seen on the H200
    machine); CUDA packages built with torch before 2.13 turn it off, by a setting inductor has."""
    import torch._inductor.config as inductor_config

    from aot.emit.aoti import cuda_inductor_configs

    assert cuda_inductor_configs("2.11.0+cu130") == {"loop_ordering_after_fusion": False}
    assert cuda_inductor_configs("2.13.0+cpu") == {} and cuda_inductor_configs("2.14.1") == {}
    assert all(hasattr(inductor_config, key) for key in cuda_inductor_configs("2.11.0"))
