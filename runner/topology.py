"""Topology profiles: what hardware an artifact was built for, and the check of the live machine.

A profile is JSON (schema "aot-topology"). Built-in profiles ship in runner/profiles/ and are named
by file stem; any other profile is a path to a JSON file. The runner compares the live machine
with the profile embedded in the artifact before its first collective.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from runner.errors import AotError
from runner.integrity import canonical_json, sha256_bytes

SCHEMA = "aot-topology"
SCHEMA_VERSION = 1
BUILTIN_DIR = Path(__file__).parent / "profiles"
DEVICE_KINDS = ("cpu", "cuda")


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


def load_profile(name_or_path: str) -> dict:
    """A validated profile from a built-in name or a JSON file path."""
    path = Path(name_or_path)
    if not path.suffix and (BUILTIN_DIR / f"{name_or_path}.json").is_file():
        path = BUILTIN_DIR / f"{name_or_path}.json"
    elif not path.is_file():
        raise AotError(
            f"topology {name_or_path!r}: no such file and no built-in profile of that name "
            f"(built-in: {', '.join(builtin_names())})"
        )
    try:
        profile = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise AotError(f"{path}: not valid JSON ({e})") from None
    validate_profile(profile, str(path))
    return profile


def validate_profile(profile: dict, where: str) -> None:
    if not isinstance(profile, dict) or profile.get("schema") != SCHEMA:
        raise AotError(f"{where}: not a topology profile (field 'schema' must be {SCHEMA!r})")
    if profile.get("schema_version") != SCHEMA_VERSION:
        raise AotError(f"{where}: topology schema version {profile.get('schema_version')!r}, this aot reads {SCHEMA_VERSION}")
    if not isinstance(profile.get("name"), str):
        raise AotError(f"{where}: field 'name' must be a string")
    if profile.get("device_kind") not in DEVICE_KINDS:
        raise AotError(f"{where}: field 'device_kind' must be one of {', '.join(DEVICE_KINDS)}")
    nodes = profile.get("nodes")
    if not isinstance(nodes, int) or nodes < 1:
        raise AotError(f"{where}: field 'nodes' must be a positive integer")
    if not isinstance(profile.get("node", {}).get("gpus"), list):
        raise AotError(f"{where}: field 'node.gpus' must be a list")


def profile_sha256(profile: dict) -> str:
    return sha256_bytes(canonical_json(profile))


def live_profile() -> dict:
    """The profile of this machine as far as torch sees it (the NVML probe refines this)."""
    if torch.cuda.is_available():
        gpus = [
            {"index": i, "name": torch.cuda.get_device_name(i),
             "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
            for i in range(torch.cuda.device_count())
        ]
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "name": "live", "device_kind": "cuda",
                "backend": "nccl", "nodes": 1, "node": {"gpus": gpus}}
    return load_profile("cpu")


def mismatches(profile: dict, live: dict) -> list[str]:
    """One line per difference that would make the artifact's schedule wrong for this machine."""
    lines = []
    if profile["device_kind"] == "cuda" and live["device_kind"] != "cuda":
        lines.append(f"profile {profile['name']!r} expects CUDA GPUs; this machine has none")
    elif profile["device_kind"] == "cuda":
        want, got = len(profile["node"]["gpus"]), len(live["node"]["gpus"])
        if want != got:
            lines.append(f"profile {profile['name']!r} expects {want} GPUs per node; this machine has {got}")
    return lines
