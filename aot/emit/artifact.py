"""Emit: the traced, optimized step becomes a versioned artifact folder.

The graph is exported with torch.export (non-strict, on the same fake shapes), serialized without
pickles through runner.format.program, and written with the init program (how each rank creates its
weights), the optimizer state's description, the example batch and the manifest through
runner.format.integrity.StagedDir, so every file is hashed and a failed build leaves nothing half-written.
No weights or optimizer state are stored: the artifact grows with distinct programs, not with
ranks or parameters.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

import runner
from aot.capture.step import CapturedStep, StepLayout
from aot.capture.training_state import TrainingState
from aot.emit.exported import exported_program
from aot.errors import AotError
from aot.passes.graph_utils import COLLECTIVES, is_call, tensor_bytes
from aot.plan.mesh import Mesh
from aot.plan.placement import Placement, identity
from runner.format.artifact import FORMAT_NAME, FORMAT_VERSION, MANIFEST, manifest_digest
from runner.format.checkpoint import optimizer_key
from runner.execution.data import dtype_name
from runner.format.integrity import StagedDir, canonical_json
from runner.format.signing import SIGNATURE, sign_manifest
from runner.format.program import encode_program
from runner.hardware.topology import profile_sha256
from runner.format.axes import EP, FSDP, TP

PROGRAM = "train"
INIT_PROGRAM = "init"


def export_step(captured: CapturedStep) -> torch.export.ExportedProgram:
    return exported_program(captured.graph, captured.example_args, "the captured step")


def export_init(state: TrainingState) -> torch.export.ExportedProgram:
    """The init program (how every parameter and buffer is made) as an ExportedProgram."""
    return exported_program(state.init_program, [], "model()'s construction")


def collectives_of(graph: torch.fx.Graph) -> list[dict]:
    """Every collective of one step in issue order: kind, group name and payload bytes."""
    result = []
    for node in graph.nodes:
        if is_call(node, COLLECTIVES):
            val = node.args[0].meta.get("val")
            result.append(
                {
                    "kind": node.target._schema.name.split("::")[-1],
                    "group": node.args[-1],
                    "bytes": tensor_bytes(node.args[0]),
                    "dtype": dtype_name(val.dtype) if isinstance(val, torch.Tensor) else None,
                }
            )
    return result


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}


def _below(bounds: dict[str, int] | None, key: str) -> dict:
    return {"below": bounds[key]} if bounds and key in bounds else {}


def _optimizer_init(state: TrainingState) -> dict[str, dict]:
    """How the runner creates each optimizer state tensor: `fill` everywhere, shaped like its
    parameter's piece on the rank (`"param"`) or as given (0-dim step counters: `[]`)."""
    out = {}
    for name, key in state.optimizer_slots:
        value = state.optimizer_state[optimizer_key(name, key)]
        shape = "param" if value.dim() and value.shape == state.params[name].shape else list(value.shape)
        out[optimizer_key(name, key)] = {"shape": shape, "dtype": dtype_name(value.dtype), "fill": state.optimizer_fills[optimizer_key(name, key)]}
    return out


def ep_rows(programs: dict) -> int:
    """The rows each rank sends each expert, as the programs were traced (the largest, should experts
    layers see different token counts)."""
    return max(captured.ep_capacity or 0 for _, captured in programs.values())


def _capacity(layout: StepLayout, programs: dict):
    """The manifest's `expert_parallel.capacity`: "model" where a ModuleList's experts are dispatched
    by the model's own block (its own capacity), "dropless", or the factor and its rows."""
    if any(layer.listed for layer in layout.ep_layers):
        return "model"
    return "dropless" if layout.ep_capacity_factor is None else {"factor": layout.ep_capacity_factor, "rows": ep_rows(programs)}


def _check_shardable(state: TrainingState, layout: StepLayout) -> None:
    """Optimizer state unlike its parameter cannot follow a split or sharded parameter."""
    split = (set(layout.tp_dims(state)) if layout.tp else set()) | set(layout.ep_params)
    for name, key in state.optimizer_slots:
        value = state.optimizer_state[optimizer_key(name, key)]
        if value.dim() and value.shape != state.params[name].shape and (layout.fsdp is not None or name in split):
            raise AotError(f"optimizer state {key!r} of {name!r} has shape {list(value.shape)}, unlike its parameter; it cannot be sharded")


