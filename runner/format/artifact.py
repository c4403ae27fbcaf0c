"""Reading an artifact folder: the manifest, its version contract and verified file access.

The manifest (manifest.json) is the artifact's table of contents; artifacts/FORMAT.md is its
specification. A runner reads its own format version and the one before it (the compatibility
window), and only the torch release that built the artifact (the serialized programs name torch
operators by their schema, which only that release is guaranteed to resolve the same way);
anything else is refused with both versions named.
"""

from __future__ import annotations

import math

import json
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from runner.errors import AotError
from runner.format.integrity import canonical_json, check_file, content_problem, read_verified, sha256_bytes

FORMAT_NAME = "aot-artifact"
# 8: a ModuleList's experts stacked (state.stacked, capacity "model"); 7: expert parallelism
# (expert_parallel); 6: fused tensor-parallel layers (tensor_parallel.fused)
FORMAT_VERSION = 8
READABLE_VERSIONS = (FORMAT_VERSION - 1, FORMAT_VERSION)  # this version and the one before it
MANIFEST = "manifest.json"


def manifest_digest(manifest: dict) -> str:
    """sha256 over every entry of the manifest but the digest itself (canonical JSON)."""
    return sha256_bytes(canonical_json({k: v for k, v in manifest.items() if k != "digest"}))


def torch_release(version: str | None = None) -> str:
    """`2.13.0+cpu` -> `2.13.0`: CPU and CUDA builds of one release read the same programs."""
    return (version or torch.__version__).split("+")[0]


def torch_window(version: str | None = None) -> str:
    """The torch releases that read the programs a release writes: its major.minor, every patch
    (`2.13.0` -> `2.13`). torch.export's serialized schema and operator set change between minor
    releases, not within one."""
    return ".".join(torch_release(version).split(".")[:2])


# the flag that runs an artifact outside the window anyway, and what it risks
TORCH_SKEW_FLAG = "--allow-torch-skew"
TORCH_SKEW_RISK = "its programs may fail to load, or compute otherwise than the build traced them"


class Artifact:
    """A verified view of an artifact folder. Construction checks the manifest (its signature
    first, where keys are trusted) and then every file it lists against its size and sha256 (a
    file nothing will read, such as the ONNX export under `aot run`, is no less the artifact's);
    each file is checked again when it is read."""

    def __init__(self, root: str | Path, trusted_keys: list[str] | None = None, any_torch: bool = False, torch_skew: bool = False):
        """any_torch: accept an artifact of any torch release without a word (readers of the
        manifest and of program JSON that deserialize no program, such as `aot diff`);
        torch_skew: accept one outside this torch's window (torch_window), the risk the caller's
        to state (--allow-torch-skew)."""
        self.root = Path(root)
        path = self.root / MANIFEST
        if not self.root.is_dir():
            raise AotError(f"{self.root}: no such artifact folder")
        if not path.is_file():
            raise AotError(f"{self.root}: no {MANIFEST}; not an aot artifact (make one with `aot build`)")
        raw = path.read_bytes()
        self.signer = None
        if trusted_keys:
            # before anything of the artifact is parsed
            from runner.format.signing import check_signature

            self.signer = check_signature(self.root, raw, trusted_keys)
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise AotError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise AotError(f"{path}: not an aot artifact manifest (format is not {FORMAT_NAME!r})")
        # Versions first: a manifest of another version may follow other rules for the rest.
        if data.get("format_version") not in READABLE_VERSIONS:
            raise AotError(
                f"{path}: artifact format version {data.get('format_version')} but this runner reads "
                f"versions {READABLE_VERSIONS[0]} and {READABLE_VERSIONS[1]}; rebuild with a matching aot"
            )
        if not isinstance(data.get("torch_version"), str):
            raise AotError(f"{path}: field 'torch_version' is missing or not a str")
        self.torch_skew = torch_window(data["torch_version"]) != torch_window()
        if self.torch_skew and not (any_torch or torch_skew):
            raise AotError(
                f"{path}: built with torch {data['torch_version']}, and this runner reads artifacts of torch "
                f"{torch_window()}.x (it has {torch.__version__}); rebuild with torch {torch_window()}, install torch "
                f"{torch_window(data['torch_version'])}, or pass {TORCH_SKEW_FLAG} ({TORCH_SKEW_RISK})"
            )
        if not isinstance(data.get("digest"), str):
            raise AotError(f"{path}: has no digest; it was written by an older development build of aot: rebuild it")
        if data["digest"] != manifest_digest(data):
            raise AotError(f"{path}: digest does not match its entries (manifest altered or corrupt)")
        _check_structure(data, str(path))
        self.manifest = data
        for relpath, entry in data["files"].items():
            check_file(self.root, relpath, entry)

    @property
    def world_size(self) -> int:
        return self.manifest["world_size"]

    def read(self, relpath: str) -> bytes:
        entry = self.manifest["files"].get(relpath)
        if entry is None:
            raise AotError(f"{self.root / MANIFEST}: names {relpath} but does not list its sha256")
        data = read_verified(self.root, relpath, entry)
        problem = content_problem(relpath, data)
        if problem:
            raise AotError(f"{self.root / relpath}: {problem}; refusing to deserialize it")
        return data

    def tensors(self, relpath: str) -> dict[str, torch.Tensor]:
        return load_safetensors(self.read(relpath))

    def rank(self, rank: int) -> dict:
        for entry in self.manifest["ranks"]:
            if entry["rank"] == rank:
                return entry
        raise AotError(f"{self.root}: artifact has no rank {rank} (world size {self.world_size})")

    def program(self, name: str) -> dict:
        return self.manifest["programs"][name]


