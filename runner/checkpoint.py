"""Checkpoints: training state keyed by the user's names, in safetensors, written all-or-nothing.

A checkpoint folder holds model.step-N.safetensors (parameters and buffers by their names in the
user's model), optimizer.step-N.safetensors ("<parameter>:<state key>") and checkpoint.json (the
step to resume at, the tensor layout, the state_dict aliases of tied weights and the sha256 of
both files).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from runner.errors import AotError
from runner.integrity import StagedDir, check_writable_target, content_problem, read_verified

INDEX = "checkpoint.json"
FORMAT_NAME = "aot-checkpoint"
FORMAT_VERSION = 1


def optimizer_key(param: str, key: str) -> str:
    return f"{param}:{key}"


def layout_of(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    return {name: [list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in sorted(tensors.items())}


def save_checkpoint(folder: str | Path, step: int, weights: dict, optimizer: dict, state_spec: dict,
                    target_step: int | None = None) -> None:
    """Write weights and optimizer state at `step` (the next step to run) into `folder`.

    File names carry the step, so writing never touches the files of the previous checkpoint
    and its index stays valid until the new index atomically replaces it: a crash at any moment
    leaves the last good checkpoint readable. `target_step` is where the run that wrote it means
    to stop, so a run restarted by torchrun knows how far to go.
    """
    folder = Path(folder)
    cpu = lambda d: {k: v.detach().to("cpu").contiguous() for k, v in d.items()}
    weights, optimizer = cpu(weights), cpu(optimizer)
    names = {"weights": f"model.step-{step:08d}.safetensors", "optimizer": f"optimizer.step-{step:08d}.safetensors"}
    with StagedDir(folder, INDEX) as out:
        out.write(names["weights"], save_safetensors(weights))
        out.write(names["optimizer"], save_safetensors(optimizer))
        out.commit({
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "step": step,
            "target_step": target_step,
            **names,
            "layout": {"model": layout_of(weights), "optimizer": layout_of(optimizer)},
            "state_dict_keys": state_spec["state_dict_keys"],
            "aliases": state_spec["aliases"],
            "files": out.files,
        })
    # files of a write that crashed before its index was swapped in
    for orphan in folder.glob("*.step-*.safetensors"):
        if orphan.name not in names.values():
            orphan.unlink(missing_ok=True)


def read_index(folder: Path) -> dict:
    path = folder / INDEX
    if not folder.is_dir():
        raise AotError(f"{folder}: no such checkpoint folder")
    if not path.is_file():
        raise AotError(f"{folder}: no {INDEX}; not an aot checkpoint")
    try:
        index = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise AotError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT_NAME:
        raise AotError(f"{path}: not an aot checkpoint index")
    if index.get("format_version") != FORMAT_VERSION:
        raise AotError(f"{path}: checkpoint format version {index.get('format_version')}, this runner reads {FORMAT_VERSION}")
    return index


def load_checkpoint(folder: str | Path) -> tuple[dict, dict, dict]:
    """(index, weights, optimizer state) of a checkpoint, every file verified first."""
    folder = Path(folder)
    index = read_index(folder)
    files = index.get("files", {})
    tensors = []
    for role in ("weights", "optimizer"):
        name = index.get(role)
        if not isinstance(name, str) or name not in files:
            raise AotError(f"{folder / INDEX}: does not list its {role} file")
        data = read_verified(folder, name, files[name])
        problem = content_problem(name, data)
        if problem:
            raise AotError(f"{folder / name}: {problem}; refusing to deserialize it")
        tensors.append(load_safetensors(data))
    return index, tensors[0], tensors[1]


def merge_checkpoint(folder: str | Path, output: str | Path) -> int:
    """Write the full model state_dict (every key `model().state_dict()` has, tied weights under
    each of their names) to one safetensors file; returns the number of keys written."""
    index, weights, _ = load_checkpoint(folder)
    aliases = index["aliases"]
    state = {}
    for key in index["state_dict_keys"]:
        source = aliases.get(key, key)
        if source not in weights:
            raise AotError(f"{folder}: checkpoint lacks {source!r} needed for state_dict key {key!r}")
        # safetensors refuses tensors sharing storage, so each alias gets its own copy
        state[key] = weights[source].clone()
    output = Path(output)
    check_writable_target(output, "file")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    try:
        tmp.write_bytes(save_safetensors(state))
        tmp.replace(output)
    finally:
        tmp.unlink(missing_ok=True)
    return len(state)
