"""Compile: each training program, compiled ahead of time by AOTInductor (`aot build --compile aoti`).

The exported step (the same program the portable tier stores as JSON) goes through
`torch._inductor.aoti_compile_and_package`, which lowers it, generates C++ (or CUDA) kernels and a
wrapper, and links them into a shared library packaged as a `.pt2` zip. The runner loads it with no
compiler and no Python graph (runner/execution/compiled.py) when the run's device kind, instruction set and
torch match what it was compiled for, and otherwise runs the portable program.

Choices that keep the two tiers interchangeable:
- Collectives stay functional collectives naming their group ("aot.dp"); AOTInductor resolves the
  name when the package runs, against the groups the runner binds (runner/execution/groups.py). Compiling
  needs a group under each name too (inductor asks its size), so a fake process group stands in.
- Random operators fall back to ATen's (`fallback_random`), so dropout draws the same numbers from
  the same seed as the portable program.
- `add(x, y, alpha=a)` becomes `add(x, mul(y, a))` before inductor's pattern passes (ExplicitAlpha):
  torch 2.13's add+mm -> addmm fusion drops `alpha`, which turned weight decay on a weight whose
  gradient is a bare matmul (`grad.add(param, alpha=wd)`; tensor-parallel layers' gradients come out
  so) into `grad + param`.
- A CPU package runs its collectives on gloo, so it is compiled from the program with each
  collective waited for where it is issued (runner.execution.graph_loader.wait_at_issue, which the runner
  applies to the portable program on gloo): ProcessGroupGloo in torch 2.13 corrupts memory when a
  group has several collectives in flight. CUDA packages keep the overlap schedule (NCCL).
- On x86-64, the library is compiled for the instruction-set level inductor vectorizes for
  (x86-64-v3 for AVX2, x86-64-v4 for AVX-512) instead of `-march=native`, so it runs on every CPU
  of that level and the runner can tell from ATen's CPU capability whether a CPU is one.
- With GCC, the x86-64 library is compiled with `-fno-dse` (GCC_FLAGS), which turns off GCC's RTL
  dead-store elimination. GCC 12.2 at -O3 with -march=x86-64-v4 (generic tuning) miscompiles
  ATen's bf16 32x32 tile transpose (`transpose_mxn<BFloat16>`, which inductor's kernels call for a
  bf16 transposed copy): it turns the tile's stores into a copy from a stack array, expands that
  copy as `rep movsq`, and then deletes 31 of the 32 AVX-512 stores that fill the array as dead, so
  the tile is read from uninitialized stack. A bf16 attention's `k.transpose(-2, -1)` came out as
  garbage and the package's loss was NaN from step 1. `-march=native` hid it on the build machine
  (its tuning copies without `rep movsq`); -fno-tree-loop-distribute-patterns or -O2 avoid it too.
- Inputs are compiled as contiguous tensors (_contiguous_inputs), which is how the runner passes
  them, whatever strides the traced example batch had.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import platform
import subprocess
import tempfile
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch._inductor.custom_graph_pass import CustomGraphPass

from aot.capture.fake_group import fake_process_group
from aot.errors import AotError
from runner.execution.compiled import MODEL_NAME, package_problem, x86_target

COMPILED_DIR = "compiled"
COMPILERS = ("portable", "aoti")


@dataclass
class CompiledPackages:
    files: dict[str, bytes]  # relative path -> package bytes, written and hashed with the artifact
    entry: dict  # the manifest's `compiled` entry (artifacts/FORMAT.md, "Compiled tier")


def target_device(profile: dict) -> torch.device:
    """The build machine's device kind the packages are compiled for: CUDA when the artifact's
    topology is a GPU one and this machine has a GPU (a CUDA package is useless to CPU ranks),
    else the CPU."""
    if profile.get("device_kind") == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def check_compiler(device: torch.device) -> None:
    """Fail before the build's work, in one line, where AOTInductor could not compile at all."""
    from torch._inductor import config, exc
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        found = ", ".join(c for c in config.cpp.cxx if c) or "none"
        raise AotError(
            f"--compile aoti needs a C++ compiler on the build machine and none works here (tried {found}; set CXX, or build without --compile aoti)"
        ) from None
    if device.type == "cuda":
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None:
            raise AotError("--compile aoti for CUDA needs the CUDA toolkit (nvcc) on the build machine; set CUDA_HOME, or build without --compile aoti")


# Extra flags for GCC when it compiles an x86-64 package (see the module docstring).
GCC_FLAGS = ("-fno-dse",)


