"""`aot export`: a checkpoint's trained weights attached to the exported forward, as one ONNX file.

The export is aot/emit/onnx_export.py's, from the model on fake tensors; `save_onnx` writes it
with weights: inside the file up to `EMBED_LIMIT_BYTES` (protobuf's 2 GiB limit, less room for
the graph), else as ONNX external data in `<file>.data` beside it, each tensor at a 64-byte
aligned offset, whose sha256 the model's metadata records. Buffers a checkpoint does not hold
(masks) come from the artifact's init program.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, Mapping

import torch

from aot.emit.onnx_export import (CHECK_BUDGET_BYTES, TOLERANCE, _aligned, _budget_reason, _fake_model, _numeric_check,
                                   _unchecked, export_inputs, export_onnx)
from runner.data import dtype_name
from aot.errors import AotError

EMBED_LIMIT_BYTES = 2**31 - 2**26    # protobuf's 2 GiB limit, less room for the graph itself


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (ONNX raw data: little-endian, row-major)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def save_onnx(data: bytes, weights: Mapping[str, torch.Tensor], output: Path, *,
              metadata: dict[str, str] | None = None, verify: Callable[[Path], None] | None = None) -> dict:
    """Write the weight-less ONNX model `data` to `output` with `weights` (ONNX initializer name ->
    tensor) attached: inside the file when they fit EMBED_LIMIT_BYTES, else as ONNX external data
    in `<output>.data` (each tensor at a 64-byte aligned offset), whose sha256 the model's metadata
    records (`aot.weights_file`, `aot.weights_sha256`). `verify(path)` may inspect the written
    model (under a temporary name, its data file in place) before it takes its name; if it raises,
    nothing is left. Returns sizes and sha256s."""
    import onnx

    from runner.infer import ONNX_TYPES

    output = Path(output)
    proto = onnx.load_from_string(data)
    external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    names = [t.name for t in external]
    if sorted(names) != sorted(weights):
        extra, missing = sorted(set(weights) - set(names)), sorted(set(names) - set(weights))
        raise AotError(f"the ONNX graph's weights and the tensors given differ: "
                       + (f"no tensor for {missing[0]!r}" if missing else f"{extra[0]!r} is no weight of the graph"))
    tensors = {}
    for t in external:
        tensor = weights[t.name]
        if list(tensor.shape) != list(t.dims) or ONNX_TYPES.get(tensor.dtype) != t.data_type:
            raise AotError(f"{t.name}: the graph takes {list(t.dims)} {onnx.helper.tensor_dtype_to_string(t.data_type)}, "
                           f"got {list(tensor.shape)} {dtype_name(tensor.dtype)}")
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
                    view = memoryview(raw.numpy())
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
    return {"bytes": len(model_bytes), "sha256": hashlib.sha256(model_bytes).hexdigest(),
            "weights_file": None if data_path is None else str(data_path), "weights_bytes": total,
            "weights_sha256": digest}



def export_checkpoint(artifact_dir: Path, model_file: Path, checkpoint: Path, output: Path, *,
                      warn: Callable[[str], None] = lambda msg: None) -> dict:
    """`aot export`: the forward exported as `aot build` exports it (from the model on fake tensors),
    a checkpoint's trained weights attached, written as a standalone ONNX file (`save_onnx`: weights
    over protobuf's limit go to `<output>.data`), then checked with ONNX Runtime reading that file
    against eager PyTorch on the same weights when they fit CHECK_BUDGET_BYTES."""
    from aot.capture.model_file import load_model_file
    from runner.artifact import Artifact
    from runner.checkpoint import full_weights
    from runner.data import split_batch_tensors
    from runner.infer import create_session
    from runner.integrity import check_writable_target, sha256_file

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
        raise AotError(f"{model_file}: differs from the model file the artifact was built from "
                       f"(sha256 {digest[:12]}... vs {str(built)[:12]}...)")
    index, weights = full_weights(checkpoint)  # fsdp and tp shards reassembled
    state = manifest["state"]
    expected = {n: [list(v[0]), v[1]] for n, v in {**state["params"], **state["buffers"]}.items()}
    got = {n: [list(t.shape), dtype_name(t.dtype)] for n, t in weights.items()}
    wrong = [n for n in got if expected.get(n) != got[n]] + [n for n in state["params"] if n not in got]
    if wrong:
        raise AotError(f"{checkpoint}: checkpoint weights do not match the artifact's parameters and buffers "
                       f"(names, shapes or dtypes; first: {wrong[0]!r}); was it written by a run of {artifact_dir}?")
    rest = sorted(set(state["buffers"]) - set(weights))
    if rest:  # buffers a checkpoint need not hold (non-persistent ones): the init program's
        weights.update(_replay_init(artifact, set(rest)))
    mf = load_model_file(model_file)
    model = _fake_model(mf)
    example = artifact.tensors(manifest["data"]["example"])
    inputs, _ = split_batch_tensors(example, manifest["data"]["example"])
    inputs = export_inputs(mf, [t[: manifest["data"]["batch_size"]] for t in inputs])
    step = f"checkpoint at step {index['step']}"
    result = export_onnx(mf, model, inputs, metadata={"aot.weights": step}, check=False)
    spec = result.spec
    named = result.weights_for(weights)
    size = spec["weights_bytes"]

    def verify(path: Path) -> None:
        if size > CHECK_BUDGET_BYTES:
            _unchecked(spec, _budget_reason(size))
            return
        session, _ = create_session(str(path), "cpu", where=str(output))
        spec.update({"max_abs_diff": _numeric_check(mf, model, inputs, spec, session, weights), "tolerance": TOLERANCE,
                     "checked_batch_sizes": [int(inputs[0].shape[0]), 1]})

    written = save_onnx(result.data, named, output, metadata={"aot.weights": step}, verify=verify)
    if spec.get("unchecked"):
        warn(f"{output}: not checked against eager PyTorch: {spec['unchecked']}")
    return {"output": str(output), "step": index["step"], **written, **spec}


def _replay_init(artifact, only: set[str]) -> dict[str, torch.Tensor]:
    from runner.init_program import load_init_graph, replay
    manifest = artifact.manifest
    init = manifest["init"]
    graph = load_init_graph(artifact.read(init["file"]), artifact.read(init["constants"]) if init.get("constants") else None)
    return replay(graph, init["outputs"], int(manifest["build"].get("seed", 0)), only=only)
