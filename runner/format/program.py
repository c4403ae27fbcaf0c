"""Pickle-free (de)serialization of exported programs.

torch.export.save writes a zip whose example inputs and constants are torch.save pickles, and
torch.export.load falls back to unrestricted unpickling when a pickled entry fails to load. aot
never goes through either: a program is stored as the JSON of torch's export schema
(torch._export.serde) and its tensor constants as safetensors, and is rebuilt from those two
alone. No example inputs are stored, so weights are never duplicated inside a program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import typing

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
    with (
        _no_canonical_form_check(serde),
        _no_debug_listing(serde),
        _unions_made_directly(serde),
        _tensor_metas_shared(serde),
        _reproducible_json(serde) as direct,
    ):
        artifact = serde.serialize(ep, **_no_pickled_tables(serde))
    constants = save_safetensors(tensors) if tensors else None
    program = artifact.exported_program
    return (program if direct else _reproducible(program)), constants


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
    return _dumps(json.loads(program_json))


def _dumps(program: dict, encoder: type[json.JSONEncoder] | None = None) -> bytes:
    for node in program["graph_module"]["graph"]["nodes"]:
        node["metadata"] = {}
    return json.dumps(program, sort_keys=True, separators=(",", ":"), cls=encoder, allow_nan=False).encode()


@contextlib.contextmanager
def _reproducible_json(serde):
    """The serializer's last step, turning its schema objects into JSON, made directly in
    _reproducible's form (no metadata, keys sorted, compact) by a converter that reads each
    schema class's fields once: torch's reflects on every object (dataclasses.fields and the
    union's checked attribute access, millions of calls), 15 s of a DeepSeek-V3-sized build's
    30 s of writing, and its bytes were then parsed again to be made reproducible. Yields
    whether the direct form is in use (torch's without `_to_json_bytes` keeps its own, then
    _reproducible). tests/test_format_conformance.py checks the bytes equal torch's path."""
    original = getattr(serde, "_to_json_bytes", None)
    union = getattr(serde, "_Union", None)
    if original is None or union is None:
        yield False
        return
    read = object.__getattribute__  # the union's own __getattribute__ checks every read
    converters: dict[type, typing.Callable] = {}

    def plain(obj):
        convert = converters.get(type(obj))
        if convert is None:
            convert = converters[type(obj)] = converter(type(obj))
        return convert(obj)

    def converter(kind: type) -> typing.Callable:
        # one per class, chosen once: a large step's schema has millions of objects of a few dozen classes
        if issubclass(kind, union):

            def tagged(obj):
                tag = str(read(obj, "_type"))
                return {tag: plain(read(obj, tag))}

            return tagged
        if dataclasses.is_dataclass(kind):
            names = tuple(f.name for f in _fields(kind))
            fields = lambda obj: {name: plain(getattr(obj, name)) for name in names}  # noqa: E731
            if kind is not serde.TensorMeta:
                return fields
            done: dict[int, dict] = {}  # tensors' metadata objects are shared (_tensor_metas_shared): each converted once
            return lambda obj: done[id(obj)] if id(obj) in done else done.setdefault(id(obj), fields(obj))
        if issubclass(kind, (list, tuple)):
            return lambda obj: [plain(x) for x in obj]
        if issubclass(kind, dict):
            return lambda obj: {k: plain(v) for k, v in obj.items()}
        if issubclass(kind, float):
            return lambda obj: obj if math.isfinite(obj) else "NaN" if math.isnan(obj) else "Infinity" if obj > 0 else "-Infinity"
        return lambda obj: obj

    serde._to_json_bytes = lambda obj: _dumps(plain(obj), serde.EnumEncoder)  # enums as values, bytes as base64
    try:
        yield True
    finally:
        serde._to_json_bytes = original


@contextlib.contextmanager
def _no_debug_listing(serde):
    """The serializer passes a listing of the whole graph module (print_readable) to a debug log
    call, made whether the log is on or not: 3 s of a DeepSeek-V3-sized build. While the log is
    off, the listing is not made."""
    import logging

    if serde.log.isEnabledFor(logging.DEBUG):
        yield
        return
    listing = torch.fx.GraphModule.print_readable
    torch.fx.GraphModule.print_readable = lambda self, *args, **kwargs: ""  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.fx.GraphModule.print_readable = listing  # type: ignore[method-assign]


@contextlib.contextmanager
def _unions_made_directly(serde):
    """The schema union's create() builds each object through the dataclass's __init__ with every
    field named, its __post_init__ and the union's checked attribute access, calling
    dataclasses.fields on the way: 10 s of writing a DeepSeek-V3-sized step's hundreds of
    thousands of unions. While a program is written, a union is made directly: its fields None
    but the one set, and its tag (the same object state create() leaves, the tag checked
    against the class's fields as __init__ would)."""
    from torch._export.serde import union

    original = union._Union.__dict__["create"]

    def create(cls, /, **kwargs):
        if len(kwargs) != 1:
            raise AssertionError(f"expected exactly 1 kwarg, got {len(kwargs)}")
        ((tag, value),) = kwargs.items()
        unset = _unset_fields(cls)
        if tag not in unset:
            raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword argument {tag!r}")
        obj = object.__new__(cls)
        state = object.__getattribute__(obj, "__dict__")
        state.update(unset)
        state[tag] = value
        state["_type"] = union._UnionTag.create(tag, cls)
        return obj

    union._Union.create = classmethod(create)  # type: ignore[assignment, method-assign]
    try:
        yield
    finally:
        union._Union.create = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _tensor_metas_shared(serde):
    """Every tensor's metadata (dtype, sizes, strides, ...) is written as a schema object made
    anew, a union per size and stride: a third of writing a large step, whose tensors have a few
    thousand distinct metadata among tens of thousands. While a program is written, tensors of
    the same (static) metadata share one object; the JSON is the same."""
    original = serde.serialize_tensor_meta
    made: dict[tuple, object] = {}

    def shared(t: torch.Tensor):
        shape, stride, offset = tuple(t.shape), t.stride(), t.storage_offset()
        if not all(type(x) is int for x in (*shape, *stride, offset)):  # symbolic sizes: torch's own
            return original(t)
        key = (t.dtype, shape, stride, offset, t.requires_grad, t.device, t.layout)
        meta = made.get(key)
        if meta is None:
            meta = made[key] = original(t)
        return meta

    serde.serialize_tensor_meta = shared
    try:
        yield
    finally:
        serde.serialize_tensor_meta = original


@functools.cache
def _unset_fields(kind: type) -> dict[str, None]:
    """Every field of a schema union, None."""
    return dict.fromkeys(f.name for f in _fields(kind))


@functools.cache
def _fields(kind: type) -> tuple[dataclasses.Field, ...]:
    """dataclasses.fields of a schema class, read once per class."""
    return dataclasses.fields(kind)


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