class Map:
    """A JSON object with any keys whose values all follow `schema`."""

    def __init__(self, schema):
        self.schema = schema


class OneOf:
    def __init__(self, *values):
        self.values = values


SHAPE = [int]
TENSOR = {"shape": SHAPE, "dtype": str}
NUMBER = (int, float)
# What a version-1 manifest must hold (more keys may appear; readers ignore them). Nested dicts
# are required keys, one-element lists are lists of that, Map is an object of any keys.
SCHEMA = {
    "world_size": int,
    "mesh": {"axes": [str], "shape": [int]},
    "process_groups": Map({"axis": str, "groups": [[int]]}),
    "programs": Map(
        {
            "file": str,
            "inputs": [{"kind": OneOf("param", "buffer", "optim", "lr", "scaler", "input", "target")}],
            "outputs": [str],
            "collectives": [{"kind": str, "group": str, "bytes": int}],
        }
    ),
    "ranks": [{"rank": int, "program": str, "coords": Map(int)}],
    "state": {"params": Map([SHAPE, str]), "buffers": Map([SHAPE, str]), "aliases": Map(str), "state_dict_keys": [str], "optimizer": {"class": str}},
    "schedule": {"constant": bool, "lr": [[NUMBER]]},
    "data": {"batch_size": int, "example": str, "inputs": [TENSOR], "targets": TENSOR},
    "topology": {"name": str, "sha256": str, "profile": dict},
    "files": Map({"sha256": str, "size": int}),
    "build": dict,
}
IO = {"name": str, "shape": [(int, str)], "dtype": str}  # str: a symbolic dimension such as "batch"
INFERENCE_SCHEMA = {"file": str, "batch_dim": str, "inputs": [IO], "outputs": [IO]}
INIT_SCHEMA = {
    "init": {"file": str, "outputs": [str]},
    "state": {"persistent_buffers": [str], "optimizer_init": Map({"shape": (str, list), "dtype": str, "fill": NUMBER})},
}
# Loss-scaling state (fp16; FORMAT.md, "Precision"), in the order programs take it.
SCALER_KEYS = ("scale", "growth_tracker", "skipped_steps")
# Version 4: how the step computes (artifacts/FORMAT.md, "Precision"); version 3 is fp32 throughout.
LOW = OneOf("fp32", "bf16", "fp16")
PRECISION_SCHEMA = {"precision": {"compute": LOW, "param_dtype": LOW, "reduce_dtype": LOW}}
SCALER_SCHEMA = {"init_scale": NUMBER, "growth_factor": NUMBER, "backoff_factor": NUMBER, "growth_interval": int}
# What the build predicts one rank's step holds, and what it recomputes (FORMAT.md, "Memory"); optional
MEMORY_SCHEMA = {"predicted": {"peak": int, "resident": Map(int), "at_peak": Map(int)}, "recompute": {"policy": str}}
# Pipeline stages (FORMAT.md, "Pipeline"); present with a pp axis
PIPELINE_SCHEMA = {
    "axis": str,
    "group": str,
    "size": int,
    "schedule": OneOf("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"),
    "microbatches": int,
    "microbatch_size": int,
    "stages_per_rank": int,
    "tied": [str],
    "stages": [{"stage": int, "rank": int, "program": str, "layers": [str], "params": [str], "buffers": [str]}],
}
# Version 7: the experts split over an ep axis (FORMAT.md, "Expert-parallel layout"); present with an ep axis
EXPERT_PARALLEL_SCHEMA = {"axis": str, "group": str, "size": int, "experts": Map(int), "params": [str], "capacity": (str, dict)}
# The build's predicted step time (FORMAT.md, "Time"); optional
TIME_SCHEMA = {"predicted": {"step_s": NUMBER, "compute_s": NUMBER, "comm_s": NUMBER, "exposed_comm_s": NUMBER}, "topology": str, "calibrated": bool}
# How many BatchNorm layers, how many are SyncBatchNorm, and over which mesh axes (FORMAT.md, "BatchNorm"); optional
BATCHNORM_SCHEMA = {"layers": int, "synced": int, "axes": [str]}
# How each mesh axis holds each parameter, proved from the graph at build (FORMAT.md, "Replicas");
# optional (builds before it lack it)
REPLICAS_SCHEMA = {"params": Map(Map(OneOf("sharded", "reduced", "identical"))), "buffers_per_rank": [str]}
SLOT_FIELDS = {
    "param": {"name": str},
    "buffer": {"name": str},
    "optim": {"name": str, "key": str},
    "lr": {"group": int},
    "scaler": {"key": OneOf(*SCALER_KEYS)},
    "input": {"index": int, **TENSOR},
    "target": TENSOR,
}


