"""The compiled tier: a training program compiled ahead of time by AOTInductor, and when to use it.

`aot build --compile aoti` stores, beside the portable program (export-schema JSON that any
machine with the same torch release can run), a native package per program: an AOTInductor `.pt2`
zip holding a shared library and the C++ it was compiled from. It runs only where it was compiled
for: the same device kind (and CPU instruction set, or CUDA compute capability) and the same torch
build. `choose_tier` decides per run; `load_compiled` loads the package from hash-verified bytes.

The package is a zip, which the artifact's generic reader refuses (runner.format.integrity.content_problem:
torch's zips hold pickles). It is read here instead, after its sha256 matched, and every entry is
checked first: named like an AOTInductor package entry, inside one top folder (the loader extracts
it to disk), and neither a pickle nor a nested zip. Nothing in it is unpickled; the shared library
is native code, as trustworthy as the manifest that hashes it (sign artifacts: `--sign`).
"""

from __future__ import annotations

import io
import json
import os
import platform
import shutil
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

import torch

from runner.errors import AotError
from runner.format.integrity import read_verified
from runner.hardware.node_refusal import NodeRefusal

TIERS = ("auto", "compiled", "portable")
MODEL_NAME = "model"  # the name aoti_compile_and_package gives the one model of a package

# What an AOTInductor package may hold: its format markers, and per model the wrapper and kernel
# sources, their metadata, the shared library, and device kernel binaries (CUDA builds).
_MARKERS = {"archive_format", "archive_version", "byteorder", "version", "serialization_id"}
_SUFFIXES = (".so", ".cpp", ".h", ".json", ".o", ".cubin", ".fatbin", ".ptx")
# ATen's CPU capability levels, lowest first (torch.backends.cpu.get_cpu_capability()).
_X86_LEVELS = ("DEFAULT", "AVX2", "AVX512")
# The x86 CPU features inductor may vectorize for (its VecISA names them, as in `str(pick_vec_isa())`:
# "avx2", "avx512 avx512_vnni", "avx512 avx512_vnni amx_tile"), the most capable first ->
# (the -march the package is compiled with, the ATen capability a CPU needs to run it). -march is
# pinned to the level instead of `native`, so the package runs on every CPU of that level, not only
# on ones like the build machine's; features beyond the level (VNNI, AMX) are checked one by one.
_X86_LEVEL_OF = (("avx512", ("x86-64-v4", "AVX512")), ("avx2", ("x86-64-v3", "AVX2")))


def x86_target(features: list[str]) -> tuple[str, str]:
    """(-march, least ATen CPU capability) for kernels that use `features`."""
    for feature, target in _X86_LEVEL_OF:
        if feature in features:
            return target
    return "x86-64", "DEFAULT"


def x86_features() -> list[str]:
    """The vector features of this CPU that inductor can generate kernels for (as its VecISA names them)."""
    checks = (
        ("avx2", torch.cpu._is_avx2_supported),
        ("avx512", torch.cpu._is_avx512_supported),
        ("avx512_vnni", lambda: torch.cpu._is_avx512_supported() and torch.cpu._is_vnni_supported()),
        ("amx_tile", torch.cpu._is_amx_tile_supported),
    )
    return [name for name, supported in checks if supported()]