def emit_artifact(
    out: Path,
    *,
    programs: dict[str, tuple[torch.export.ExportedProgram, CapturedStep]],
    state: TrainingState,
    layout: StepLayout,
    mesh: Mesh,
    profile: dict,
    example: dict[str, torch.Tensor],
    batch_size: int,
    build: dict,
    placement: Placement | None = None,
    subgroups: dict | None = None,
    sign_key: Path | None = None,
    extra_files: dict[str, bytes] | None = None,
    extra_fields: dict | None = None,
    program_of=lambda coords: PROGRAM,
    eval_program_of=None,
    token_bounds: dict[str, int] | None = None,
) -> dict:
    """Write the artifact folder. `programs`: name -> (exported program, its capture); one
    (PROGRAM) serves every rank unless the ranks differ (pipeline stages), when `program_of(coords)`
    names a rank's; `token_bounds`: {"inputs.I" | "targets": the least token id the step cannot
    take} (aot/capture/token_bounds.py), written as the data's `below`; `eval_program_of(coords)`, where given, names the rank's eval program
    (aot/capture/eval_step.py), one of `programs`. `placement` maps mesh ranks to physical ranks (default: the
    identity); `ranks` and `process_groups` are written in physical ranks, so a runner looks up its
    own RANK and binds the groups as listed, `subgroups` among them. `extra_files` (relative path -> bytes) are written and
    hashed like every other file; `extra_fields` are optional top-level manifest entries that
    describe them (the ONNX inference export, the custom operator libraries)."""
    placement = placement or identity(mesh.axes, mesh.shape)
    if (placement.axes, placement.shape) != (mesh.axes, mesh.shape):
        raise AotError(f"placement of mesh {placement.axes}={placement.shape} for mesh {mesh.describe()}")
    if not placement.ascending:  # torch orders group members by rank: coordinates must agree
        raise AotError(f"placement {list(placement.physical)} orders some group's ranks against its coordinates")
    _check_shardable(state, layout)
    encoded = {name: encode_program(ep) for name, (ep, _) in programs.items()}
    init_program = export_init(state)
    init_json, init_constants = encode_program(init_program)
    data_slots = [s for s in next(iter(programs.values()))[1].slots if s["kind"] in ("input", "target")]
    tp_dims = layout.tp_dims(state)
    with StagedDir(out, MANIFEST) as files:
        for name, (code, consts) in (*encoded.items(), (INIT_PROGRAM, (init_json, init_constants))):
            files.write(f"programs/{name}.json", code)
            if consts is not None:
                files.write(f"programs/{name}.constants.safetensors", consts)
        files.write("data/example_batch.safetensors", save_safetensors(_contiguous(example)))
        for relpath, data in (extra_files or {}).items():
            files.write(relpath, data)
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "aot_version": runner.__version__,
            "torch_version": torch.__version__,
            "build": build,
            "topology": {"name": profile["name"], "sha256": profile_sha256(profile), "profile": profile},
            "world_size": mesh.world_size,
            "mesh": {"axes": list(mesh.axes), "shape": list(mesh.shape)},
            "placement": placement.to_json(rank_map=True),
            "process_groups": {  # physical ranks, each group in coordinate order (ascending)
                mesh.group_name(axis): {"axis": axis, "groups": placement.groups(axis)} for axis in mesh.axes if mesh.size(axis) > 1
            }
            | (subgroups or {}),  # the levels of hierarchical all_reduces (aot/passes/hierarchical.py)
            "programs": {
                name: {
                    "file": f"programs/{name}.json",
                    "constants": f"programs/{name}.constants.safetensors" if encoded[name][1] is not None else None,
                    "inputs": captured.slots,
                    "outputs": list(captured.outputs),
                    "collectives": collectives_of(ep.graph),
                    "graph_nodes": len(ep.graph.nodes),
                }
                for name, (ep, captured) in programs.items()
            },
            "ranks": [  # per physical rank: the mesh coordinates the placement gives it, and its program
                {"rank": r, "program": program_of(placement.coords(r)), "coords": placement.coords(r)}
                | ({"eval_program": eval_program_of(placement.coords(r))} if eval_program_of else {})
                for r in range(mesh.world_size)
            ],
            "init": {  # the recipe of the initial parameters and buffers (runner/execution/init_program.py)
                "file": f"programs/{INIT_PROGRAM}.json",
                "constants": f"programs/{INIT_PROGRAM}.constants.safetensors" if init_constants is not None else None,
                "outputs": [*state.params, *state.buffers],
                "graph_nodes": len(init_program.graph.nodes),
            },
            "sharding": None
            if layout.fsdp is None
            else {
                "axis": FSDP,
                "group": layout.fsdp.name,
                "size": layout.fsdp.size,
                "layout": "flat-padded",
                "params": {n: s.numel() for n, s in layout.local_shapes(state).items()},
            },
            "tensor_parallel": None
            if layout.tp is None
            else {
                "axis": TP,
                "group": layout.tp.name,
                "size": layout.tp.size,
                "plan": dict(layout.tp_plan),
                "params": tp_dims,
                "fused": layout.tp_fused(state),
                **({"summed": list(layout.tp_summed)} if layout.tp_summed else {}),
                "sequence_parallel": layout.sequence is not None,
            },
            "expert_parallel": None
            if layout.ep is None
            else {
                "axis": EP,
                "group": layout.ep.name,
                "size": layout.ep.size,
                "experts": {layer.module: layer.experts for layer in layout.ep_layers},
                "params": list(layout.ep_params),
                "capacity": _capacity(layout, programs),
            },
            "state": {
                "params": {n: [list(t.shape), dtype_name(t.dtype)] for n, t in state.params.items()},
                "buffers": {n: [list(t.shape), dtype_name(t.dtype)] for n, t in state.buffers.items()},
                "persistent_buffers": [n for n in state.buffers if n in {state.aliases.get(k, k) for k in state.state_dict_keys}],
                "optimizer_init": _optimizer_init(state),
                "optimizer": {
                    "class": state.optimizer_class,
                    "param_groups": [{"params": names, **hyper} for names, hyper in zip(state.param_groups, state.hyperparameters)],
                },
                "aliases": state.aliases,
                "state_dict_keys": state.state_dict_keys,
                **({"stacked": state.stacked} if state.stacked else {}),
            },
            "schedule": {"constant": state.lr_constant, "lr": state.lr_schedule},
            "data": {
                "batch_size": batch_size,
                "example": "data/example_batch.safetensors",
                "inputs": [
                    {"shape": s["shape"], "dtype": s["dtype"]} | _below(token_bounds, f"inputs.{s['index']}") for s in data_slots if s["kind"] == "input"
                ],
                "targets": next({"shape": s["shape"], "dtype": s["dtype"]} | _below(token_bounds, "targets") for s in data_slots if s["kind"] == "target"),
            },
        }
        manifest.update(extra_fields or {})
        manifest["files"] = dict(sorted(files.files.items()))
        manifest["digest"] = manifest_digest(manifest)
        signature = sign_manifest(canonical_json(manifest), sign_key) if sign_key else None
        files.commit(manifest, unlisted={SIGNATURE: signature})
    return manifest