def _check_expert_parallel(m: dict, where: str, expect) -> None:
    """The `expert_parallel` entry (version 7): its group listed, its parameters known experts
    weights whose dimension 0 (the experts) its size divides."""
    expect(m["format_version"] >= 7, f"expert_parallel is version 7; this manifest says version {m['format_version']}")
    try:
        _conform(m["expert_parallel"], EXPERT_PARALLEL_SCHEMA, "expert_parallel")
    except AotError as e:
        raise AotError(f"{where}: {e}") from None
    ep = m["expert_parallel"]
    expect(ep["group"] in m["process_groups"], "expert_parallel.group names no process group")
    capacity = ep["capacity"]
    bounded = isinstance(capacity, dict) and isinstance(capacity.get("factor"), (int, float)) and type(capacity.get("rows")) is int and capacity["rows"] > 0
    own = capacity == "model" and m["format_version"] >= 8  # a ModuleList's experts, dispatched by the model's own block
    expect(capacity == "dropless" or bounded or own, f'expert_parallel.capacity must be "dropless", "model" or {{"factor": F, "rows": C}}, got {capacity!r}')
    expect(all(k > 0 and k % ep["size"] == 0 for k in ep["experts"].values()), f"expert_parallel.experts: a count {ep['size']} ranks cannot share evenly")
    for name in ep["params"]:
        shape = m["state"]["params"].get(name, [None])[0]
        expect(shape is not None, f"expert_parallel.params names unknown parameter {name!r}")
        expect(len(shape) >= 1 and shape[0] % ep["size"] == 0, f"expert_parallel.params: {name!r} cannot be split {ep['size']} ways along dimension 0")