def live_device(device: torch.device) -> dict:
    """What a package must match to run on `device`: its kind and instruction set or capability."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {"kind": "cuda", "capability": f"{major}.{minor}", "cuda": torch.version.cuda}
    live: dict[str, str | list[str]] = {"kind": device.type, "arch": platform.machine(), "capability": torch.backends.cpu.get_cpu_capability()}
    if live["arch"] in ("x86_64", "AMD64"):
        live["features"] = x86_features()
    return live


def mismatch(package: dict, live: dict, package_torch: str, live_torch: str | None = None) -> str | None:
    """Why a package compiled for `package` (the manifest's `compiled.device`) and `package_torch`
    cannot run on `live` (see live_device) with this torch; None when it can."""
    live_torch = live_torch or torch.__version__
    if package.get("kind") != live.get("kind"):
        return f"compiled package is for {package.get('kind')}, this run is {live.get('kind')}"
    if package_torch != live_torch:  # the library links against this exact torch build
        return f"compiled package was built with torch {package_torch}, this run has torch {live_torch}"
    if live["kind"] == "cuda":
        if package.get("capability") != live.get("capability"):
            return f"compiled package is for CUDA compute capability {package.get('capability')}, this GPU has {live.get('capability')}"
        if package.get("cuda") and package["cuda"] != live.get("cuda"):  # where the package says it (optional: FORMAT.md)
            return f"compiled package was built against CUDA runtime {package['cuda']}, this run's torch has CUDA {live.get('cuda')}"
        return None
    if package.get("arch") != live.get("arch"):
        return f"compiled package is for {package.get('arch')} CPUs, this one is {live.get('arch')}"
    need, have = package.get("capability"), live.get("capability")
    if need in _X86_LEVELS and have in _X86_LEVELS:
        ok = _X86_LEVELS.index(have) >= _X86_LEVELS.index(need)
    else:  # other architectures: only the capability the package was built on is known to work
        ok = need == have
    if not ok:
        return f"compiled package needs {need} CPUs ({package.get('isa')} kernels), this run's CPU capability is {have}"
    lacking = [f for f in package.get("features") or () if "features" in live and f not in live["features"]]
    if lacking:
        return f"compiled package uses CPU features {', '.join(lacking)} ({package.get('isa')} kernels), which this CPU lacks"
    return None


def choose_tier(compiled: dict | None, program: str, live: dict, requested: str = "auto", where: str = "artifact") -> tuple[str, str | None]:
    """("compiled" or "portable", a one-line notice or None) for a run on `live`.

    `requested`: "auto" takes the compiled package when it matches and otherwise the portable
    program with a notice; "compiled" insists (NodeRefusal otherwise: every rank of the node
    refuses alike, and each prints its line before any exits); "portable" never compiles."""
    if requested not in TIERS:
        raise AotError(f"unknown tier {requested!r}; choose one of {', '.join(TIERS)}")
    if requested == "portable":
        return "portable", None
    if compiled is not None:
        _check_entry(compiled, where)
    if not compiled or program not in compiled["programs"]:
        if requested == "compiled":
            raise NodeRefusal(
                f"{where}: has no compiled package for program {program!r} (built without "
                f"`--compile aoti`); rebuild with it, or run with --tier auto or portable"
            )
        return "portable", None  # nothing to fall back from: no notice
    why = mismatch(compiled["device"], live, compiled["torch_version"])
    if why is None:
        return "compiled", None
    if requested == "compiled":
        raise NodeRefusal(
            f"{where}: {why}; rebuild with `aot build --compile aoti` on a machine like this one, or run with --tier auto to use the portable program"
        )
    return "portable", f"notice: {why}; using the portable program"


def _check_entry(compiled, where: str) -> None:
    """The manifest's `compiled` entry has the fields this module reads (one line if not)."""
    ok = (
        isinstance(compiled, dict)
        and isinstance(compiled.get("device"), dict)
        and isinstance(compiled["device"].get("kind"), str)
        and isinstance(compiled.get("torch_version"), str)
        and isinstance(compiled.get("programs"), dict)
        and all(isinstance(p, dict) and isinstance(p.get("file"), str) for p in compiled["programs"].values())
    )
    if not ok:
        raise AotError(f"{where}/manifest.json: the compiled entry needs device.kind, torch_version and programs (name -> file)")


def package_problem(data: bytes) -> str | None:
    """Why these package bytes must not be loaded (None if fine), judged from the bytes alone."""
    if data[:4] != b"PK\x03\x04":
        return "is not an AOTInductor package (not a zip archive)"
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError) as e:
        return f"is not a readable zip archive ({e})"
    tops, names = set(), set()
    for info in entries:
        name = info.filename
        if name in names:  # which of two same-named entries a loader takes is the loader's choice
            return f"holds two entries named {name!r}; refusing to load it"
        names.add(name)
        parts = PurePosixPath(name).parts
        # The loader extracts the package to disk: no entry may point outside its folder.
        if name.startswith("/") or "\\" in name or ".." in parts or len(parts) < 2:
            return f"holds an entry with an unsafe path ({name!r}); refusing to load it"
        tops.add(parts[0])
        if info.is_dir():
            continue
        if info.compress_type != zipfile.ZIP_STORED:  # aot stores packages uncompressed: no zip bombs
            return f"holds a compressed entry ({name!r}); refusing to load it"
        if parts[-1] not in _MARKERS and not parts[-1].endswith(_SUFFIXES):
            return f"holds an entry {name!r} that is not part of an AOTInductor package; refusing to load it"
        head = archive.open(info).read(4)
        if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
            return f"holds a pickle ({name!r}); refusing to load it"
        if head == b"PK\x03\x04":
            return f"holds a nested zip archive ({name!r}); refusing to load it"
    if len(tops) != 1:
        return "holds entries outside one top folder; refusing to load it"
    top = tops.pop()
    if f"{top}/archive_format" not in archive.namelist() or archive.read(f"{top}/archive_format") != b"pt2":
        return "is not an AOTInductor package (no pt2 archive_format entry)"
    if not any(i.filename.startswith(f"{top}/data/aotinductor/{MODEL_NAME}/") and i.filename.endswith(".so") for i in entries):
        return f"is not an AOTInductor package (no compiled library for model {MODEL_NAME!r})"
    return None


