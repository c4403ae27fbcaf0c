"""`aot run --init-from PATH`: start training from the user's weights instead of the init program.

PATH is a safetensors file keyed like `model.state_dict()` (what `aot checkpoint merge` writes) or a
Hugging Face model folder (`model.safetensors`, or shards listed by `model.safetensors.index.json`).
`check_init_from` validates it against the manifest from file headers alone, so a bad file fails in
one line before any process group starts. `rank_weights` then reads only this rank's slices
(safetensors maps the file and slices it lazily), so no rank holds a whole tensor it shards.
Pickles (`.bin`, `.pt`, ...) are refused, never loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from runner.format.checkpoint import INDEX as CHECKPOINT_INDEX
from runner.execution.data import dtype_name, dtype_of
from runner.errors import AotError
from runner.format.sharding import axis_index, shard_numel, tp_fused, tp_slice
from runner.format.sharding import shard as fsdp_shard

SINGLE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_NAMES = 5

# safetensors header dtype -> torch dtype (local: runner.execution.data only maps torch -> name)
_FILE_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    "C128": torch.complex128,
}


@dataclass(frozen=True)
class Source:
    """Where one tensor of the model is in the user's files."""

    file: Path
    key: str
    shape: list[int]
    dtype: torch.dtype | str  # the header's name when torch has no such dtype


@dataclass
class InitFrom:
    """A validated --init-from: each stored tensor's source and the layout to cut it into."""

    path: Path
    sources: dict[str, Source]  # canonical name -> its tensor in the files
    dtypes: dict[str, torch.dtype]  # canonical name -> the model's dtype
    sharding: dict | None = None
    tensor_parallel: dict | None = None
    expert_parallel: dict | None = None
    notes: list[str] = field(default_factory=list)  # "notice: ..." lines (dtype casts)
    stacked: dict[str, list[str]] = field(default_factory=dict)  # a stacked experts weight -> its rows' names (sources)


# -- validation (headers only) -------------------------------------------------------------------


def check_init_from(path: str | Path, manifest: dict) -> InitFrom:
    """Validate PATH against the manifest's state from file headers alone (nothing is loaded);
    raises AotError in one line naming the path. Floating-point tensors of another float dtype
    are accepted (cast when read) and reported in `notes`."""
    path = Path(path)
    headers = _headers(path)
    state = manifest["state"]
    stacked = state.get("stacked", {})
    specs = {**state["buffers"], **state["params"]}
    for weight, names in stacked.items():  # the model's files hold each expert's own tensor: matched by those
        shape, dtype = specs.pop(weight)
        specs.update({name: [shape[1:], dtype] for name in names})
    sources, notes = _match(path, headers, state, specs)
    return InitFrom(
        path=path,
        sources=sources,
        dtypes={n: dtype_of(specs[n][1]) for n in sources},
        sharding=manifest.get("sharding"),
        tensor_parallel=manifest.get("tensor_parallel"),
        expert_parallel=manifest.get("expert_parallel"),
        notes=notes,
        stacked=stacked,
    )


def _headers(path: Path) -> dict[str, Source]:
    """Every key the user's file(s) offer, with its shape and dtype, from headers."""
    if path.is_dir():
        return _folder_headers(path)
    if not path.exists():
        raise AotError(f"{path}: no such file or folder")
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise AotError(_pickle_refusal(path))
    if path.name.endswith(".index.json"):
        return _index_headers(path)
    return _file_headers(path)


def _folder_headers(folder: Path) -> dict[str, Source]:
    """A Hugging Face model folder: model.safetensors, else its shard index."""
    if (folder / SINGLE).is_file():
        return _file_headers(folder / SINGLE)
    if (folder / SHARD_INDEX).is_file():
        return _index_headers(folder / SHARD_INDEX)
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise AotError(
            f"{folder}: holds only pickled weights ({_names(pickles)}), which aot never loads; "
            f"save the model with transformers' save_pretrained(DIR, safe_serialization=True), "
            f"or convert the file to safetensors"
        )
    if (folder / CHECKPOINT_INDEX).is_file():
        raise AotError(f"{folder}: is an aot checkpoint; continue it with --resume, or pass the file `aot checkpoint merge` writes from it")
    raise AotError(f"{folder}: has no {SINGLE} or {SHARD_INDEX}")


def _pickle_refusal(path: Path) -> str:
    return (
        f"{path}: refused: {path.suffix} files are pickles, which aot never loads; convert it to safetensors: "
        f"python -c \"import torch, safetensors.torch as st; sd = torch.load('{path}', weights_only=True); "
        f"st.save_file({{k: v.contiguous().clone() for k, v in sd.items()}}, 'model.safetensors')\" "
        f"(or transformers' save_pretrained(DIR, safe_serialization=True))"
    )


def _file_headers(file: Path) -> dict[str, Source]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return {key: _source(file, key, f.get_slice(key)) for key in f.keys()}
    except Exception as e:  # safetensors' own error type varies between releases
        raise AotError(f"{file}: not a readable safetensors file ({_first_line(e)})") from e