def _check_stacked(m: dict, expect) -> None:
    """`state.stacked` (version 8): each stacked weight a known parameter of E rows, E names that
    are the model's state_dict keys."""
    stacked = m["state"].get("stacked", {})
    expect(not stacked or m["format_version"] >= 8, f"state.stacked is version 8; this manifest says version {m['format_version']}")
    expect(isinstance(stacked, dict), "state.stacked must map a stacked weight to the names it stacks")
    keys = set(m["state"]["state_dict_keys"])
    for name, names in stacked.items():
        shape = m["state"]["params"].get(name, [None])[0]
        expect(shape is not None, f"state.stacked names unknown parameter {name!r}")
        expect(
            isinstance(names, list) and shape[0] == len(names) and set(names) <= keys, f"state.stacked: {name!r} must list its {shape[0]} rows' state_dict keys"
        )


def _conform(value, schema, path: str) -> None:
    """Raise AotError naming the first place where `value` does not follow `schema`."""

    def fail(what: str):
        raise AotError(f"{path or 'manifest'}: {what}")

    if isinstance(schema, dict):
        if not isinstance(value, dict):
            fail("must be an object")
        for key, sub in schema.items():
            if key not in value:
                fail(f"field {key!r} is missing")
            _conform(value[key], sub, f"{path}.{key}" if path else key)
    elif isinstance(schema, list):
        if not isinstance(value, list):
            fail("must be a list")
        if len(schema) > 1 and len(value) != len(schema):  # a fixed-length pair such as [shape, dtype]
            fail(f"must have {len(schema)} entries")
        for i, item in enumerate(value):
            _conform(item, schema[i] if len(schema) > 1 else schema[0], f"{path}[{i}]")
    elif isinstance(schema, Map):
        if not isinstance(value, dict):
            fail("must be an object")
        for key, item in value.items():
            _conform(item, schema.schema, f"{path}[{key!r}]")
    elif isinstance(schema, OneOf):
        if value not in schema.values:
            fail(f"must be one of {', '.join(map(str, schema.values))}")
    elif schema is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        fail("must be a non-negative integer")
    elif not isinstance(value, schema) or (schema is not bool and isinstance(value, bool)):
        names = schema.__name__ if isinstance(schema, type) else " or ".join(t.__name__ for t in schema)
        fail(f"must be a {names}")


