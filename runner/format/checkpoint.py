"""Checkpoints: training state keyed by the user's names, in safetensors, crash-safe.

A checkpoint folder holds, per shard of the training state (one when the state is replicated,
one per tp x fsdp position when split; runner.format.sharding numbers them), model.step-N[.shard-I].safetensors (parameters and buffers by
their names in the user's model) and optimizer.step-N[.shard-I].safetensors
("<parameter>:<state key>"), and checkpoint.json: the step to resume at, the shard placement,
the tensor layout, the state_dict aliases of tied weights and the sha256 of every file.

File names carry the step, so writing never touches the files of the previous checkpoint, and
checkpoint.json is replaced atomically once all new files exist: a crash at any moment leaves the
last complete checkpoint readable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from runner.errors import AotError
from runner.format.integrity import canonical_json, check_writable_target, content_problem, read_verified, sha256_file
from runner.format.sharding import assemble, shard_count
from runner.format.stacked import model_tensors

INDEX = "checkpoint.json"
FORMAT_NAME = "aot-checkpoint"
# 5: stacked (a ModuleList's experts stored as one weight per parameter); 4: expert_parallel
# (experts' slices, shards numbered over ep); 3: tensor_parallel.fused (fused
# layers' slices); 2: tensor_parallel and tp-major shard numbering
FORMAT_VERSION = 5
READABLE_VERSIONS = (FORMAT_VERSION - 1, FORMAT_VERSION)  # a version-4 index reads as version 5 without stacked experts


def optimizer_key(param: str, key: str) -> str:
    return f"{param}:{key}"


def layout_of(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    return {name: [list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in sorted(tensors.items())}


def shard_files(step: int, index: int, sharded: bool) -> dict[str, str]:
    """The file names of one shard of the checkpoint at `step` (deterministic, so every rank
    knows every name without exchanging them)."""
    suffix = f".shard-{index}" if sharded else ""
    return {"weights": f"model.step-{step:08d}{suffix}.safetensors", "optimizer": f"optimizer.step-{step:08d}{suffix}.safetensors"}


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_shard(folder: str | Path, step: int, index: int, sharded: bool, weights: dict, optimizer: dict) -> None:
    """Write one shard's files; nothing refers to them until `commit_checkpoint`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = shard_files(step, index, sharded)
    cpu = lambda d: {k: v.detach().to("cpu").contiguous() for k, v in d.items()}
    _write_atomically(folder / names["weights"], save_safetensors(cpu(weights)))
    _write_atomically(folder / names["optimizer"], save_safetensors(cpu(optimizer)))


def remove_shard(folder: str | Path, step: int, index: int, sharded: bool) -> None:
    """Remove one shard's files of `step` (a checkpoint that could not be completed)."""
    for name in shard_files(step, index, sharded).values():
        (Path(folder) / name).unlink(missing_ok=True)


def last_good(folder: str | Path) -> str:
    """What a failed save leaves: "the last good checkpoint (step N)", or that there is none."""
    try:
        return f"the last good checkpoint (step {read_index(Path(folder))['step']}) is intact"
    except AotError:
        return "there is no earlier checkpoint there"


def commit_checkpoint(
    folder: str | Path,
    step: int,
    spec: dict,
    sharding: dict | None,
    target_step: int | None = None,
    tensor_parallel: dict | None = None,
    pipeline: dict | None = None,
    data_order: dict | None = None,
    expert_parallel: dict | None = None,
) -> None:
    """Make the shards written for `step` the folder's checkpoint (one atomic index replace),
    then remove files no index refers to. `spec` is the manifest's `state` entry; `target_step`
    is where the run means to stop, so a run restarted by torchrun knows how far to go;
    `data_order` ({"shuffle": seed or None, "order": how it shuffles}) how the run ordered its data, which a resumed run
    must repeat to read the samples the run would have (check_data_order)."""
    folder = Path(folder)
    count = shard_count(sharding, tensor_parallel, pipeline, expert_parallel)
    shards = [shard_files(step, i, count > 1) for i in range(count)]
    files = {}
    for names in shards:
        for name in names.values():
            path = folder / name
            files[name] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    first = [load_safetensors((folder / shards[0][role]).read_bytes()) for role in ("weights", "optimizer")]
    index = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": step,
        "target_step": target_step,
        "shards": shards,
        "sharding": sharding,
        "tensor_parallel": tensor_parallel,
        "pipeline": pipeline,
        **({"expert_parallel": expert_parallel} if expert_parallel else {}),
        "shapes": {name: shape for name, (shape, _) in spec["params"].items()},
        "layout": {"model": layout_of(first[0]), "optimizer": layout_of(first[1])},
        "state_dict_keys": spec["state_dict_keys"],
        "aliases": spec["aliases"],
        **({"stacked": spec["stacked"]} if spec.get("stacked") else {}),
        "files": files,
        **({"data_order": data_order} if data_order is not None else {}),
    }
    _write_atomically(folder / INDEX, canonical_json(index))
    for stale in folder.glob("*.step-*.safetensors"):  # the previous checkpoint, or a crashed write
        if stale.name not in files:
            stale.unlink(missing_ok=True)


