"""Reading an artifact folder: the manifest, its version contract and verified file access.

The manifest (manifest.json) is the artifact's table of contents; artifacts/FORMAT.md is its
specification. A runner accepts exactly one format version and the torch release that built the
artifact (the serialized programs name torch operators by their schema, which only that release is
guaranteed to resolve the same way); anything else is refused with both versions named.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from runner.errors import AotError
from runner.integrity import canonical_json, content_problem, read_verified, sha256_bytes

FORMAT_NAME = "aot-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"

_REQUIRED = {
    "format": str,
    "format_version": int,
    "torch_version": str,
    "world_size": int,
    "mesh": dict,
    "process_groups": dict,
    "programs": dict,
    "ranks": list,
    "state": dict,
    "schedule": dict,
    "data": dict,
    "topology": dict,
    "files": dict,
    "digest": str,
}


def manifest_digest(manifest: dict) -> str:
    """sha256 over every entry of the manifest but the digest itself (canonical JSON)."""
    return sha256_bytes(canonical_json({k: v for k, v in manifest.items() if k != "digest"}))


def torch_release(version: str | None = None) -> str:
    """`2.13.0+cpu` -> `2.13.0`: CPU and CUDA builds of one release read the same programs."""
    return (version or torch.__version__).split("+")[0]


class Artifact:
    """A verified view of an artifact folder. Construction checks only the manifest; every
    other file is checked against its sha256 when it is read."""

    def __init__(self, root: str | Path, trusted_keys: list[str] | None = None):
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
            from runner.signing import check_signature
            self.signer = check_signature(self.root, raw, trusted_keys)
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise AotError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise AotError(f"{path}: not an aot artifact manifest (format is not {FORMAT_NAME!r})")
        # Versions first: a manifest of another version may follow other rules for the rest.
        if data.get("format_version") != FORMAT_VERSION:
            raise AotError(
                f"{path}: artifact format version {data['format_version']} but this runner reads "
                f"version {FORMAT_VERSION}; rebuild with a matching aot"
            )
        if not isinstance(data.get("torch_version"), str):
            raise AotError(f"{path}: field 'torch_version' is missing or not a str")
        if torch_release(data["torch_version"]) != torch_release():
            raise AotError(
                f"{path}: built with torch {data['torch_version']} but this runner has torch "
                f"{torch.__version__}; rebuild with torch {torch_release()} or install torch "
                f"{torch_release(data['torch_version'])}"
            )
        for key, kind in _REQUIRED.items():
            if not isinstance(data.get(key), kind):
                raise AotError(f"{path}: field {key!r} is missing or not a {kind.__name__}")
        if data["digest"] != manifest_digest(data):
            raise AotError(f"{path}: digest does not match its entries (manifest altered or corrupt)")
        _check_structure(data, str(path))
        self.manifest = data

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


def _check_structure(m: dict, where: str) -> None:
    """Refuse a hand-edited or damaged manifest with one line, before any field is used."""
    def expect(ok: bool, what: str) -> None:
        if not ok:
            raise AotError(f"{where}: {what}")

    def is_list_of(value, kind) -> bool:
        return isinstance(value, list) and all(isinstance(v, kind) for v in value)

    for name, entry in m["files"].items():
        expect(isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64
               and isinstance(entry.get("size"), int), f"files[{name!r}] needs a 64-digit sha256 and an integer size")
    mesh = m["mesh"]
    expect(is_list_of(mesh.get("axes"), str) and is_list_of(mesh.get("shape"), int)
           and len(mesh["axes"]) == len(mesh["shape"]), "mesh needs axes (names) and shape (degrees) of equal length")
    size = 1
    for degree in mesh["shape"]:
        size *= degree
    expect(size == m["world_size"], f"mesh shape {mesh['shape']} does not multiply to world size {m['world_size']}")
    for name, group in m["process_groups"].items():
        expect(isinstance(group, dict) and isinstance(group.get("groups"), list)
               and all(is_list_of(g, int) for g in group["groups"]), f"process_groups[{name!r}] needs groups (rank lists)")
    for name, program in m["programs"].items():
        expect(isinstance(program, dict) and isinstance(program.get("file"), str) and program["file"] in m["files"],
               f"programs[{name!r}] needs a file listed in files")
        expect(is_list_of(program.get("inputs"), dict) and all("kind" in i for i in program["inputs"]),
               f"programs[{name!r}] needs inputs")
        expect(is_list_of(program.get("collectives"), dict), f"programs[{name!r}] needs collectives")
    expect(len(m["ranks"]) == m["world_size"], f"ranks lists {len(m['ranks'])} entries for world size {m['world_size']}")
    for entry in m["ranks"]:
        expect(isinstance(entry, dict) and isinstance(entry.get("rank"), int) and entry.get("program") in m["programs"]
               and isinstance(entry.get("coords"), dict) and entry.get("weights") in m["files"]
               and entry.get("optimizer") in m["files"], f"ranks entry {entry!r:.80} is incomplete")
    state = m["state"]
    expect(all(isinstance(state.get(k), kind) for k, kind in
               (("params", dict), ("buffers", dict), ("aliases", dict), ("state_dict_keys", list), ("optimizer", dict))),
           "state needs params, buffers, aliases, state_dict_keys and optimizer")
    schedule = m["schedule"]
    expect(isinstance(schedule.get("constant"), bool) and isinstance(schedule.get("lr"), list) and schedule["lr"]
           and all(is_list_of(step, (int, float)) for step in schedule["lr"]), "schedule needs constant and lr (a list per step)")
    data = m["data"]
    expect(isinstance(data.get("batch_size"), int) and data.get("example") in m["files"]
           and is_list_of(data.get("inputs"), dict) and isinstance(data.get("targets"), dict),
           "data needs batch_size, example (a listed file), inputs and targets")
    expect(isinstance(m["topology"].get("profile"), dict) and isinstance(m["topology"].get("name"), str),
           "topology needs name and profile")