def _check_structure(m: dict, where: str) -> None:
    """Refuse a hand-edited or damaged manifest with one line, before any field is used."""
    try:
        _conform(m, SCHEMA, "")
    except AotError as e:
        raise AotError(f"{where}: {e}") from None

    def expect(ok: bool, what: str) -> None:
        if not ok:
            raise AotError(f"{where}: {what}")

    try:
        _conform(m, INIT_SCHEMA, "")
        _conform(m, PRECISION_SCHEMA, "")
    except AotError as e:
        raise AotError(f"{where}: {e}") from None
    expect(isinstance(m["build"].get("seed", 0), int) and not isinstance(m["build"].get("seed", 0), bool), "build.seed must be an integer")
    for name, program in m["programs"].items():
        expect(program["file"] in m["files"], f"programs[{name!r}].file is not listed in files")
        constants = program.get("constants")
        expect(constants is None or (isinstance(constants, str) and constants in m["files"]), f"programs[{name!r}].constants is not listed in files")
        for j, slot in enumerate(program["inputs"]):
            expect(slot.get("kind") in SLOT_FIELDS, f"programs[{name!r}].inputs[{j}].kind {slot.get('kind')!r} is not one of {', '.join(SLOT_FIELDS)}")
            try:
                _conform(slot, SLOT_FIELDS[slot["kind"]], f"programs[{name!r}].inputs[{j}]")
            except AotError as e:
                raise AotError(f"{where}: {e}") from None
        if any(slot["kind"] == "scaler" for slot in program["inputs"]):
            expect(
                (m.get("precision") or {}).get("grad_scaler") is not None, f"programs[{name!r}] takes loss-scaling state but precision.grad_scaler is missing"
            )
    scaler = (m.get("precision") or {}).get("grad_scaler")
    if scaler is not None:
        try:
            _conform(scaler, SCALER_SCHEMA, "precision.grad_scaler")
        except AotError as e:
            raise AotError(f"{where}: {e}") from None
        # torch.amp.GradScaler's own bounds: a scale that is a positive finite number, growth above 1, backoff in (0, 1)
        expect(0 < scaler["init_scale"] < math.inf, f"precision.grad_scaler.init_scale {scaler['init_scale']!r} is not a positive finite number")
        expect(1 < scaler["growth_factor"] < math.inf, f"precision.grad_scaler.growth_factor {scaler['growth_factor']!r} is not a finite number above 1")
        expect(0 < scaler["backoff_factor"] < 1, f"precision.grad_scaler.backoff_factor {scaler['backoff_factor']!r} is not between 0 and 1")
        expect(scaler["growth_interval"] >= 1, f"precision.grad_scaler.growth_interval {scaler['growth_interval']!r} is not a positive number of steps")
    mesh = m["mesh"]
    expect(len(mesh["axes"]) == len(mesh["shape"]), "mesh needs axes (names) and shape (degrees) of equal length")
    size = 1
    for degree in mesh["shape"]:
        size *= degree
    expect(size == m["world_size"], f"mesh shape {mesh['shape']} does not multiply to world size {m['world_size']}")
    expect(len(m["ranks"]) == m["world_size"], f"ranks lists {len(m['ranks'])} entries for world size {m['world_size']}")
    for entry in m["ranks"]:
        expect(entry["program"] in m["programs"], f"rank {entry['rank']} names program {entry['program']!r}, which is not listed")
        evaluates = entry.get("eval_program")  # optional (FORMAT.md, "Eval program")
        expect(evaluates is None or evaluates in m["programs"], f"rank {entry['rank']} names eval program {evaluates!r}, which is not listed")
    if m.get("init") is not None:
        init = m["init"]
        expect(init["file"] in m["files"], "init.file is not listed in files")
        constants = init.get("constants")
        expect(constants is None or (isinstance(constants, str) and constants in m["files"]), "init.constants is not listed in files")
        expect(
            sorted(init["outputs"]) == sorted([*m["state"]["params"], *m["state"]["buffers"]]),
            "init.outputs do not name each of state.params and state.buffers once",
        )
        for key, spec in m["state"]["optimizer_init"].items():
            shape = spec["shape"]
            expect(key.rpartition(":")[0] in m["state"]["params"], f"state.optimizer_init[{key!r}] names no parameter")
            expect(
                shape == "param" or (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)),
                f'state.optimizer_init[{key!r}].shape must be "param" or a list of sizes',
            )
    _check_placement(m, where, expect)
    if m.get("sharding") is not None:
        try:
            _conform(m["sharding"], {"axis": str, "group": str, "size": int, "params": Map(int)}, "sharding")
        except AotError as e:
            raise AotError(f"{where}: {e}") from None
        expect(m["sharding"]["group"] in m["process_groups"], "sharding.group names no process group")
        expect(set(m["sharding"]["params"]) <= set(m["state"]["params"]), "sharding.params names unknown parameters")
    if m.get("tensor_parallel") is not None:
        try:
            _conform(
                m["tensor_parallel"],
                {"axis": str, "group": str, "size": int, "plan": Map(str), "params": Map(int), "sequence_parallel": bool},
                "tensor_parallel",
            )
        except AotError as e:
            raise AotError(f"{where}: {e}") from None
        tp = m["tensor_parallel"]
        expect(tp["group"] in m["process_groups"], "tensor_parallel.group names no process group")
        fused = tp.get("fused", {}) if m["format_version"] >= 6 else {}
        expect(m["format_version"] >= 6 or "fused" not in tp, "tensor_parallel.fused is version 6; this manifest says version 5")
        counts = fused.values() if isinstance(fused, dict) else [None]
        expect(all(isinstance(k, int) and not isinstance(k, bool) and k > 1 for k in counts), "tensor_parallel.fused must map parameters to counts above 1")
        expect(set(fused) <= set(tp["params"]), "tensor_parallel.fused names a parameter tensor_parallel.params does not split")
        for name, dim in tp["params"].items():
            shape = m["state"]["params"].get(name, [None])[0]
            expect(shape is not None, f"tensor_parallel.params names unknown parameter {name!r}")
            expect(
                0 <= dim < len(shape) and shape[dim] % (tp["size"] * fused.get(name, 1)) == 0,
                f"tensor_parallel.params: {name!r} cannot be split {tp['size']} ways along dimension {dim}"
                + (f" in each of its {fused[name]} parts" if name in fused else ""),
            )
    if m.get("expert_parallel") is not None:
        _check_expert_parallel(m, where, expect)
    _check_stacked(m, expect)
    for key, schema in (
        ("inference", INFERENCE_SCHEMA),
        ("custom_ops", {"modules": [str], "ops": [str]}),
        ("memory", MEMORY_SCHEMA),
        ("time", TIME_SCHEMA),
        ("pipeline", PIPELINE_SCHEMA),
        ("batchnorm", BATCHNORM_SCHEMA),
        ("replicas", REPLICAS_SCHEMA),
    ):
        if m.get(key) is not None:  # optional entries: the ONNX export, custom operator libraries
            try:
                _conform(m[key], schema, key)
            except AotError as e:
                raise AotError(f"{where}: {e}") from None
    if m.get("pipeline") is not None:
        p = m["pipeline"]
        expect(p["group"] in m["process_groups"], "pipeline.group names no process group")
        expect(p["size"] == dict(zip(m["mesh"]["axes"], m["mesh"]["shape"])).get(p["axis"]), "pipeline.size is not the mesh's pp degree")
        expect([s["stage"] for s in p["stages"]] == list(range(p["size"] * p["stages_per_rank"])), "pipeline.stages must number the stages 0, 1, ... in order")
        for stage in p["stages"]:
            expect(stage["program"] in m["programs"], f"pipeline stage {stage['stage']} names unknown program {stage['program']!r}")
            expect(all(n in m["state"]["params"] for n in stage["params"]), f"pipeline stage {stage['stage']} names a parameter the state lacks")
        for r in m["ranks"]:
            stages = {s["program"] for s in p["stages"] if s["rank"] == r["coords"].get(p["axis"])}
            expect(stages == {r["program"]}, f"rank {r['rank']} runs {r['program']!r}, not its pipeline stage's program")
    else:
        expect(len({r["program"] for r in m["ranks"]}) == 1, "ranks run different programs without a pipeline entry")
    if m.get("batchnorm") is not None:
        bn = m["batchnorm"]
        expect(bn["synced"] <= bn["layers"], "batchnorm.synced counts more layers than batchnorm.layers")
        expect(set(bn["axes"]) <= set(m["mesh"]["axes"]), "batchnorm.axes names an axis the mesh lacks")
    if m.get("replicas") is not None:
        r = m["replicas"]
        expect(set(r["params"]) <= set(m["state"]["params"]), "replicas.params names unknown parameters")
        expect(all(set(h) <= set(m["mesh"]["axes"]) for h in r["params"].values()), "replicas.params names an axis the mesh lacks")
        expect(set(r["buffers_per_rank"]) <= set(m["state"]["buffers"]), "replicas.buffers_per_rank names unknown buffers")
    if m.get("inference") is not None:
        expect(m["inference"]["file"] in m["files"], "inference.file is not listed in files")
    expect(bool(m["schedule"]["lr"]), "schedule.lr is empty")
    expect(m["data"]["example"] in m["files"], "data.example is not listed in files")
    for name, entry in m["files"].items():
        expect(len(entry["sha256"]) == 64, f"files[{name!r}].sha256 must have 64 hex digits")


