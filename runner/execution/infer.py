"""Exported inference: the model's forward, exported to ONNX at build time, run by ONNX Runtime.

`load(path)` takes an artifact folder whose manifest has an `inference` entry (written by
`aot build`), or a bare `.onnx` file (written by `aot export --checkpoint`). An artifact's ONNX
file is read through `Artifact.read`, so its sha256 is checked before ONNX Runtime sees a byte.
It holds no weights (format 3): its initializers are external-data references to a file that
does not exist, and the initial weights are made here by replaying the artifact's init program
(runner/execution/init_program.py, as `aot run` makes them) and handed to ONNX Runtime in memory
(`SessionOptions.add_external_initializers`), under the ONNX names the manifest's
`inference.initializers` maps to parameters and buffers. Nothing is written to disk. A bare file
holds its weights, or names its external-data file beside it (`<file>.data`, whose sha256 the
model's metadata records and which is checked before ONNX Runtime reads it).
The session uses the best execution provider that works here (TensorRT, then CUDA, then CPU) with
graph optimizations at the extended level; `provider=` insists on one and fails if it cannot.
A file written by `aot export --precision bf16` (metadata `aot.precision`) is refused on the CPU
provider, which has no bf16 kernels (`_BF16_ON_CPU`); fp16 files run there.

onnxruntime is imported here and only here, when a session is made: training never loads it.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from runner.execution.data import describe, dtype_name
from runner.errors import AotError

PROVIDERS = {"tensorrt": "TensorrtExecutionProvider", "cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}
ORDER = ("tensorrt", "cuda", "cpu")

# torch dtype -> ONNX TensorProto element type (onnx's enum, spelled out: the runner does not need onnx)
ONNX_TYPES = {
    torch.float32: 1,
    torch.uint8: 2,
    torch.int8: 3,
    torch.uint16: 4,
    torch.int16: 5,
    torch.int32: 6,
    torch.int64: 7,
    torch.bool: 9,
    torch.float16: 10,
    torch.float64: 11,
    torch.uint32: 12,
    torch.uint64: 13,
    torch.bfloat16: 16,
    torch.float8_e4m3fn: 17,
    torch.float8_e4m3fnuz: 18,
    torch.float8_e5m2: 19,
    torch.float8_e5m2fnuz: 20,
}
# dtypes numpy lacks, viewed as an integer of the same width to cross into ONNX Runtime
_NUMPY_STAND_IN = {
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e4m3fnuz: torch.uint8,
    torch.float8_e5m2: torch.uint8,
    torch.float8_e5m2fnuz: torch.uint8,
}

# ONNX Runtime's CPU provider (onnxruntime 1.31, tried op by op) has no bfloat16 kernels for Add, Mul,
# MatMul, Softmax, Gelu and most others (LayerNormalization and Transpose it has), and unlike fp16,
# whose missing kernels it wraps in casts to fp32, it does not work around them: a session fails
# on the first such node. So a file that says it computes in bf16 is refused on the CPU up front,
# in words that say what to do instead.
_BF16_ON_CPU = (
    "computes in bf16 (aot export --precision bf16), and ONNX Runtime's CPU provider has no bf16 "
    "kernels (MatMul, Add, Softmax, Gelu); run it with a GPU provider (cuda, tensorrt), or export "
    "with --precision fp16 or fp32 to run on CPU"
)

# ONNX Runtime's element type names -> torch dtype names (runner.execution.data.dtype_name)
_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(double)": "float64",
    "tensor(float16)": "float16",
    "tensor(bfloat16)": "bfloat16",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int16)": "int16",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}


def _import_ort():
    try:
        import onnxruntime
    except ImportError as e:
        raise AotError(f"exported inference needs ONNX Runtime, which cannot be imported here ({e}); install onnxruntime-gpu (or onnxruntime)") from None
    return onnxruntime


def _cuda_devices() -> int:
    """CUDA devices the driver sees, asked of the driver itself (a CPU build of torch cannot tell)."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            cuda = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    return 0