def _source(file: Path, key: str, sl) -> Source:
    name = sl.get_dtype()
    return Source(file=file, key=key, shape=list(sl.get_shape()), dtype=_FILE_DTYPES.get(name, name))


def _index_headers(index: Path) -> dict[str, Source]:
    """Keys of a sharded folder, each from the shard the index names for it."""
    weight_map = _read_index(index)
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        raise AotError(f"{index}: names {len(missing)} missing shard(s) ({_names(missing)})")
    headers = {s: _file_headers(index.parent / s) for s in shards}
    out, absent = {}, []
    for key, shard in weight_map.items():
        if key in headers[shard]:
            out[key] = headers[shard][key]
        else:
            absent.append(f"{key} in {shard}")
    if absent:
        raise AotError(f"{index}: {len(absent)} key(s) are not in the shard it names ({_names(absent)})")
    return out


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise AotError(f'{index}: not a safetensors index (needs a "weight_map": {{key: shard file}})') from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise AotError(f"{index}: weight_map must map each key to a shard file name")
    bad = [v for v in weight_map.values() if Path(v).is_absolute() or ".." in Path(v).parts]
    if bad:
        raise AotError(f"{index}: shard paths must stay inside the folder ({_names(sorted(set(bad)))})")
    return weight_map


def _match(path: Path, headers: dict[str, Source], state: dict, specs: dict) -> tuple[dict[str, Source], list[str]]:
    """Each needed canonical name's source (a tied weight from either name, the canonical name's
    preferred); raises one line listing missing, unexpected, misshapen and wrong-kind keys."""
    aliases, keys = state["aliases"], state["state_dict_keys"]
    known = set(keys) | set(aliases)
    needed = list(dict.fromkeys(aliases.get(k, k) for k in keys))
    names_of = {n: [n] + [k for k in keys if aliases.get(k) == n and k != n] for n in needed}
    sources = {n: next((headers[k] for k in names_of[n] if k in headers), None) for n in needed}
    problems = [
        _listed("missing key", [n for n in needed if sources[n] is None]),
        _listed("unexpected key", sorted(k for k in headers if k not in known)),
        _listed("shape mismatch", _shape_mismatches(headers, aliases, specs, keys)),
        _listed("dtype mismatch", _kind_mismatches(headers, aliases, specs, keys)),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise AotError(f"{path}: " + "; ".join(problems))
    found = {n: s for n, s in sources.items() if s is not None}
    return found, _cast_notes(path, found, specs)


def _shape_mismatches(headers, aliases, specs, keys) -> list[str]:
    """Every stored name of a tensor is checked, in the model's order."""
    out = []
    for key in (k for k in keys if k in headers):
        want, got = specs[aliases.get(key, key)][0], headers[key].shape
        if got != list(want):
            out.append(f"{key} is {_shape(got)} (model: {_shape(want)})")
    return out


def _kind_mismatches(headers, aliases, specs, keys) -> list[str]:
    """Only floating <-> floating converts; integers, bools and complex must match exactly."""
    out = []
    for key in (k for k in keys if k in headers):
        want, got = specs[aliases.get(key, key)][1], headers[key].dtype
        model = dtype_of(want)
        if got != model and not (_is_float(got) and _is_float(model)):
            out.append(f"{key} is {_dtype(got)} (model: {want})")
    return out


def _cast_notes(path: Path, sources: dict[str, Source], specs: dict) -> list[str]:
    """One notice line per (file dtype, model dtype) pair that will be cast."""
    casts: dict[tuple[str, str], list[str]] = {}
    for name, src in sources.items():
        if src.dtype != dtype_of(specs[name][1]):
            casts.setdefault((_dtype(src.dtype), specs[name][1]), []).append(name)
    return [f"notice: {path}: {len(names)} tensor(s) stored as {a}, cast to {b} ({_names(names)})" for (a, b), names in casts.items()]


# -- this rank's tensors (lazy slices) -----------------------------------------------------------


def rank_weights(init: InitFrom, coords: dict[str, int], only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """This rank's piece of every parameter and persistent buffer (`only`: of those named, a
    pipeline rank's), keyed by canonical name: contiguous, in the manifest's dtype, on the CPU, in
    the layout runner.format.sharding defines (tp slice, then the flat-padded fsdp piece). Reads only the
    rows each piece needs."""
    tp, fsdp = init.tensor_parallel or {}, init.sharding or {}
    tp_index, tp_size = axis_index(coords, tp), tp.get("size", 1)
    fsdp_index, fsdp_size = axis_index(coords, fsdp), fsdp.get("size", 1)
    ep = init.expert_parallel or {}
    ep_index, experts = axis_index(coords, ep), set(ep.get("params", []))
    rows = {name for names in init.stacked.values() for name in names}
    out = _stacked_pieces(init, ep_index if ep else None, fsdp_size, fsdp_index, only)
    sources = {n: src for n, src in init.sources.items() if n not in rows and (only is None or n in only)}
    for file, names in _by_file(sources).items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                src = init.sources[name]
                dim = tp.get("params", {}).get(name) if tp_size > 1 else None
                if dim is not None and tp_fused(tp, name) > 1:
                    # a fused projection's slice is a piece of each part: read whole, then cut
                    whole = _read(f, src.key, [(0, n) for n in src.shape])
                    piece = _copy(tp_slice(whole, dim, tp_size, tp_index, tp_fused(tp, name)), init.dtypes[name])
                    out[name] = fsdp_shard(piece, fsdp_size, fsdp_index) if name in fsdp.get("params", {}) else piece
                    continue
                # an experts weight (never tp-split): its ep rank's experts, along dimension 0
                region = _tp_region(src.shape, 0, ep["size"], ep_index) if name in experts else _tp_region(src.shape, dim, tp_size, tp_index)
                if name in fsdp.get("params", {}):
                    out[name] = _fsdp_piece(f, src.key, region, fsdp_size, fsdp_index, init.dtypes[name])
                else:
                    out[name] = _copy(_read(f, src.key, region), init.dtypes[name])
    return out


def _stacked_pieces(init: InitFrom, ep_index: int | None, fsdp_size: int, fsdp_index: int, only: set[str] | None) -> dict[str, torch.Tensor]:
    """This rank's piece of each stacked experts weight (`only`: of those named): its ep rank's
    experts' own tensors, each read whole, stacked, then cut flat-padded over fsdp where sharded."""
    ep, fsdp = init.expert_parallel or {}, init.sharding or {}
    out = {}
    for weight, names in init.stacked.items():
        if only is not None and weight not in only:
            continue
        if ep_index is not None and weight in ep.get("params", []):
            local = len(names) // ep["size"]
            names = names[ep_index * local : (ep_index + 1) * local]
        tensors = []
        for name in names:
            src = init.sources[name]
            with safe_open(str(src.file), framework="pt") as f:
                tensors.append(_copy(_read(f, src.key, [(0, n) for n in src.shape]), init.dtypes[name]))
        piece = torch.stack(tensors)
        out[weight] = fsdp_shard(piece, fsdp_size, fsdp_index) if weight in fsdp.get("params", {}) else piece
    return out


def _by_file(sources: dict[str, Source]) -> dict[Path, list[str]]:
    """Names grouped by file, so each shard file is opened once."""
    groups: dict[Path, list[str]] = {}
    for name, src in sources.items():
        groups.setdefault(src.file, []).append(name)
    return groups


def _tp_region(shape: list[int], dim: int | None, parts: int, index: int) -> list[tuple[int, int]]:
    """Per-dimension [start, stop) of tensor-parallel slice `index`, as torch.chunk cuts it."""
    region = [(0, n) for n in shape]
    if dim is not None:
        step = -(-shape[dim] // parts)
        region[dim] = (min(index * step, shape[dim]), min((index + 1) * step, shape[dim]))
    return region


def _fsdp_piece(f, key: str, region: list[tuple[int, int]], parts: int, index: int, dtype: torch.dtype) -> torch.Tensor:
    """Flat piece `index` of the region, zero-padded: reads only the region's rows (along dim 0)
    that cover its flat range."""
    shape = [b - a for a, b in region]
    numel = 1
    for n in shape:
        numel *= n
    size = shard_numel(numel, parts)
    piece = torch.zeros(size, dtype=dtype)
    start, stop = index * size, min((index + 1) * size, numel)
    if start >= stop:
        return piece  # all padding
    if not shape:  # 0-dim: its one element
        piece[0] = _read(f, key, region).reshape(-1)[0]
        return piece
    row = numel // shape[0]
    first, last = start // row, -(-stop // row)
    rows = [(region[0][0] + first, region[0][0] + last), *region[1:]]
    flat = _read(f, key, rows).reshape(-1)
    piece[: stop - start].copy_(flat[start - first * row : stop - first * row])
    return piece


def _read(f, key: str, region: list[tuple[int, int]]) -> torch.Tensor:
    """The region of a stored tensor, lazily: safetensors maps the file, so only the pages the
    region covers are touched. The result may view that mapping: copy it before keeping it."""
    if not region:
        return f.get_tensor(key)
    return f.get_slice(key)[tuple(slice(a, b) for a, b in region)]


def _copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of its own in `dtype` (never a view of the mapped file)."""
    out = torch.empty(t.shape, dtype=dtype)
    out.copy_(t)
    return out


# -- small helpers -------------------------------------------------------------------------------


def _is_float(dtype) -> bool:
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def _dtype(dtype) -> str:
    return dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMES])
    return shown + (", ..." if len(names) > MAX_NAMES else "")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _listed(what: str, items: list[str]) -> str:
    """'2 missing keys (a, b)' or '' when there are none."""
    if not items:
        return ""
    plural = what + ("es" if what.endswith("ch") else "s") if len(items) != 1 else what
    return f"{len(items)} {plural} ({_names(items)})"