def mesh_coords(axes, shape, mesh_rank: int) -> dict[str, int]:
    """Coordinates of a mesh rank, keyed in the mesh's axis order: row-major over the axes, the
    last fastest (the layout the format defines; aot.plan.mesh.Mesh asks this function)."""
    coords = {}
    for axis, degree in reversed(list(zip(axes, shape))):
        coords[axis], mesh_rank = mesh_rank % degree, mesh_rank // degree
    return {axis: coords[axis] for axis in axes}


def _check_level(name: str, spec: dict, coords: dict, world: int, expect) -> None:
    """A level of a hierarchical all_reduce ("intra": a group's ranks on one node, "inter": the
    ranks holding the same piece across nodes): groups of equal size that partition the world,
    each inside one group of its axis (differing only in that coordinate), ranks ascending."""
    axis, level = spec["axis"], spec["level"]
    expect(level in ("intra", "inter"), f"process_groups[{name!r}]: level {level!r} is neither intra nor inter")
    groups = spec["groups"]
    expect(
        len({len(g) for g in groups}) == 1 and sorted(r for g in groups for r in g) == list(range(world)),
        f"process_groups[{name!r}]: its groups are not of one size or do not cover each rank once",
    )
    for group in groups:
        others = {tuple(sorted((a, c) for a, c in coords[r].items() if a != axis)) for r in group}
        expect(group == sorted(group) and len(others) == 1, f"process_groups[{name!r}]: group {group} is not ascending inside one {axis} group")