def check_data_order(folder: str | Path, index: dict, shuffle: int | None, order: str) -> None:
    """Refuse to resume a run in another data order than it was saved in: it would read other
    samples than the run without the restart, without a word. `order` names how this runner
    shuffles (runner.execution.data.SHUFFLE_ORDER): a shuffled run saved by a runner that shuffled
    otherwise (torch.randperm, before "feistel-4") cannot continue at its sample. A checkpoint that
    does not say (written before it was recorded, or by the Python API) is not checked."""
    saved = index.get("data_order")
    if isinstance(saved, dict) and saved.get("shuffle") is not None and saved.get("shuffle") == shuffle and saved.get("order") != order:
        raise AotError(
            f"{folder}: the run shuffled its data in an order this runner does not reproduce ({saved.get('order') or 'torch.randperm'}, "
            f"this runner's is {order}); resume it with the aot that wrote it, or start a new run from its weights (aot checkpoint merge, --init-from)"
        )
    if not isinstance(saved, dict) or saved.get("shuffle", shuffle) == shuffle:
        return
    then = f"--shuffle {saved['shuffle']}" if saved.get("shuffle") is not None else "in order (no --shuffle)"
    now = f"--shuffle {shuffle}" if shuffle is not None else "no --shuffle"
    raise AotError(f"{folder}: the run read its data {then}; resuming with {now} would read other samples: give the same")


def save_checkpoint(folder: str | Path, step: int, weights: dict, optimizer: dict, spec: dict, target_step: int | None = None) -> None:
    """Write and commit an unsharded checkpoint from one process."""
    write_shard(folder, step, 0, False, weights, optimizer)
    commit_checkpoint(folder, step, spec, None, target_step)


def read_index(folder: Path) -> dict:
    folder = Path(folder)
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
    if index.get("format_version") not in READABLE_VERSIONS:
        raise AotError(f"{path}: checkpoint format version {index.get('format_version')}, this runner reads {' and '.join(map(str, READABLE_VERSIONS))}")
    shards = index.get("shards")
    if not (
        isinstance(shards, list)
        and shards
        and all(isinstance(s, dict) for s in shards)
        and isinstance(index.get("files"), dict)
        and isinstance(index.get("step"), int)
    ):
        raise AotError(f"{path}: needs step, shards and files")
    return index


def load_checkpoint(folder: str | Path, shard: int = 0) -> tuple[dict, dict, dict]:
    """(index, weights, optimizer state) of one shard of a checkpoint, its files verified first."""
    folder = Path(folder)
    index = read_index(folder)
    if not 0 <= shard < len(index["shards"]):
        raise AotError(f"{folder}: has {len(index['shards'])} shard(s), not shard {shard}")
    tensors = []
    for role in ("weights", "optimizer"):
        name = index["shards"][shard].get(role)
        if not isinstance(name, str) or name not in index["files"]:
            raise AotError(f"{folder / INDEX}: does not list its {role} file")
        data = read_verified(folder, name, index["files"][name])
        problem = content_problem(name, data)
        if problem:
            raise AotError(f"{folder / name}: {problem}; refusing to deserialize it")
        tensors.append(load_safetensors(data))
    return index, tensors[0], tensors[1]


def full_weights(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(index, every parameter and buffer at full size), reassembling fsdp and tp shards."""
    folder = Path(folder)  # a str folder would fail in the error messages below (`folder / INDEX`)
    index, weights, _ = load_checkpoint(folder, 0)
    sharding, tensor_parallel, pipeline = index.get("sharding"), index.get("tensor_parallel"), index.get("pipeline")
    expert_parallel = index.get("expert_parallel")
    if len(index["shards"]) != shard_count(sharding, tensor_parallel, pipeline, expert_parallel):
        raise AotError(f"{folder / INDEX}: lists {len(index['shards'])} shard(s) for its sharding")
    if sharding or tensor_parallel or pipeline or expert_parallel:
        pieces = [weights] + [load_checkpoint(folder, i)[1] for i in range(1, len(index["shards"]))]
        weights = assemble(pieces, index["shapes"], sharding, tensor_parallel, pipeline, expert_parallel)
    return index, weights


def merge_checkpoint(folder: str | Path, output: str | Path) -> int:
    """Write the full model state_dict (every key `model().state_dict()` has, tied weights under
    each of their names) to one safetensors file; returns the number of keys written."""
    output = Path(output)
    check_writable_target(output, "file")
    index, weights = full_weights(folder)
    missing: list[str] = []
    # safetensors refuses tensors sharing storage, so each alias (and stacked row) gets its own copy
    state = {key: t.clone() for key, t in model_tensors(weights, index, missing).items()}
    if missing:
        raise AotError(f"{folder}: checkpoint lacks the tensor of state_dict key {missing[0]!r}")
    output.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(output, save_safetensors(state))
    return len(state)
