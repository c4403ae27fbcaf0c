"""Inference export: the model's forward as ONNX, checked against eager PyTorch with ONNX Runtime.

`aot build` exports the forward on the initial weights into the artifact (`inference/model.onnx`,
described by the manifest's `inference` entry); `aot export --checkpoint` exports a checkpoint's
trained weights to a standalone .onnx file. Both go the same way:

1. the model in eval mode is exported with `torch.export` (dynamic batch dimension named `batch`)
   and translated by `torch.onnx.export(..., dynamo=True)`; custom operators go through the model
   file's `onnx_translations` (operator -> onnxscript function), and an operator without one
   stops the export with a line saying so;
2. `onnx.checker` checks the model; per-node debug metadata (source paths, stack traces) is
   dropped so equal models give equal bytes;
3. ONNX Runtime (CPU) runs the example batch and a batch of one, and the largest difference from
   eager PyTorch must be within `TOLERANCE`; the figure is recorded.

Inputs are named as in --data files (`inputs`, or `inputs.0`, `inputs.1`, ...), so an example
batch or data file feeds `aot infer` directly; outputs are `outputs` (or `outputs.0`, ...).
The file is protobuf with the weights inside (no pickles, no external data); models over
protobuf's 2 GiB limit are refused.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils._pytree as pytree

import runner
from aot.capture.custom_ops import custom_ops_in
from aot.capture.model_file import ModelFile, call_user
from aot.errors import AotError
from runner.data import dtype_name

ONNX_FILE = "inference/model.onnx"
TOLERANCE = 1e-4
BATCH_DIM = "batch"
_MAX_BYTES = 2**31 - 2**26  # protobuf's 2 GiB limit, less room for the graph itself


class OnnxUnsupported(AotError):
    """The model cannot be exported to ONNX (or its export does not match eager PyTorch)."""


@dataclass
class OnnxExport:
    data: bytes     # the .onnx file
    spec: dict      # the manifest's `inference` entry, less `file`


def io_names(prefix: str, count: int) -> list[str]:
    return [prefix] if count == 1 else [f"{prefix}.{i}" for i in range(count)]


def translation_table(mf: ModelFile) -> dict:
    """The model file's `onnx_translations` as {OpOverload: function}. Keys may be an OpOverload
    (`torch.ops.ns.op.default`), its packet (`torch.ops.ns.op`), the object `torch.library.custom_op`
    returns, or the name `"ns::op"`."""
    table = mf.onnx_translations
    if table is None:
        return {}
    if not isinstance(table, dict):
        table = call_user(table, "onnx_translations()", mf.path)
        if not isinstance(table, dict):
            raise AotError(f"{mf.path.name}: onnx_translations() must return a dict, got {type(table).__name__}")
    result = {}
    for key, fn in table.items():
        op = key
        if isinstance(op, str) and "::" in op:
            namespace, _, name = op.partition("::")
            op = getattr(getattr(torch.ops, namespace), name, None)
        op = getattr(op, "_opoverload", op)          # torch.library.custom_op's CustomOpDef
        if isinstance(op, torch._ops.OpOverloadPacket):
            op = op.default
        if not isinstance(op, torch._ops.OpOverload):
            raise AotError(f"{mf.path.name}: onnx_translations key {key!r} is not a torch operator "
                           f"(use torch.ops.<namespace>.<name>.default)")
        if not callable(fn):
            raise AotError(f"{mf.path.name}: onnx_translations[{key!r}] must be a function (an onnxscript translation)")
        result[op] = fn
    return result


def export_inputs(mf: ModelFile, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Example inputs for the export: a dynamic batch dimension needs at least 2 samples to trace
    (torch specializes sizes 0 and 1), so a batch of one is replaced by batch(2)'s inputs."""
    if inputs[0].shape[0] >= 2:
        return inputs
    result = call_user(mf.batch, "batch(2)", mf.path, 2)
    more = result[0]
    return [more] if isinstance(more, torch.Tensor) else list(more)