def _check_placement(m: dict, where: str, expect) -> None:
    """`ranks` are physical ranks (torchrun's RANK), one entry each, with the coordinates
    `placement` gives them; every group of `process_groups` lists its ranks ascending, each at the
    index of its coordinate along the group's axis. torch's new_group sorts the ranks it is given,
    so a member's place in a collective (its all_gather piece, its reduce_scatter shard) is its
    place in the sorted group: a group that is not in coordinate order would exchange shards out
    of order, silently."""
    world = m["world_size"]
    axes, shape = m["mesh"]["axes"], m["mesh"]["shape"]
    coords = {}
    for entry in m["ranks"]:
        expect(entry["rank"] < world and entry["rank"] not in coords, f"ranks: rank {entry['rank']} is listed twice or outside world size {world}")
        expect(
            sorted(entry["coords"]) == sorted(axes) and all(entry["coords"][a] < d for a, d in zip(axes, shape)),
            f"ranks: rank {entry['rank']}'s coords {entry['coords']} are not coordinates of mesh {dict(zip(axes, shape))}",
        )
        coords[entry["rank"]] = entry["coords"]
    placement = m.get("placement")
    if placement is not None:
        try:
            _conform(placement, {"axes_outer_to_inner": [str], "physical_rank_of_mesh_rank": [int]}, "placement")
        except AotError as e:
            raise AotError(f"{where}: {e}") from None
        physical = placement["physical_rank_of_mesh_rank"]
        expect(sorted(physical) == list(range(world)), f"placement.physical_rank_of_mesh_rank is not a permutation of the {world} ranks")
        expect(sorted(placement["axes_outer_to_inner"]) == sorted(axes), "placement.axes_outer_to_inner are not the mesh's axes")
        for mesh_rank, rank in enumerate(physical):
            expect(
                coords[rank] == mesh_coords(axes, shape, mesh_rank),
                f"ranks: rank {rank}'s coords {coords[rank]} are not those of mesh rank {mesh_rank}, which placement puts on it",
            )
    for name, spec in m["process_groups"].items():
        axis = spec["axis"]
        expect(axis in axes, f"process_groups[{name!r}]: axis {axis!r} is not a mesh axis")
        if spec.get("level") is not None:
            _check_level(name, spec, coords, world, expect)
            continue
        for group in spec["groups"]:
            expect(all(r in coords for r in group), f"process_groups[{name!r}]: group {group} names a rank outside the world")
            expect(
                group == sorted(set(group)) and [coords[r][axis] for r in group] == list(range(len(group))),
                f"process_groups[{name!r}]: group {group} does not list its ranks ascending in {axis} coordinate "
                f"order ({axis} = {[coords[r][axis] for r in group]}); torch orders a group's members by rank, "
                f"so its shards would be exchanged out of order: rebuild the artifact",
            )
