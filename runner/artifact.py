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
from runner.integrity import read_verified

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
}


def torch_release(version: str | None = None) -> str:
    """`2.13.0+cpu` -> `2.13.0`: CPU and CUDA builds of one release read the same programs."""
    return (version or torch.__version__).split("+")[0]


class Artifact:
    """A verified view of an artifact folder. Construction checks only the manifest; every
    other file is checked against its sha256 when it is read."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        path = self.root / MANIFEST
        if not self.root.is_dir():
            raise AotError(f"{self.root}: no such artifact folder")
        if not path.is_file():
            raise AotError(f"{self.root}: no {MANIFEST}; not an aot artifact (make one with `aot build`)")
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise AotError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise AotError(f"{path}: not an aot artifact manifest (format is not {FORMAT_NAME!r})")
        for key, kind in _REQUIRED.items():
            if not isinstance(data.get(key), kind):
                raise AotError(f"{path}: field {key!r} is missing or not a {kind.__name__}")
        if data["format_version"] != FORMAT_VERSION:
            raise AotError(
                f"{path}: artifact format version {data['format_version']} but this runner reads "
                f"version {FORMAT_VERSION}; rebuild with a matching aot"
            )
        if torch_release(data["torch_version"]) != torch_release():
            raise AotError(
                f"{path}: built with torch {data['torch_version']} but this runner has torch "
                f"{torch.__version__}; rebuild with torch {torch_release()} or install torch "
                f"{torch_release(data['torch_version'])}"
            )
        self.manifest = data

    @property
    def world_size(self) -> int:
        return self.manifest["world_size"]

    def read(self, relpath: str) -> bytes:
        entry = self.manifest["files"].get(relpath)
        if entry is None:
            raise AotError(f"{self.root / MANIFEST}: names {relpath} but does not list its sha256")
        return read_verified(self.root, relpath, entry)

    def tensors(self, relpath: str) -> dict[str, torch.Tensor]:
        return load_safetensors(self.read(relpath))

    def rank(self, rank: int) -> dict:
        for entry in self.manifest["ranks"]:
            if entry["rank"] == rank:
                return entry
        raise AotError(f"{self.root}: artifact has no rank {rank} (world size {self.world_size})")

    def program(self, name: str) -> dict:
        return self.manifest["programs"][name]