@contextlib.contextmanager
def _quiet():
    """torch.onnx prints progress, warns about torchvision and deprecations: none of it is the user's."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export", "onnxscript", "onnx_ir",
                                              "torch.fx.experimental.symbolic_shapes", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _first_line(e: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    # torch.onnx wraps the cause in a long report; its summary names the failing operator
    for line in text.splitlines():
        if "No ONNX function found" in line or line.startswith("<class '"):
            return re.sub(r"^<class '[\w.]+\.(\w+)'>: ", r"\1: ", line)[:400]
    return (text.splitlines()[0] if text else type(e).__name__)[:400]


def _strip_debug_metadata(graph) -> None:
    for node in graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
        for attr in node.attribute:
            if attr.g is not None and attr.HasField("g"):
                _strip_debug_metadata(attr.g)
            for sub in attr.graphs:
                _strip_debug_metadata(sub)


def _rename_dim(proto, old: str, new: str) -> None:
    """Give a symbolic dimension its name (torch.onnx keeps torch's symbol, such as `s31`)."""
    graphs = [proto.graph]
    for graph in graphs:
        for value in [*graph.input, *graph.output, *graph.value_info]:
            for dim in value.type.tensor_type.shape.dim:
                if dim.HasField("dim_param") and dim.dim_param == old:
                    dim.dim_param = new
        graphs.extend(a.g for n in graph.node for a in n.attribute if a.HasField("g"))
        graphs.extend(g for n in graph.node for a in n.attribute for g in a.graphs)


def _dims(value_info) -> list:
    return [d.dim_param if d.HasField("dim_param") else int(d.dim_value) for d in value_info.type.tensor_type.shape.dim]


def _max_diff(eager: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    worst = 0.0
    for e, g in zip(eager, got, strict=True):
        if list(e.shape) != list(g.shape):
            return float("inf")
        if e.numel():
            worst = max(worst, (e.detach().double() - g.double()).abs().max().item())
    return worst


def export_onnx(mf: ModelFile, model: torch.nn.Module, inputs: list[torch.Tensor], *,
                metadata: dict[str, str] | None = None) -> OnnxExport:
    """Export `model`'s forward (eval mode) to ONNX and check it; OnnxUnsupported says why not."""
    where = mf.path.name
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if size > _MAX_BYTES:
        raise OnnxUnsupported(f"the model's weights ({size / 2**30:.1f} GiB) exceed the 2 GiB limit of a "
                              f"single-file ONNX model (external-data export is not supported)")
    inputs = export_inputs(mf, inputs)
    input_names = io_names("inputs", len(inputs))
    table = translation_table(mf)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            eager = call_user(model, "the model's forward (eval mode)", mf.path, *inputs)
            eager_one = call_user(model, "the model's forward (eval mode)", mf.path, *(t[:1] for t in inputs))
        eager, eager_one = pytree.tree_leaves(eager), pytree.tree_leaves(eager_one)
        for leaf in eager:
            if not isinstance(leaf, torch.Tensor):
                raise OnnxUnsupported(f"the forward returns a {type(leaf).__name__}; only tensors can be exported")
        output_names = io_names("outputs", len(eager))
        batch = torch.export.Dim(BATCH_DIM)
        try:
            with _quiet():
                ep = torch.export.export(model, tuple(inputs), dynamic_shapes=tuple({0: batch} for _ in inputs), strict=False)
        except Exception as e:
            raise OnnxUnsupported(f"the forward cannot be exported with a dynamic batch dimension: {_first_line(e)}") from e
        translated = {op._schema.name for op in table}
        ops = custom_ops_in(ep.graph)
        missing = [op for op in ops if op not in translated]
        if missing:
            raise OnnxUnsupported(f"custom operator {missing[0]} has no ONNX translation; give one in {where}'s "
                                  f"onnx_translations (see examples/custom_op.py)")
        try:
            with _quiet():
                program = torch.onnx.export(ep, tuple(inputs), dynamo=True, input_names=input_names,
                                            output_names=output_names, custom_translation_table=table or None,
                                            external_data=False, optimize=True, verbose=False, report=False)
        except Exception as e:
            raise OnnxUnsupported(f"torch.onnx.export failed: {_first_line(e)}") from e
    finally:
        model.train(was_training)

    import onnx
    proto = program.model_proto
    first = proto.graph.input[0].type.tensor_type.shape.dim[0]
    if not first.HasField("dim_param"):
        raise OnnxUnsupported("the export fixed the batch dimension; the forward must accept any batch size")
    _rename_dim(proto, first.dim_param, BATCH_DIM)
    _strip_debug_metadata(proto.graph)
    for function in proto.functions:
        for node in function.node:
            del node.metadata_props[:]
    del proto.metadata_props[:]
    for key, value in {"aot.version": runner.__version__, "aot.model_sha256": mf.sha256, **(metadata or {})}.items():
        proto.metadata_props.add(key=key, value=value)
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as e:
        raise OnnxUnsupported(f"onnx.checker refuses the exported model: {_first_line(e)}") from e
    data = proto.SerializeToString()

    from runner.infer import create_session
    session, _ = create_session(data, "cpu")
    diffs = []
    for feeds, expected in (((inputs, eager)), ((tuple(t[:1] for t in inputs), eager_one))):
        got = session.run(output_names, {n: t.detach().contiguous().numpy() for n, t in zip(input_names, feeds)})
        diffs.append(_max_diff(expected, [torch.from_numpy(g) for g in got]))
    worst = max(diffs)
    if not worst <= TOLERANCE:
        raise OnnxUnsupported(f"ONNX Runtime differs from eager PyTorch by {worst:.3g} on the example batch "
                              f"(tolerance {TOLERANCE:g})")
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    graph_inputs = {v.name: v for v in proto.graph.input}
    graph_outputs = {v.name: v for v in proto.graph.output}
    spec = {
        "format": "onnx",
        "opset": opset,
        "batch_dim": BATCH_DIM,
        "inputs": [{"name": n, "shape": _dims(graph_inputs[n]), "dtype": dtype_name(t.dtype)}
                   for n, t in zip(input_names, inputs)],
        "outputs": [{"name": n, "shape": _dims(graph_outputs[n]), "dtype": dtype_name(t.dtype)}
                    for n, t in zip(output_names, eager)],
        "custom_ops": sorted(op for op in ops),
        "max_abs_diff": worst,
        "tolerance": TOLERANCE,
        "checked_batch_sizes": [int(inputs[0].shape[0]), 1],
    }
    return OnnxExport(data=data, spec=spec)


def build_inference(mf: ModelFile, model: torch.nn.Module, inputs: list[torch.Tensor], *,
                    required: bool, warn) -> OnnxExport | None:
    """`aot build`'s ONNX stage: the export, or None with one warning line when the model cannot
    be exported and the user did not ask for ONNX explicitly (`--onnx` makes it an error)."""
    try:
        return export_onnx(mf, model, inputs, metadata={"aot.weights": "initial"})
    except OnnxUnsupported as e:
        if required:
            raise OnnxUnsupported(f"{mf.path.name}: no ONNX export: {e}") from e
        warn(f"{mf.path.name}: building without an ONNX inference export: {e} "
             f"(--onnx makes this an error, --no-onnx skips the export)")
        return None


def export_checkpoint(artifact_dir: Path, model_file: Path, checkpoint: Path, output: Path) -> dict:
    """`aot export`: a checkpoint's trained weights, exported as `aot build` exports the initial ones."""
    from aot.capture.model_file import load_model_file
    from runner.artifact import Artifact
    from runner.checkpoint import full_weights, layout_of
    from runner.data import split_batch_tensors
    from runner.integrity import check_writable_target, sha256_bytes, sha256_file

    artifact = Artifact(artifact_dir)
    output = Path(output)
    check_writable_target(output, "file")
    if output.suffix != ".onnx":
        raise AotError(f"{output}: the output of `aot export` is an ONNX file; name it *.onnx")
    manifest = artifact.manifest
    built = manifest.get("build", {}).get("model_sha256")
    model_file = Path(model_file)
    if not model_file.is_file():
        raise AotError(f"{model_file}: no such model file")
    digest = sha256_file(model_file)
    if digest != built:
        raise AotError(f"{model_file}: differs from the model file the artifact was built from "
                       f"(sha256 {digest[:12]}... vs {str(built)[:12]}...)")
    index, weights = full_weights(checkpoint)  # fsdp shards reassembled
    state = manifest["state"]
    expected = {n: list(v) for n, v in {**state["params"], **state["buffers"]}.items()}
    if layout_of(weights) != dict(sorted(expected.items())):
        raise AotError(f"{checkpoint}: checkpoint weights do not match the artifact's parameters and buffers "
                       f"(names, shapes or dtypes); was it written by a run of {artifact_dir}?")
    mf = load_model_file(model_file)
    torch.manual_seed(manifest["build"].get("seed", 0))
    model = call_user(mf.model, "model()", mf.path)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name not in weights:
                raise AotError(f"{checkpoint}: has no tensor {name!r} of the model")
            tensor.copy_(weights[name])
    example = artifact.tensors(manifest["data"]["example"])
    inputs, _ = split_batch_tensors(example, manifest["data"]["example"])
    inputs = [t[: manifest["data"]["batch_size"]] for t in inputs]
    result = export_onnx(mf, model, inputs, metadata={"aot.weights": f"checkpoint at step {index['step']}"})
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    try:
        tmp.write_bytes(result.data)
        tmp.replace(output)
    finally:
        tmp.unlink(missing_ok=True)
    return {"output": str(output), "step": index["step"], "bytes": len(result.data),
            "sha256": sha256_bytes(result.data), **result.spec}