def _unusable(ort, key: str) -> str | None:
    """Why provider `key` cannot run here, or None if it may."""
    name = PROVIDERS[key]
    if name not in ort.get_available_providers():
        return f"not in this onnxruntime build ({', '.join(ort.get_available_providers())} are)"
    if key != "cpu" and _cuda_devices() == 0:
        return "no CUDA device is visible"
    return None


def ort_values(ort, tensors: Mapping[str, torch.Tensor]) -> tuple[list[str], list, list]:
    """(names, OrtValues, what must outlive them): CPU tensors handed to ONNX Runtime without a copy."""
    names, values, keep = [], [], []
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.dtype not in ONNX_TYPES:
            raise AotError(f"weight {name!r} is {dtype_name(t.dtype)}, which ONNX has no type for")
        array = t.view(_NUMPY_STAND_IN.get(t.dtype, t.dtype)).numpy()
        names.append(name)
        values.append(ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, ONNX_TYPES[t.dtype]))
        keep += [t, array]
    return names, values, keep


def _session(ort, model: bytes | str, key: str, threads: int | None, initializers: tuple[list[str], list, list] | None):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.log_severity_level = 3  # errors only; a provider that fails is reported by us, in one line
    if threads:
        options.intra_op_num_threads = threads
    if initializers is not None:  # replace the model's external-data initializers, before any optimization
        options.add_external_initializers(initializers[0], initializers[1])
    # TensorRT hands the nodes it cannot compile to CUDA, CUDA to the CPU, as ONNX Runtime documents.
    providers = [PROVIDERS[k] for k in {"tensorrt": ORDER, "cuda": ("cuda", "cpu"), "cpu": ("cpu",)}[key]]
    # enable_fallback=0: no silent retry on other providers (which prints to stdout); we decide.
    session = ort.InferenceSession(model, options, providers=providers, enable_fallback=0)
    if session.get_providers()[0] != PROVIDERS[key]:
        raise RuntimeError(f"ONNX Runtime fell back to {session.get_providers()[0]}")
    session.aot_initializers = initializers  # the OrtValues (and the memory under them) live as long as the session
    return session


def create_session(
    model: bytes | str,
    provider: str | None = None,
    *,
    warn: Callable[[str], None] = lambda msg: None,
    threads: int | None = None,
    where: str = "the model",
    initializers: Mapping[str, torch.Tensor] | None = None,
    cpu_refusal: str | None = None,
):
    """(ONNX Runtime session, provider key) for ONNX bytes (or a file path, whose external data
    ONNX Runtime reads beside it): `provider` if given (or an error), else the first of TensorRT,
    CUDA, CPU that works, with a one-line notice through `warn` when a faster one was passed over.
    `initializers`: ONNX initializer name -> tensor, the values of the model's external-data
    initializers, given to ONNX Runtime in memory. `cpu_refusal`: why the CPU provider cannot run
    this model (the error, where it would be used)."""
    ort = _import_ort()
    values = ort_values(ort, initializers) if initializers is not None else None
    if provider is not None:
        if provider not in PROVIDERS:
            raise AotError(f"unknown provider {provider!r}; choose one of {', '.join(ORDER)}")
        if provider == "cpu" and cpu_refusal:
            raise AotError(f"{where}: {cpu_refusal}")
        reason = _unusable(ort, provider)
        if reason is None:
            try:
                return _session(ort, model, provider, threads, values), provider
            except Exception as e:
                if provider == "cpu":
                    raise AotError(f"{where}: ONNX Runtime cannot load it: {_first_line(e)}") from None
                reason = f"it failed to start ({_first_line(e)})"
        raise AotError(f"provider {provider} ({PROVIDERS[provider]}) is not usable here: {reason}; leave --provider unset to use the best available one")
    passed_over: list[str] = []
    for key in ORDER:
        if key == "cpu" and cpu_refusal:
            raise AotError(f"{where}: {cpu_refusal}" + (f" (passed over: {'; '.join(passed_over)})" if passed_over else ""))
        reason = _unusable(ort, key)
        if reason is None:
            try:
                session = _session(ort, model, key, threads, values)
            except Exception as e:
                if key == "cpu":
                    raise AotError(f"{where}: ONNX Runtime cannot load it: {_first_line(e)}") from None
                reason = f"failed to start: {_first_line(e)}"
            else:
                if passed_over:
                    warn(f"notice: running on {PROVIDERS[key]}; " + "; ".join(passed_over))
                return session, key
        passed_over.append(f"{PROVIDERS[key]}: {reason}")
    raise AssertionError("unreachable: the CPU provider is always tried")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _spec_of_session(session, batch_dim: str | None) -> tuple[list[dict], list[dict], str | None]:
    """Input/output spec read from the ONNX graph itself (for a bare .onnx file)."""

    def entry(arg):
        shape = [d if isinstance(d, int) else str(d) for d in arg.shape]
        return {"name": arg.name, "shape": shape, "dtype": _ORT_TYPES.get(arg.type, arg.type)}

    inputs = [entry(a) for a in session.get_inputs()]
    outputs = [entry(a) for a in session.get_outputs()]
    if batch_dim is None and inputs and inputs[0]["shape"] and isinstance(inputs[0]["shape"][0], str):
        batch_dim = inputs[0]["shape"][0]
    return inputs, outputs, batch_dim