def _is_gcc(cxx: str) -> bool:
    """Whether the compiler inductor uses is GCC (whatever it is named: c++, g++-12, ...)."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Free Software Foundation" in version and "clang" not in version.lower()


def _cpu_target() -> tuple[dict, dict]:
    """(the manifest's device entry, inductor config) for a CPU package built here."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = str(pick_vec_isa() or "") or "none"
    arch = platform.machine()
    if arch in ("x86_64", "AMD64"):
        features = isa.split() if isa != "none" else []
        march, capability = x86_target(features)
        # Inductor has no setting for extra compiler flags; `cpp.march` goes into the command line
        # as `-march=VALUE`, which inductor splits like a shell (shlex), so flags can follow it.
        flags = " ".join(GCC_FLAGS) if _is_gcc(get_cpp_compiler()) else ""
        return (
            {"kind": "cpu", "arch": arch, "isa": isa, "features": features, "capability": capability, "march": march},
            {"cpp.march": f"{march} {flags}".strip()},
        )
    # Elsewhere inductor's own flags stay; the runner then asks for this very CPU capability.
    return ({"kind": "cpu", "arch": arch, "isa": isa, "capability": torch.backends.cpu.get_cpu_capability(), "march": "default"}, {})


def _cuda_target(device: torch.device) -> tuple[dict, dict]:
    major, minor = torch.cuda.get_device_capability(device)
    # the CUDA runtime the kernels were compiled against (a torch whose version string carries no
    # CUDA tag, a source or container build, still says it here)
    entry = {"kind": "cuda", "capability": f"{major}.{minor}", "name": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    return entry, cuda_inductor_configs(torch.__version__)


def cuda_inductor_configs(torch_version: str) -> dict:
    """Inductor settings for a CUDA package. Torch 2.11 (the H200 machine's) fails the whole step
    of examples/gpt.py and GPT-2 with an AssertionError in the scheduler's loop reordering
    (`reorder_loops_by_dep_pair`, reached from `shared_data_after_reordering_loop` while fusing):
    before 2.13, the version aot is tested against, that reordering is off. It only picks a loop
    order that shares more data between fused kernels; the kernels compute the same values."""
    major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    return {"loop_ordering_after_fusion": False} if (major, minor) < (2, 13) else {}


class ExplicitAlpha(CustomGraphPass):
    """Inductor post-grad pre-pass: `aten.add.Tensor(x, y, alpha=a)` with a != 1 becomes
    `add(x, mul(y, a))`, the same arithmetic inductor's own lowering of `alpha` does.

    Inductor's pattern that fuses `add(mm(m1, m2), y)` (or `add(y, mm(m1, m2))`) into
    `addmm(y, m1, m2)` does not look at `alpha` and drops it (torch 2.13), silently computing
    `mm + y`. SGD's and Adam's `grad.add(param, alpha=weight_decay)` match it wherever a weight's
    gradient is a bare matmul with no transpose or collective after it, as tensor-parallel
    (DTensor) layers' gradients are: the package then applied weight decay 1. With `alpha` made a
    mul, the add has none to drop, and a fusion that still happens is exact."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        add = torch.ops.aten.add.Tensor
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not add or len(node.args) != 2:
                continue
            alpha = node.kwargs.get("alpha", 1)
            if not isinstance(alpha, torch.fx.Node) and alpha == 1:
                continue
            x, y = node.args
            with graph.inserting_before(node):
                scaled = graph.call_function(torch.ops.aten.mul.Tensor, (y, alpha))
            y_val = y.meta.get("val") if isinstance(y, torch.fx.Node) else y
            a_val = alpha.meta.get("val") if isinstance(alpha, torch.fx.Node) else alpha
            if isinstance(y_val, torch.Tensor) and a_val is not None:
                scaled.meta["val"] = torch.ops.aten.mul.Tensor(y_val, a_val)  # y_val is a fake tensor
            scaled.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
            node.args, node.kwargs = (x, scaled), {k: v for k, v in node.kwargs.items() if k != "alpha"}

    def uuid(self) -> str:
        return "aot.emit.aoti.ExplicitAlpha/1"


@contextlib.contextmanager
def _fake_groups(groups: dict[str, int], world_size: int):
    """A fake process group of `world_size` with a group of each size registered under each graph
    name, for as long as the compile runs; nothing is communicated."""
    from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
    from torch.distributed.distributed_c10d import GroupName

    with fake_process_group(0, world_size, "--compile aoti"):
        try:
            for name, size in groups.items():
                group = dist.group.WORLD if size == world_size else dist.new_group(list(range(size)))
                assert group is not None  # rank 0 of the world initialized above is in every group
                _register_process_group(GroupName(name), group)
            yield
        finally:
            for name in groups:
                with contextlib.suppress(Exception):
                    _unregister_process_group(GroupName(name))


def _example_inputs(ep: torch.export.ExportedProgram, device: torch.device) -> tuple:
    """Real zero tensors shaped like the program's inputs, contiguous (see _contiguous_inputs):
    AOTInductor reads their dtypes and devices (it never runs them)."""
    values = [node.meta["val"] for node in ep.graph.nodes if node.op == "placeholder"]
    return tuple(torch.zeros(v.shape, dtype=v.dtype, device=device) for v in values)


@contextlib.contextmanager
def _contiguous_inputs(ep: torch.export.ExportedProgram):
    """`ep`'s inputs described as contiguous while it compiles. Inductor compiles an exported
    program for the strides its placeholders recorded, and the package reads each input with those
    strides whatever the tensor it is given has (it checks none). A placeholder keeps the strides
    of the example batch the build traced (a model's batch() that slices inputs and targets out of
    one longer window gives (T + 1, 1)), while the runner's data is contiguous: such a package read
    past its inputs' rows. Compiled for contiguous inputs, it is given contiguous ones
    (runner.execution.compiled.CompiledProgram copies any other); the program itself is left as it was."""
    from torch._subclasses.fake_tensor import FakeTensor

    saved = {}
    for node in ep.graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor) and not value.is_contiguous():
            assert isinstance(value, FakeTensor)  # an exported program's placeholders hold fake values
            saved[node] = value
            with value.fake_mode:
                node.meta["val"] = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    try:
        yield
    finally:
        for node, value in saved.items():
            node.meta["val"] = value


def _reproducible(data: bytes) -> bytes:
    """The package re-written so that two builds of one program give the same bytes (as the rest
    of an artifact does): the generated sources lose the compile and link commands inductor
    appends (build-machine paths; appended again on a cache hit), the random serialization id
    becomes one derived from the content, and entries get fixed dates. The library itself is
    already reproducible."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        entries = [(info.filename, archive.read(info)) for info in archive.infolist() if not info.is_dir()]
    cleaned = []
    for name, content in entries:
        if name.endswith(".cpp") and b"\n// Compile cmd\n" in content:
            content = content[: content.index(b"\n// Compile cmd\n")].rstrip() + b"\n"
        cleaned.append((name, content))
    digest = hashlib.sha256(b"".join(n.encode() + c for n, c in cleaned if not n.endswith("serialization_id")))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name, content in cleaned:
            if name.endswith(".data/serialization_id"):
                content = str(int(digest.hexdigest(), 16))[:40].encode()
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            archive.writestr(info, content)
    return out.getvalue()


def waited_at_issue(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A copy of `ep` whose collectives are each waited for where issued (see the module docstring);
    `ep` itself, which the portable tier stores, keeps its schedule."""
    import copy

    from runner.execution.graph_loader import most_in_flight, wait_at_issue

    if most_in_flight(ep.graph) <= 1:
        return ep
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's pytree deprecation chatter on copy
        ep = copy.deepcopy(ep)
    wait_at_issue(ep.graph_module)
    return ep


def compile_programs(programs: dict[str, torch.export.ExportedProgram], groups: dict[str, int], world_size: int, device: torch.device) -> CompiledPackages:
    """One AOTInductor package per program (name -> exported program), for `device`.
    `groups`: the graph's process-group names and their sizes."""
    import torch._inductor  # noqa: F401  (torch imports it lazily)

    device_entry, configs = _cuda_target(device) if device.type == "cuda" else _cpu_target()
    configs = {**configs, "fallback_random": True, "post_grad_custom_pre_pass": ExplicitAlpha()}
    files, entries = {}, {}
    with tempfile.TemporaryDirectory(prefix="aot-aoti-") as tmp, _fake_groups(groups, world_size), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own deprecation chatter during lowering
        for name, ep in programs.items():
            if device.type == "cpu":
                ep = waited_at_issue(ep)
            else:
                from torch.export.passes import move_to_device_pass

                ep = move_to_device_pass(ep, device)
            saved = ep._example_inputs
            ep._example_inputs = (_example_inputs(ep, device), {})
            try:
                with _contiguous_inputs(ep):
                    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(Path(tmp) / f"{name}.pt2"), inductor_configs=configs)
            except AotError:
                raise
            except Exception as e:
                message = str(e).strip().splitlines()[-1] if str(e).strip() else ""
                raise AotError(
                    f"AOTInductor could not compile program {name!r} ({type(e).__name__}: {message[:300]}); "
                    f"build without --compile aoti to ship the portable program only"
                ) from e
            finally:
                ep._example_inputs = saved
            data = _reproducible(Path(path).read_bytes())
            problem = package_problem(data)
            if problem:  # pickled entries are refused, never shipped
                raise AotError(f"the AOTInductor package of program {name!r} {problem}")
            relpath = f"{COMPILED_DIR}/{name}.{device.type}.pt2"
            files[relpath] = data
            entries[name] = {"file": relpath, "model_name": MODEL_NAME}
    entry = {"compiler": "aoti", "device": device_entry, "torch_version": torch.__version__, "programs": entries}
    return CompiledPackages(files, entry)