class CompiledProgram:
    """A loaded package, called like the portable program: `(*inputs) -> (loss, global_loss)`,
    updating parameters, buffers and optimizer state in place.

    The package reads each input with the strides it was compiled for, contiguous ones
    (aot.emit.aoti._contiguous_inputs), whatever strides the tensor it is given has: a non-contiguous
    input (a batch sliced from a longer window, say) goes in as a contiguous copy. On CUDA, the
    runner keeps 0-dim state (step counters, learning rates) on the CPU, as torch.optim does; the
    package was compiled with every input on the GPU, so those travel to the GPU. Either way a
    staged copy is written back after the call (a few scalars, or a batch; the loss read that
    follows synchronizes anyway)."""

    def __init__(self, loader, device: torch.device):
        self._loader, self.device = loader, device

    def __call__(self, *args):
        staged = {i: a.to(self.device, memory_format=torch.contiguous_format) for i, a in enumerate(args) if a.device != self.device or not a.is_contiguous()}
        if not staged:
            return tuple(self._loader.run(list(args)))
        outputs = self._loader.run([staged.get(i, a) for i, a in enumerate(args)])
        for i, a in staged.items():
            args[i].copy_(a)
        return tuple(outputs)


def _input_count(loader) -> int | None:
    """Positional inputs of the package's call spec (a pytree of ((inputs...), {})), if readable."""
    try:
        spec = json.loads(loader.get_call_spec()[0])
        return len(spec[1]["children_spec"][0]["children_spec"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def load_compiled(artifact, program: str, device: torch.device, inputs: int) -> CompiledProgram:
    """Verify, check and load the package of `program` (of a runner.format.artifact.Artifact) for
    `device`. The loader reads a path, so the verified bytes go to a private temporary copy (never
    the artifact's file, which could change after it was hashed) that is removed once loaded."""
    root, manifest = artifact.root, artifact.manifest
    relpath = manifest["compiled"]["programs"][program]["file"]
    if relpath not in manifest["files"]:
        raise AotError(f"{root}/manifest.json: names {relpath} but does not list its sha256")
    data = read_verified(root, relpath, manifest["files"][relpath])
    problem = package_problem(data)
    if problem:
        raise AotError(f"{root / relpath}: {problem}")
    # The package reads its inputs as compiled, checking nothing unless asked: with the check on,
    # an input of the wrong dtype, shape, stride or device is an error naming it, not a crash. A
    # few hundred comparisons a step; read by the package once, at its first call.
    os.environ.setdefault("AOTI_RUNTIME_CHECK_INPUTS", "1")
    folder = Path(tempfile.mkdtemp(prefix="aot-compiled-"))  # mode 0700: this user's alone
    try:
        path = folder / f"{program}.pt2"
        path.write_bytes(data)
        index = device.index if device.type == "cuda" and device.index is not None else (0 if device.type == "cuda" else -1)
        try:
            loader = torch._C._aoti.AOTIModelPackageLoader(str(path), MODEL_NAME, False, 1, index)
        except RuntimeError as e:
            raise AotError(
                f"{root / relpath}: the compiled package cannot be loaded here ({str(e).strip().splitlines()[0][:300]}); run with --tier portable"
            ) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    count = _input_count(loader)
    if count is not None and count != inputs:
        raise AotError(f"{root / relpath}: the compiled package takes {count} inputs, the program {inputs}; the artifact is inconsistent: rebuild it")
    return CompiledProgram(loader, device)
