"""Emit: the traced, optimized step becomes a versioned artifact folder.

The graph is exported with torch.export (non-strict, on the same fake shapes), serialized without
pickles through runner.program, and written with weights, optimizer state, the example batch and
the manifest through runner.integrity.StagedDir, so every file is hashed and a failed build leaves
nothing half-written. The artifact grows with distinct programs, not with ranks: ranks that run
the same program and hold the same (replicated) state share files.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

import runner
from aot.capture.step import CapturedStep, StepLayout, rank_state
from aot.capture.training_state import TrainingState
from aot.errors import AotError
from aot.passes.graph_utils import COLLECTIVES, is_call, tensor_bytes
from aot.plan.mesh import Mesh
from aot.plan.placement import Placement, identity
from runner.artifact import FORMAT_NAME, FORMAT_VERSION, MANIFEST, manifest_digest
from runner.data import dtype_name
from runner.integrity import StagedDir, canonical_json
from runner.signing import SIGNATURE, sign_manifest
from runner.program import encode_program
from runner.topology import profile_sha256

PROGRAM = "train"


def export_step(captured: CapturedStep) -> torch.export.ExportedProgram:
    try:
        return torch.export.export(captured.graph, tuple(captured.example_args), strict=False)
    except Exception as e:
        raise AotError(f"the captured step could not be exported: {type(e).__name__}: {str(e).splitlines()[0]}") from e


def collectives_of(graph: torch.fx.Graph) -> list[dict]:
    """Every collective of one step in issue order: kind, group name and payload bytes."""
    result = []
    for node in graph.nodes:
        if is_call(node, COLLECTIVES):
            val = node.args[0].meta.get("val")
            result.append({
                "kind": node.target._schema.name.split("::")[-1],
                "group": node.args[-1],
                "bytes": tensor_bytes(node.args[0]),
                "dtype": dtype_name(val.dtype) if isinstance(val, torch.Tensor) else None,
            })
    return result


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}


def _state_files(tp_index: int | None, fsdp_index: int | None) -> tuple[str, str]:
    suffix = ("" if tp_index is None else f".tp-{tp_index}") + ("" if fsdp_index is None else f".fsdp-{fsdp_index}")
    return f"state/weights{suffix}.safetensors", f"state/optimizer{suffix}.safetensors"


def _shard_of(layout: StepLayout, coords: dict[str, int]) -> tuple[int | None, int | None]:
    """(tp index, fsdp index) of the state a rank holds; None along an axis that does not split it."""
    return (coords["tp"] if layout.tp else None), (coords["fsdp"] if layout.fsdp else None)


def emit_artifact(out: Path, *, ep: torch.export.ExportedProgram, captured: CapturedStep, state: TrainingState,
                  layout: StepLayout, mesh: Mesh, profile: dict, example: dict[str, torch.Tensor], batch_size: int,
                  build: dict, placement: Placement | None = None, subgroups: dict | None = None, sign_key: Path | None = None,
                  extra_files: dict[str, bytes] | None = None, extra_fields: dict | None = None) -> dict:
    """Write the artifact folder. `placement` maps mesh ranks to physical ranks (default: the
    identity); `ranks` and `process_groups` are written in physical ranks, so a runner looks up its
    own RANK and binds the groups as listed, `subgroups` among them. `extra_files` (relative path -> bytes) are written and
    hashed like every other file; `extra_fields` are optional top-level manifest entries that
    describe them (the ONNX inference export, the custom operator libraries)."""
    placement = placement or identity(mesh.axes, mesh.shape)
    if (placement.axes, placement.shape) != (mesh.axes, mesh.shape):
        raise AotError(f"placement of mesh {placement.axes}={placement.shape} for mesh {mesh.describe()}")
    if not placement.ascending:  # torch orders group members by rank: coordinates must agree
        raise AotError(f"placement {list(placement.physical)} orders some group's ranks against its coordinates")
    program_json, constants = encode_program(ep)
    data_slots = [s for s in captured.slots if s["kind"] in ("input", "target")]
    # One pair of state files per distinct shard: replicas (data parallel) share theirs.
    shards = sorted({_shard_of(layout, mesh.coords(r)) for r in range(mesh.world_size)}, key=lambda s: (s[0] or 0, s[1] or 0))
    tp_dims = layout.tp_dims(state)
    with StagedDir(out, MANIFEST) as files:
        files.write(f"programs/{PROGRAM}.json", program_json)
        if constants is not None:
            files.write(f"programs/{PROGRAM}.constants.safetensors", constants)
        for tp_index, fsdp_index in shards:
            local = rank_state(state, layout, fsdp_index or 0, tp_index or 0)
            weights_file, optimizer_file = _state_files(tp_index, fsdp_index)
            files.write(weights_file, save_safetensors(_contiguous({**local.params, **state.buffers})))
            files.write(optimizer_file, save_safetensors(_contiguous(local.optimizer_state)))
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
                mesh.group_name(axis): {"axis": axis, "groups": placement.groups(axis)}
                for axis in mesh.axes if mesh.size(axis) > 1
            } | (subgroups or {}),  # the levels of hierarchical all_reduces (aot/passes/hierarchical.py)
            "programs": {
                PROGRAM: {
                    "file": f"programs/{PROGRAM}.json",
                    "constants": f"programs/{PROGRAM}.constants.safetensors" if constants is not None else None,
                    "inputs": captured.slots,
                    "outputs": ["loss", "global_loss"],
                    "collectives": collectives_of(ep.graph),
                    "graph_nodes": len(ep.graph.nodes),
                }
            },
            "ranks": [  # per physical rank: the mesh coordinates the placement gives it
                {"rank": r, "program": PROGRAM, "coords": placement.coords(r),
                 **dict(zip(("weights", "optimizer"), _state_files(*_shard_of(layout, placement.coords(r)))))}
                for r in range(mesh.world_size)
            ],
            "sharding": None if layout.fsdp is None else {
                "axis": "fsdp", "group": layout.fsdp.name, "size": layout.fsdp.size, "layout": "flat-padded",
                "params": {n: s.numel() for n, s in layout.local_shapes(state).items()},
            },
            "tensor_parallel": None if layout.tp is None else {
                "axis": "tp", "group": layout.tp.name, "size": layout.tp.size,
                "plan": dict(layout.tp_plan), "params": tp_dims, "sequence_parallel": layout.sequence is not None,
            },
            "state": {
                "params": {n: [list(t.shape), dtype_name(t.dtype)] for n, t in state.params.items()},
                "buffers": {n: [list(t.shape), dtype_name(t.dtype)] for n, t in state.buffers.items()},
                "optimizer": {"class": state.optimizer_class, "param_groups": [
                    {"params": names, **hyper} for names, hyper in zip(state.param_groups, state.hyperparameters)]},
                "aliases": state.aliases,
                "state_dict_keys": state.state_dict_keys,
            },
            "schedule": {"constant": state.lr_constant, "lr": state.lr_schedule},
            "data": {
                "batch_size": batch_size,
                "example": "data/example_batch.safetensors",
                "inputs": [{"shape": s["shape"], "dtype": s["dtype"]} for s in data_slots if s["kind"] == "input"],
                "targets": next({"shape": s["shape"], "dtype": s["dtype"]} for s in data_slots if s["kind"] == "target"),
            },
        }
        manifest.update(extra_fields or {})
        manifest["files"] = dict(sorted(files.files.items()))
        manifest["digest"] = manifest_digest(manifest)
        signature = sign_manifest(canonical_json(manifest), sign_key) if sign_key else None
        files.commit(manifest, unlisted={SIGNATURE: signature})
    return manifest
