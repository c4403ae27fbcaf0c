"""Pickle-free (de)serialization of exported programs.

torch.export.save writes a zip whose example inputs and constants are torch.save pickles, and
torch.export.load falls back to unrestricted unpickling when a pickled entry fails to load. aot
never goes through either: a program is stored as the JSON of torch's export schema
(torch._export.serde) and its tensor constants as safetensors, and is rebuilt from those two
alone. No example inputs are stored, so weights are never duplicated inside a program.
"""

from __future__ import annotations

import contextlib
import json

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from runner.errors import AotError


def _serde():
    # imported on use: it pulls in torch._dynamo, seconds a runner's start-up should not pay
    from torch._export.serde import serialize

    return serialize


def encode_program(ep: torch.export.ExportedProgram) -> tuple[bytes, bytes | None]:
    """(program JSON, constants safetensors or None) for an exported program."""
    serde = _serde()
    # Keys are prefixed by the table they belong to, since the deserializer takes the two apart.
    tensors: dict[str, torch.Tensor] = {}
    for table, entries in (("state_dict", ep.state_dict), ("constants", ep.constants)):
        for name, value in entries.items():
            if not isinstance(value, torch.Tensor):
                raise AotError(f"program constant {name!r} is a {type(value).__name__}; only tensors can be stored")
            tensors[f"{table}/{name}"] = value.detach().contiguous().cpu()
    with _no_canonical_form_check(serde):
        artifact = serde.serialize(ep, **_no_pickled_tables(serde))
    constants = save_safetensors(tensors) if tensors else None
    return _reproducible(artifact.exported_program), constants


def _no_pickled_tables(serde) -> dict[str, bool]:
    """serialize()'s switches that skip torch.save of the weights, constants and example inputs
    (only the program JSON is kept). Torch before 2.12 (the GPU machine's 2.11) has none of them
    and always pickles the three; the bytes are then made and dropped, never stored."""
    import inspect

    accepted = inspect.signature(serde.serialize).parameters
    return {k: False for k in ("serialize_state_dict", "serialize_constants", "serialize_example_inputs") if k in accepted}


@contextlib.contextmanager
def _no_canonical_form_check(serde):
    """The serializer canonicalizes a deep copy of the program only to test that it can, and
    discards the result: for an 8B-parameter model's step that is 45 s of a build (most of it
    deepcopy). The bytes written do not change; _reproducible makes them deterministic."""
    check = serde.canonicalize
    serde.canonicalize = lambda program, constants=None: program
    try:
        yield
    finally:
        serde.canonicalize = check


def _reproducible(program_json: bytes) -> bytes:
    """Drop per-node debug metadata (source stack traces, Python object ids of the tracing
    session): nothing at run time reads it, and it would make two identical builds differ."""
    program = json.loads(program_json)
    for node in program["graph_module"]["graph"]["nodes"]:
        node["metadata"] = {}
    return json.dumps(program, sort_keys=True, separators=(",", ":")).encode()


def decode_program(program_json: bytes, constants: bytes | None) -> torch.export.ExportedProgram:
    serde = _serde()
    tables: dict[str, dict[str, torch.Tensor]] = {"state_dict": {}, "constants": {}}
    for key, value in (load_safetensors(constants) if constants else {}).items():
        table, _, name = key.partition("/")
        if table not in tables:
            raise AotError(f"program constants hold an entry {key!r} of no known table")
        tables[table][name] = value
    artifact = serde.SerializedArtifact(program_json, tables["state_dict"], tables["constants"], b"")
    try:
        with _type_hints_cached(serde):
            return serde.deserialize(artifact)
    except Exception as e:  # the serde raises plain exceptions for schema mismatches
        raise AotError(f"program could not be deserialized: {e}") from e


@contextlib.contextmanager
def _type_hints_cached(serde):
    """torch 2.13's deserializer calls typing.get_type_hints for every schema object it makes
    (thousands per program: about half of a runner's program load, measured 1.04 s -> 0.56 s for
    a 1,132-node pipeline program). The hints of a schema class never change, so while a program
    is read the serde module sees a `typing` whose get_type_hints remembers them per class."""
    import types
    import typing

    schema_globals = vars(serde.schema)
    hints: dict = {}

    def get_type_hints(obj, globalns=None, localns=None, include_extras=False):
        if globalns is not schema_globals or localns is not None or include_extras:
            return typing.get_type_hints(obj, globalns, localns, include_extras)
        if obj not in hints:
            hints[obj] = typing.get_type_hints(obj, globalns)
        return hints[obj]

    cached = types.ModuleType("typing")
    cached.__dict__.update(vars(typing))
    cached.get_type_hints = get_type_hints  # type: ignore[attr-defined]
    original = serde.typing
    serde.typing = cached
    try:
        yield
    finally:
        serde.typing = original
