"""Artifacts built once per test session and shared by every test that builds the same thing.

A build is byte-identical for the same model file and arguments (tests/test_integrity_and_signing.py
checks it), so a test that needs "examples/mlp.py built for 2 ranks" and does not test the build
itself takes the session's copy: `built(EXAMPLES / "mlp.py", "--world-size", 2, "--no-onnx")`.
The key is what the build command makes of its arguments (click's parse of `aot build`: defaults
filled in, option order and spelling irrelevant) and the model file's bytes, so two tests that
write the same build differently still share it. Builds run as `aot build` does (forked from the
tests' fork server, helpers/commands.py), without the progress display.

A shared artifact is read-only (files 0444, folders 0555): a test that alters one (tampers with a
file, signs it, rebuilds over it) works on `writable_copy(path, where)`, and one that forgets gets
a PermissionError instead of spoiling the artifact for the tests after it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from helpers.commands import aot, ok

# what a build's output does not depend on
_NOT_KEYED = ("output", "quiet", "as_json")


def build_key(model, args) -> str:
    """A digest of the model file's bytes and the build options `aot build MODEL ARGS` parses to."""
    from aot.cli import build as command, default_world_size

    ctx = command.make_context("build", [str(model), *map(str, args), "-o", "unused"])
    params = dict(ctx.params)
    if params["world_size"] is None:  # what the command fills in (aot/cli.py: build)
        params["world_size"] = default_world_size(params["strategy"], params["topology"], params["nodes"])
    params = {k: str(v) for k, v in sorted(params.items()) if k not in _NOT_KEYED}
    params["model_file"] = str(Path(model).resolve())
    text = json.dumps(params, sort_keys=True) + hashlib.sha256(Path(model).read_bytes()).hexdigest()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _set_read_only(folder: Path, read_only: bool) -> None:
    for path in [*folder.rglob("*"), folder]:
        if path.is_file():
            path.chmod(0o444 if read_only else 0o644)
        elif path.is_dir():
            path.chmod(0o555 if read_only else 0o755)


def writable_copy(artifact: Path, where: Path) -> Path:
    """A copy of `artifact` at `where` (a new or an empty folder) that a test may alter."""
    shutil.copytree(artifact, where, dirs_exist_ok=True)
    for path in [where, *where.rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return where


class ArtifactCache:
    """built(model, *args) -> the folder of `aot build model *args`, built once per session."""

    def __init__(self, root: Path):
        self.root = root
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def __call__(self, model, *args) -> Path:
        key = build_key(model, args)
        out = self.root / f"{Path(model).stem}-{key}"
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if not (out / "manifest.json").is_file():
                ok(aot("build", model, *args, "-o", out, "--quiet"))
                _set_read_only(out, True)
        return out

    def many(self, *builds: tuple) -> list[Path]:
        """built(*b) for each tuple b (model, *args), two builds at a time (a build is mostly one
        core's work, and the machine has two); folders in the order given."""
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda b: self(*b), builds))

    def close(self) -> None:
        """Writable again, so the session's temporary folders can be removed as usual."""
        for folder in self.root.iterdir():
            if folder.is_dir() and not os.access(folder, os.W_OK):
                _set_read_only(folder, False)


_session: ArtifactCache | None = None


def open_session(root: Path) -> ArtifactCache:
    """The test session's cache (conftest.py's `built`), kept for helpers that build too."""
    global _session
    _session = ArtifactCache(root)
    return _session


def session_cache() -> ArtifactCache:
    assert _session is not None, "the session's artifact cache opens with conftest.py's `built` fixture"
    return _session
