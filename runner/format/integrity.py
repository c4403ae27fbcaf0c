"""Hashing, verified reads and all-or-nothing writes of artifact and checkpoint folders.

Every file of an artifact or checkpoint is listed in its index (manifest.json or
checkpoint.json) with its sha256 and size, and nothing is deserialized before its bytes match.
Folders are written through `StagedDir`: files go to a hidden staging folder and are moved into
place only when all of them exist, the index last, so a crash never leaves a folder whose index
describes files that are not there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from runner.errors import AotError


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_file(root: Path, relpath: str, entry: dict) -> None:
    """Refuse `root/relpath` unless it is there with the size and sha256 of the index entry
    (read in chunks: a file of gigabytes is not held in memory)."""
    path = root / relpath
    if not path.is_file():
        raise AotError(f"{path}: file listed in the index is missing")
    if path.stat().st_size != entry["size"] or sha256_file(path) != entry["sha256"]:
        raise AotError(f"{path}: sha256 does not match the index (file altered or corrupt)")


def read_verified(root: Path, relpath: str, entry: dict) -> bytes:
    """The bytes of `root/relpath`, refused unless size and sha256 match the index entry."""
    path = root / relpath
    if not path.is_file():
        raise AotError(f"{path}: file listed in the index is missing")
    data = path.read_bytes()
    if len(data) != entry["size"] or sha256_bytes(data) != entry["sha256"]:
        raise AotError(f"{path}: sha256 does not match the index (file altered or corrupt)")
    return data


def check_writable_target(path: Path, kind: str = "folder") -> None:
    """Refuse, before any work, an output path that cannot become a `kind` (folder or file)."""
    path = Path(path)
    if path.exists() and (path.is_dir() != (kind == "folder")):
        raise AotError(f"{path}: exists and is not a {kind}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise AotError(f"{path}: {parent} is a file, not a folder")
            if not os.access(parent, os.W_OK):
                raise AotError(f"{path}: {parent} is not writable")
            return


def content_problem(relpath: str, data: bytes) -> str | None:
    """Why these bytes must not be deserialized, judged from the bytes alone (None if fine).

    Runs even when the hashes match, so a payload planted together with rewritten hashes is
    still refused: artifacts hold only JSON and safetensors, never pickles or zip archives.
    """
    if relpath.endswith(".json"):
        return None if data.lstrip()[:1] == b"{" else "is not a JSON object (a pickle or other payload?)"
    if relpath.endswith(".safetensors"):
        # 8-byte little-endian header length, then the JSON header: a pickle or zip cannot pass
        header = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
        ok = 0 < header and 8 + header <= len(data) and data[8:9] == b"{"
        return None if ok else "is not a safetensors file (a pickle or other payload?)"
    if data[:1] == b"\x80":
        return "holds a pickle"
    if data[:4] == b"PK\x03\x04":
        return "is a zip archive (torch.save / torch.export.save format)"
    return None


def canonical_json(obj) -> bytes:
    """JSON with sorted keys and fixed separators, so equal content gives equal bytes."""
    return (json.dumps(obj, sort_keys=True, indent=1, separators=(",", ": ")) + "\n").encode()


class StagedDir:
    """Write a folder of files atomically enough for artifacts and checkpoints.

    Usage: `with StagedDir(dest, "manifest.json") as out: out.write("a.bin", data); ...;
    out.commit(index)`. Leaving the block without `commit` (an exception) removes the staging
    folder and leaves `dest` as it was. `commit` moves the new files in, then atomically replaces
    the index: a reader sees a complete old index, a complete new one, or (when new files took
    the old ones' names) no index, never one describing bytes that are not there.
    Files of `dest` that the new index does not list but the old one did are removed, so a
    rebuild into the same folder leaves no stale programs behind; unrelated files (FORMAT.md in
    the repository's artifacts/ folder) are kept.
    """

    def __init__(self, dest: Path, index_name: str):
        self.dest = Path(dest)
        self.index_name = index_name
        self.staging = self.dest / f".staging-{os.getpid()}"
        self.files: dict[str, dict] = {}

    def __enter__(self) -> "StagedDir":
        if self.dest.exists() and not self.dest.is_dir():
            raise AotError(f"{self.dest}: exists and is not a folder")
        self.dest.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def write(self, relpath: str, data: bytes) -> dict:
        path = self.staging / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        entry = {"sha256": sha256_bytes(data), "size": len(data)}
        self.files[relpath] = entry
        return entry

    def commit(self, index: dict, unlisted: dict[str, bytes | None] | None = None) -> None:
        """Move the files in and write `index` last. `unlisted` files (a signature over the
        index) are written beside it, or removed where their content is None."""
        index_path = self.dest / self.index_name
        listed = _listed_files(index_path)
        stale = listed - set(self.files)
        if listed & set(self.files):
            # New files replace files the old index lists: drop that index first, so a crash
            # mid-way leaves no index rather than one describing other bytes. Writers that need
            # the old state to survive a crash (checkpoints) use fresh names, keeping the old
            # index valid until the atomic replace below.
            index_path.unlink(missing_ok=True)
        for relpath in self.files:
            target = self.dest / relpath
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.staging / relpath, target)
        for relpath, data in (unlisted or {}).items():
            if data is None:
                (self.dest / relpath).unlink(missing_ok=True)
            else:
                (self.staging / relpath).write_bytes(data)
                os.replace(self.staging / relpath, self.dest / relpath)
        tmp = self.staging / self.index_name
        tmp.write_bytes(canonical_json(index))
        os.replace(tmp, index_path)
        for relpath in stale:
            (self.dest / relpath).unlink(missing_ok=True)
        for folder in sorted({(self.dest / p).parent for p in stale}, reverse=True):
            if folder != self.dest and folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


def _listed_files(index_path: Path) -> set[str]:
    try:
        return set(json.loads(index_path.read_text()).get("files", {}))
    except (OSError, ValueError, AttributeError):
        return set()
