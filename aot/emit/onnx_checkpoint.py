"""`aot export`: a checkpoint's trained weights attached to the exported forward, as one ONNX file.

The export is aot/emit/onnx_export.py's, from the model on fake tensors; `save_onnx` writes it
with weights: inside the file up to `EMBED_LIMIT_BYTES` (protobuf's 2 GiB limit, less room for
the graph), else as ONNX external data in `<file>.data` beside it, each tensor at a 64-byte
aligned offset, whose sha256 the model's metadata records. Buffers a checkpoint does not hold
(masks) come from the artifact's init program.

`precision` (`aot export --precision`) picks the dtype the export computes in. fp32 is the
trained (fp32 master) weights as they are, the export unchanged. bf16 and fp16 mean eager
`model.to(dtype)`: floating parameters and buffers rounded to the dtype (stored in it: half the
bytes) and the forward traced in it. The file's interface stays the fp32 export's: floating
inputs are taken in float32 and cast to the dtype first, floating outputs cast back to float32
last (values the dtype can hold), so data files and clients written for the fp32 export feed it
unchanged and no caller needs a bfloat16 array type, which numpy lacks. The model's metadata
records `aot.precision`. The check compares with eager PyTorch in the dtype on the same rounded
weights (tolerance: see NOISE_FACTOR): fp16 with ONNX Runtime (CPU), which runs fp16 graphs by
wrapping the fp16 kernels it lacks in casts to fp32; bf16 with onnx's reference evaluator (numpy,
up to REFERENCE_BUDGET_BYTES of weights), since ONNX Runtime's CPU provider has no bf16 kernels
for MatMul, Add, Softmax or Gelu at all (runner/execution/infer.py refuses such a file on the CPU provider).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, Mapping

import torch

from aot.capture.precision import DTYPES
from aot.emit.onnx_export import (
    CHECK_BUDGET_BYTES,
    OnnxUnsupported,
    _aligned,
    _budget_reason,
    _fake_model,
    _numeric_check,
    _unchecked,
    export_inputs,
    export_onnx,
)
from runner.execution.data import dtype_name
from aot.errors import AotError

EMBED_LIMIT_BYTES = 2**31 - 2**26  # protobuf's 2 GiB limit, less room for the graph itself
# A reduced-precision export is held to NOISE_FACTOR times the dtype's own noise on the batch:
# how far eager PyTorch in the dtype is from eager fp32 (at least FLOOR_EPS of the dtype's epsilon
# times the outputs' scale). Two valid low-precision runs of one model differ by about as much as
# either differs from fp32, and that grows with depth and values, which a fixed bound would not
# follow. Measured (examples/gpt.py, llama.py, mlp.py; 30 and 150 training steps; batches 1-16):
# |export - eager| / noise at most 1.5 (fp16, ONNX Runtime CPU) and 3.3 (bf16, reference evaluator;
# 1.9 where the floor does not apply), / (eps x scale) at most 2.1 (fp16) and 5.0 (bf16).
NOISE_FACTOR = 4.0
FLOOR_EPS = 4.0
# onnx's reference evaluator runs bf16 in numpy, op by op, about 20x slower than ONNX Runtime
# (48 MiB of gpt-like weights: 0.9 s for 4 x 64 tokens): a smaller budget than CHECK_BUDGET_BYTES
REFERENCE_BUDGET_BYTES = 2**27


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (ONNX raw data: little-endian, row-major)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def save_onnx(
    data: bytes, weights: Mapping[str, torch.Tensor], output: Path, *, metadata: dict[str, str] | None = None, verify: Callable[[Path], None] | None = None
) -> dict:
    """Write the weight-less ONNX model `data` to `output` with `weights` (ONNX initializer name ->
    tensor) attached: inside the file when they fit EMBED_LIMIT_BYTES, else as ONNX external data
    in `<output>.data` (each tensor at a 64-byte aligned offset), whose sha256 the model's metadata
    records (`aot.weights_file`, `aot.weights_sha256`). `verify(path)` may inspect the written
    model (under a temporary name, its data file in place) before it takes its name; if it raises,
    nothing is left. Returns sizes and sha256s."""
    import onnx

    from runner.execution.infer import ONNX_TYPES

    output = Path(output)
    proto = onnx.load_from_string(data)
    external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    names = [t.name for t in external]
    if sorted(names) != sorted(weights):
        extra, missing = sorted(set(weights) - set(names)), sorted(set(names) - set(weights))
        raise AotError(
            "the ONNX graph's weights and the tensors given differ: "
            + (f"no tensor for {missing[0]!r}" if missing else f"{extra[0]!r} is no weight of the graph")
        )
    tensors = {}
    for t in external:
        tensor = weights[t.name]
        if list(tensor.shape) != list(t.dims) or ONNX_TYPES.get(tensor.dtype) != t.data_type:
            raise AotError(
                f"{t.name}: the graph takes {list(t.dims)} {onnx.helper.tensor_dtype_to_string(t.data_type)}, "
                f"got {list(tensor.shape)} {dtype_name(tensor.dtype)}"
            )
        tensors[t.name] = _raw(tensor)
    total = sum(r.numel() for r in tensors.values())
    data_path = output.with_name(output.name + ".data") if total > EMBED_LIMIT_BYTES else None
    digest = None
    replaced = {"aot.weights_file", "aot.weights_sha256", *(metadata or {})}
    for i in reversed(range(len(proto.metadata_props))):
        if proto.metadata_props[i].key in replaced:
            del proto.metadata_props[i]
    for key, value in (metadata or {}).items():
        proto.metadata_props.add(key=key, value=value)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    written = []
    try:
        if data_path is None:
            for t in external:
                del t.external_data[:]
                t.data_location = onnx.TensorProto.DEFAULT
                t.raw_data = tensors[t.name].numpy().tobytes()
        else:
            sha = hashlib.sha256()
            data_tmp = data_path.with_name(data_path.name + ".tmp")
            written.append(data_tmp)
            offset = 0
            with open(data_tmp, "wb") as f:
                for t in external:
                    raw = tensors[t.name]
                    pad = b"\0" * (_aligned(offset) - offset)
                    f.write(pad)
                    sha.update(pad)
                    offset += len(pad)
                    del t.external_data[:]
                    for key, value in (("location", data_path.name), ("offset", str(offset)), ("length", str(raw.numel()))):
                        t.external_data.add(key=key, value=value)
                    view = raw.numpy().data
                    f.write(view)
                    sha.update(view)
                    offset += raw.numel()
            digest = sha.hexdigest()
            os.replace(data_tmp, data_path)
            written[-1] = data_path
            proto.metadata_props.add(key="aot.weights_file", value=data_path.name)
            proto.metadata_props.add(key="aot.weights_sha256", value=digest)
        model_bytes = proto.SerializeToString()
        del proto
        written.append(tmp)
        tmp.write_bytes(model_bytes)
        if verify is not None:
            verify(tmp)
        os.replace(tmp, output)
        written.clear()
    finally:
        for path in written:
            path.unlink(missing_ok=True)
    return {
        "bytes": len(model_bytes),
        "sha256": hashlib.sha256(model_bytes).hexdigest(),
        "weights_file": None if data_path is None else str(data_path),
        "weights_bytes": total,
        "weights_sha256": digest,
    }


def in_precision(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` (changed in place) computing in `dtype` behind a float32 interface: its floating
    parameters and buffers cast (a tied tensor stays one tensor, under all its names), hooks that
    cast floating inputs to `dtype` and floating outputs to float32. Not `model.to(dtype)`: that
    cannot swap the fake tensors `aot export` traces with. torch.export traces the hooks."""

    def cast(t, to):
        return t.to(to) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None or not t.is_floating_point():
                    continue
                if id(t) not in done:
                    done[id(t)] = torch.nn.Parameter(t.detach().to(dtype), requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else t.to(dtype)
                # a Parameter's copy is a Parameter (done keeps the kind), which _parameters needs
                store[name] = done[id(t)]  # type: ignore[assignment]
    tree_map = torch.utils._pytree.tree_map
    model.register_forward_pre_hook(lambda m, args: tree_map(lambda t: cast(t, dtype), args))
    model.register_forward_hook(lambda m, args, out: tree_map(lambda t: cast(t, torch.float32), out))
    return model


def _dtype_noise(mf, dtype: torch.dtype, weights: Mapping[str, torch.Tensor]) -> Callable:
    """`_numeric_check`'s tolerance_for in `dtype`: NOISE_FACTOR x |eager in dtype - eager fp32|
    on the batch, eager fp32 being a fresh (fake) model called with the fp32 `weights`."""
    reference = _fake_model(mf).eval()
    eps = torch.finfo(dtype).eps

    def tolerance_for(eager: list[torch.Tensor], feeds: list[torch.Tensor]) -> float:
        with torch.no_grad():
            fp32 = torch.utils._pytree.tree_leaves(torch.func.functional_call(reference, dict(weights), tuple(feeds)))
        pairs = [(e, f) for e, f in zip(eager, fp32) if e.is_floating_point() and e.numel()]
        if any(not e.isfinite().all() and f.isfinite().all() for e, f in pairs):  # inf - inf would read as NaN
            raise OnnxUnsupported(
                f"the forward in {dtype_name(dtype)} gives inf or NaN on the example batch where "
                f"fp32 does not (out of the dtype's range); export it in another precision"
            )
        noise = max([(e.double() - f.double()).abs().max().item() for e, f in pairs], default=0.0)
        scale = max([1.0] + [f.abs().max().item() for _, f in pairs])
        return max(NOISE_FACTOR * noise, FLOOR_EPS * eps * scale)

    return tolerance_for


def export_checkpoint(
    artifact_dir: Path, model_file: Path, checkpoint: Path, output: Path, *, precision: str = "fp32", warn: Callable[[str], None] = lambda msg: None
) -> dict:
    """`aot export`: the forward exported as `aot build` exports it (from the model on fake tensors),
    a checkpoint's trained weights attached, written as a standalone ONNX file (`save_onnx`: weights
    over protobuf's limit go to `<output>.data`), then checked with ONNX Runtime reading that file
    against eager PyTorch on the same weights when they fit CHECK_BUDGET_BYTES. `precision`
    (fp32, bf16, fp16): the dtype it computes in (see the module's docstring)."""
    from aot.capture.model_file import load_model_file
    from runner.format.artifact import Artifact
    from runner.format.checkpoint import full_weights
    from runner.format.stacked import with_rows
    from runner.execution.data import split_batch_tensors
    from runner.format.integrity import check_writable_target, sha256_file

    if precision not in DTYPES:
        raise AotError(f"unknown precision {precision!r}; choose one of {', '.join(DTYPES)}")
    dtype = DTYPES[precision]
    artifact = Artifact(artifact_dir)
    output = Path(output)
    check_writable_target(output, "file")
    if output.suffix != ".onnx":
        raise AotError(f"{output}: the output of `aot export` is an ONNX file; name it *.onnx")
    check_writable_target(output.with_name(output.name + ".data"), "file")
    manifest = artifact.manifest
    built = manifest.get("build", {}).get("model_sha256")
    model_file = Path(model_file)
    if not model_file.is_file():
        raise AotError(f"{model_file}: no such model file")
    digest = sha256_file(model_file)
    if digest != built:
        raise AotError(f"{model_file}: differs from the model file the artifact was built from (sha256 {digest[:12]}... vs {str(built)[:12]}...)")
    index, weights = full_weights(checkpoint)  # fsdp and tp shards reassembled
    state = manifest["state"]
    expected = {n: [list(v[0]), v[1]] for n, v in {**state["params"], **state["buffers"]}.items()}
    got = {n: [list(t.shape), dtype_name(t.dtype)] for n, t in weights.items()}
    wrong = [n for n in got if expected.get(n) != got[n]] + [n for n in state["params"] if n not in got]
    if wrong:
        raise AotError(
            f"{checkpoint}: checkpoint weights do not match the artifact's parameters and buffers "
            f"(names, shapes or dtypes; first: {wrong[0]!r}); was it written by a run of {artifact_dir}?"
        )
    rest = sorted(set(state["buffers"]) - set(weights))
    if rest:  # buffers a checkpoint need not hold (non-persistent ones): the init program's
        weights.update(_replay_init(artifact, set(rest)))
    weights = with_rows(weights, state.get("stacked", {}))  # a ModuleList's experts: read under their own names
    mf = load_model_file(model_file)
    model = _fake_model(mf)
    metadata = {"aot.weights": f"checkpoint at step {index['step']}"}
    tolerance_for = None
    if dtype != torch.float32:  # fp32: the weights as trained, the export as before
        model = in_precision(model, dtype)
        tolerance_for = _dtype_noise(mf, dtype, weights)
        weights = {n: t.to(dtype) if t.is_floating_point() else t for n, t in weights.items()}
        metadata["aot.precision"] = precision
    example = artifact.tensors(manifest["data"]["example"])
    inputs, _ = split_batch_tensors(example, manifest["data"]["example"])
    inputs = export_inputs(mf, [t[: manifest["data"]["batch_size"]] for t in inputs])
    result = export_onnx(mf, model, inputs, metadata=metadata, check=False)
    spec = result.spec
    named = result.weights_for(weights)
    size = spec["weights_bytes"]

    budget = REFERENCE_BUDGET_BYTES if dtype == torch.bfloat16 else CHECK_BUDGET_BYTES

    def verify(path: Path) -> None:
        if size > budget:
            _unchecked(
                spec,
                _budget_reason(size)
                if budget == CHECK_BUDGET_BYTES
                else f"the bf16 weights ({size / 2**20:.0f} MiB) exceed the {budget >> 20} MiB that onnx's reference "
                f"evaluator checks (ONNX Runtime's CPU provider cannot run bf16)",
            )
            return
        session, runtime = _checker(path, dtype, str(output))
        worst, tolerance = _numeric_check(mf, model, inputs, spec, session, weights, runtime=runtime, tolerance_for=tolerance_for)
        spec.update({"max_abs_diff": worst, "tolerance": tolerance, "checked_batch_sizes": [int(inputs[0].shape[0]), 1], "checked_with": runtime})

    written = save_onnx(result.data, named, output, metadata=metadata, verify=verify)
    if spec.get("unchecked"):
        warn(f"{output}: not checked against eager PyTorch: {spec['unchecked']}")
    return {"output": str(output), "step": index["step"], "precision": precision, **written, **spec}


def _checker(path: Path, dtype: torch.dtype, where: str):
    """(something with ONNX Runtime's `run(output_names, feeds)` over the written file, its name)."""
    if dtype == torch.bfloat16:  # ONNX Runtime's CPU provider has no bf16 kernels
        import onnx
        from onnx.reference import ReferenceEvaluator

        return ReferenceEvaluator(onnx.load(str(path))), "onnx's reference evaluator"
    from runner.execution.infer import create_session

    return create_session(str(path), "cpu", where=where)[0], "ONNX Runtime"


def _replay_init(artifact, only: set[str]) -> dict[str, torch.Tensor]:
    from runner.execution.init_program import load_init_graph, replay

    manifest = artifact.manifest
    init = manifest["init"]
    graph = load_init_graph(artifact.read(init["file"]), artifact.read(init["constants"]) if init.get("constants") else None)
    return replay(graph, init["outputs"], int(manifest["build"].get("seed", 0)), only=only)