class InferenceSession:
    """An ONNX Runtime session over an exported forward.

    `run(inputs)` takes a mapping of input name -> tensor (`inputs`, or `inputs.0`, `inputs.1`, ...
    as in --data files; other names such as `targets` are ignored), or a tensor / sequence of
    tensors in order, and returns a dict of output name -> CPU torch tensor. Input names, dtypes and
    every dimension but the batch dimension must match the export. `trusted_keys` (public keys, as
    runner.format.signing.read_public_key returns them) refuses artifacts not signed by one of them.
    `weights` says where the weights came from (the init program, the file, its data file).
    """

    def __init__(
        self,
        path: str | Path,
        provider: str | None = None,
        *,
        warn: Callable[[str], None] = lambda msg: None,
        threads: int | None = None,
        trusted_keys: list[str] | None = None,
    ):
        path = Path(path)
        cpu_refusal = None
        model: bytes | str  # ONNX bytes, or the file's path when ONNX Runtime must read its data file beside it
        if path.is_dir():
            from runner.format.artifact import Artifact

            # the signature is checked before anything is parsed; ONNX Runtime runs the export, so
            # the torch that built it does not matter
            artifact = Artifact(path, trusted_keys, any_torch=True)
            spec = artifact.manifest.get("inference")
            if spec is None:
                raise AotError(
                    f"{path}: the artifact has no inference export (it was built with --no-onnx, "
                    f"or the model could not be exported; `aot build --onnx` says why)"
                )
            model = artifact.read(spec["file"])  # sha256 checked before ONNX Runtime parses it
            self.where = f"{path}/{spec['file']}"
            initializers, self.weights = None, "inside the ONNX file"
            if spec.get("initializers") is not None:  # format 3: the weights are made here
                initializers, self.weights = initial_weights(artifact, spec["initializers"], self.where)
        elif path.is_file():
            if trusted_keys:  # only an artifact's manifest is signed: a bare file cannot prove its builder
                raise AotError(f"{path}: a bare .onnx file carries no signature; --trusted-key needs an artifact folder signed with `aot build --sign`")
            model, spec, initializers = path.read_bytes(), {}, None
            self.where = str(path)
            self.weights = "inside the ONNX file"
            data_file, meta = _bare_file(path, model)
            if meta.get("aot.precision") == "bf16":
                cpu_refusal = _BF16_ON_CPU
            if data_file is not None:
                model, self.weights = str(path), str(data_file)  # ONNX Runtime reads the data file beside it
        else:
            raise AotError(f"{path}: no such artifact folder or ONNX file")
        self.spec = spec
        self.session, self.provider = create_session(
            model, provider, warn=warn, threads=threads, where=self.where, initializers=initializers, cpu_refusal=cpu_refusal
        )
        inputs, outputs, batch_dim = _spec_of_session(self.session, spec.get("batch_dim"))
        if spec:
            declared = [i.get("name") for i in spec["inputs"]], [o.get("name") for o in spec["outputs"]]
            if declared != ([i["name"] for i in inputs], [o["name"] for o in outputs]):
                raise AotError(f"{self.where}: the ONNX graph's inputs and outputs do not match the manifest's inference entry")
            inputs, outputs = spec["inputs"], spec["outputs"]
        self.inputs, self.outputs, self.batch_dim = inputs, outputs, batch_dim

    @property
    def input_names(self) -> list[str]:
        return [i["name"] for i in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [o["name"] for o in self.outputs]

    def feeds(self, inputs, where: str = "inputs") -> dict[str, np.ndarray]:
        """The checked numpy feeds of `run` (see the class docstring); AotError on any mismatch."""
        names = self.input_names
        if isinstance(inputs, (torch.Tensor, np.ndarray)):
            inputs = [inputs]
        if not isinstance(inputs, Mapping):
            if not isinstance(inputs, Sequence) or len(inputs) != len(names):
                raise AotError(
                    f"{where}: the exported model takes {len(names)} input(s) ({', '.join(names)}), "
                    f"got {len(inputs) if isinstance(inputs, Sequence) else type(inputs).__name__}"
                )
            inputs = dict(zip(names, inputs))
        missing = [n for n in names if n not in inputs]
        if missing:
            raise AotError(
                f"{where}: no tensor named {missing[0]!r}; the exported model takes {', '.join(names)} (given: {', '.join(sorted(inputs)) or 'nothing'})"
            )
        feeds, batch = {}, None
        for want in self.inputs:
            name, value = want["name"], inputs[want["name"]]
            if isinstance(value, np.ndarray):
                value = torch.from_numpy(value)
            if not isinstance(value, torch.Tensor):
                raise AotError(f"{where}: {name} is a {type(value).__name__}, expected a tensor")
            shape, dtype = list(value.shape), dtype_name(value.dtype)
            wanted = want["shape"]  # symbolic dimensions (the batch) are names, the others sizes
            expected = describe(["N" if d == self.batch_dim else d for d in wanted], want["dtype"])
            fixed_ok = len(shape) == len(wanted) and all(isinstance(d, str) or d == s for d, s in zip(wanted, shape))
            if dtype != want["dtype"] or not fixed_ok:
                raise AotError(
                    f"{where}: {name} is {describe(shape, dtype)}, the exported model takes {expected}"
                    + (" (N: any batch size)" if self.batch_dim in wanted else "")
                )
            if shape and isinstance(wanted[0], str):
                if shape[0] == 0:
                    raise AotError(f"{where}: {name} holds no samples")
                if batch is not None and shape[0] != batch:
                    raise AotError(f"{where}: {name} has {shape[0]} samples but {self.input_names[0]} has {batch}")
                batch = shape[0]
            if value.dtype == torch.bfloat16:
                raise AotError(f"{where}: {name} is bfloat16, which ONNX Runtime's Python API cannot take from numpy")
            feeds[name] = value.detach().cpu().contiguous().numpy()
        return feeds

    def run(self, inputs, where: str = "inputs") -> dict[str, torch.Tensor]:
        return self.run_feeds(self.feeds(inputs, where))

    def run_feeds(self, feeds: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        results = self.session.run(self.output_names, feeds)
        return {name: torch.from_numpy(np.ascontiguousarray(r)) for name, r in zip(self.output_names, results)}

    def benchmark(self, inputs, *, warmup: int = 3, iters: int = 10, where: str = "inputs") -> tuple[dict, dict]:
        """(outputs of the last run, timing): `warmup` untimed runs, then `iters` timed ones."""
        feeds = self.feeds(inputs, where)
        first = next(iter(feeds.values()))
        batch = first.shape[0] if first.ndim else 1
        for _ in range(warmup):
            self.session.run(self.output_names, feeds)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            outputs = self.session.run(self.output_names, feeds)
            times.append(time.perf_counter() - start)
        p50, p90 = (float(np.percentile(times, q)) for q in (50, 90))
        timing = {
            "provider": PROVIDERS[self.provider],
            "batch_size": batch,
            "warmup": warmup,
            "iters": iters,
            "latency_ms_p50": p50 * 1e3,
            "latency_ms_p90": p90 * 1e3,
            "latency_ms_mean": float(np.mean(times)) * 1e3,
            "samples_per_s": batch * iters / sum(times),
        }
        results = {n: torch.from_numpy(np.ascontiguousarray(r)) for n, r in zip(self.output_names, outputs)}
        return results, timing


def initial_weights(artifact, mapping: Mapping[str, str], where: str) -> tuple[dict[str, torch.Tensor], str]:
    """(ONNX initializer name -> initial tensor, a description of the source): the artifact's init
    program replayed after its seed, whole tensors (no rank's piece), just those the graph reads."""
    from runner.execution.init_program import load_init_graph, replay
    from runner.format.stacked import stored_names, with_rows

    manifest = artifact.manifest
    init = manifest.get("init")
    if init is None:
        raise AotError(f"{where}: holds no weights, and the artifact has no init program to make them")
    stacked = manifest["state"].get("stacked", {})  # a ModuleList's experts: the graph reads each expert's row
    needed = stored_names(mapping.values(), stacked)
    unknown = sorted(needed - set(init["outputs"]))
    if unknown:
        raise AotError(f"{where}: reads {unknown[0]!r}, which the artifact's init program does not make")
    graph = load_init_graph(artifact.read(init["file"]), artifact.read(init["constants"]) if init.get("constants") else None)
    seed = int(manifest["build"].get("seed", 0))
    weights = with_rows(replay(graph, init["outputs"], seed, only=needed), stacked)
    return {name: weights[state].contiguous() for name, state in mapping.items()}, f"the init program (seed {seed})"


def _bare_file(path: Path, model: bytes) -> tuple[Path | None, dict[str, str]]:
    """(the external-data file a bare .onnx file's weights are in (checked against the sha256 its
    metadata records), or None when they are inside it; the model's metadata)."""
    import onnx

    try:
        proto = onnx.load_from_string(model)  # external data is not read
    except Exception:
        return None, {}  # not ONNX: ONNX Runtime says so, in one line
    locations = {e.value for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL for e in t.external_data if e.key == "location"}
    meta = {p.key: p.value for p in proto.metadata_props}
    del proto
    if not locations:
        return None, meta
    if len(locations) > 1 or any(Path(loc).name != loc for loc in locations):
        raise AotError(f"{path}: its weights are in {', '.join(sorted(locations))}; only one file beside the model is read")
    data_file = path.parent / locations.pop()
    if not data_file.is_file():
        hint = (
            (" (an artifact's inference/model.onnx holds no weights: run the artifact folder, or write a standalone file with `aot export`)")
            if data_file.name == "model.onnx.data"
            else ""
        )
        raise AotError(f"{path}: its weights are ONNX external data in {data_file.name}, which is not beside it{hint}")
    if "aot.weights_sha256" in meta:
        from runner.format.integrity import sha256_file

        if sha256_file(data_file) != meta["aot.weights_sha256"]:
            raise AotError(f"{data_file}: sha256 differs from the one {path.name} records; it holds other weights (written by another `aot export`?)")
    return data_file, meta


def load(path: str | Path, provider: str | None = None, **kwargs) -> InferenceSession:
    """An inference session over an artifact folder's ONNX export or an .onnx file; see InferenceSession."""
    return InferenceSession(path, provider, **kwargs)
