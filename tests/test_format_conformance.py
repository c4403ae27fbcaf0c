"""manifest.json against its JSON Schema (runner/format/manifest.schema.json), and the golden artifact.

Every manifest the build writes for a small matrix of strategies validates against the schema,
and the schema is not vacuous: each field the runner's own structural check requires, removed
or given a wrong type, fails the schema and is refused by the runner (runner.format.artifact.Artifact),
which names the place. The golden artifact (tests/fixtures/artifact_v7_mlp, built by the aot of
format 7) loads in the current runner, validates, and trains to the losses written below, the
same as eager PyTorch in the same test.
"""

from __future__ import annotations

import copy
import json
from importlib import resources

import jsonschema
import pytest
import torch
from referencing import Registry
from referencing.jsonschema import DRAFT202012

import runner
from helpers.artifacts import writable_copy
from helpers.commands import EXAMPLES, FIXTURES, MODELS
from helpers.training import eager_single_process
from runner.format import artifact as spec
from runner.format.artifact import Artifact, manifest_digest
from runner.errors import AotError

SCHEMA = json.loads(resources.files("runner.format").joinpath("manifest.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
REGISTRY = Registry().with_resource(SCHEMA["$id"], DRAFT202012.create_resource(SCHEMA))

BUILDS = {  # name -> aot build arguments (--quiet and -o added); one keeps the ONNX export
    "mlp": (EXAMPLES / "mlp.py",),
    "mlp-dp2": (EXAMPLES / "mlp.py", "--world-size", 2, "--strategy", "dp=2", "--no-onnx"),
    "mlp-fsdp2": (EXAMPLES / "mlp.py", "--world-size", 2, "--strategy", "fsdp=2", "--no-onnx"),
    "gpt-tp2": (EXAMPLES / "gpt.py", "--world-size", 2, "--strategy", "tp=2", "--batch-size", 2, "--no-onnx"),
    # as tests/test_pipeline.py builds it
    "gpt4-pp2": (
        MODELS / "gpt4.py",
        "--world-size",
        2,
        "--strategy",
        "pp=2",
        "--pp-schedule",
        "interleaved-1f1b",
        "--microbatches",
        4,
        "--batch-size",
        4,
        "--no-onnx",
    ),
    # as tests/test_mixed_precision.py builds it on the CPU
    "mlp-bf16": (EXAMPLES / "mlp.py", "--topology", "cpu", "--precision", "bf16", "--no-onnx"),
    "convnet-syncbn-dp2": (MODELS / "convnet_syncbn.py", "--world-size", 2, "--strategy", "dp=2", "--batch-size", 4, "--no-onnx"),
    # fused tensor-parallel layers (tensor_parallel.fused, format 6): GPT-2's c_attn
    "hf-gpt2-tp2": (MODELS / "hf_gpt2.py", "--world-size", 2, "--strategy", "tp=2", "--no-onnx"),
    # expert parallelism (expert_parallel, format 7), as tests/test_expert_parallel.py builds it
    "moe-ep2": (MODELS / "zoo" / "qwen3_moe_sgd.py", "--world-size", 2, "--strategy", "ep=2", "--batch-size", 4, "--no-onnx", "--no-eval"),
    # a capacity (expert_parallel.capacity an object) and its program output moe_dropped
    "moe-ep2-capacity": (MODELS / "zoo" / "qwen3_moe_sgd.py", "--world-size", 2, "--strategy", "ep=2", "--moe-capacity-factor", 1.0, "--no-onnx", "--no-eval"),
    # a ModuleList's experts stacked (state.stacked, capacity "model", format 8)
    "moe-list-ep2": (MODELS / "zoo" / "gshard_moe_sgd.py", "--world-size", 2, "--strategy", "ep=2", "--batch-size", 4, "--no-onnx", "--no-eval"),
}
GOLDEN = FIXTURES / "artifact_v7_mlp"
# What eager PyTorch computed on examples/mlp.py (torch.manual_seed(0), the example batch) for
# the first 5 steps, measured once with torch 2.13.0 on the CPU; the artifact gave the same bits.
GOLDEN_LOSSES = [2.2685635089874268, 2.1776123046875, 2.0583415031433105, 1.9123334884643555, 1.7299028635025024]


@pytest.fixture(scope="module")
def matrix(built) -> dict:
    """name -> BUILDS' artifact (the session's builds, shared with the files that build the same)."""
    return dict(zip(BUILDS, built.many(*BUILDS.values())))


def schema_errors(manifest: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or 'manifest'}: {e.message}" for e in VALIDATOR.iter_errors(manifest)]


def schema_errors_after_edit(manifest: dict, path: tuple) -> list[str]:
    """schema_errors of a valid manifest edited at `path`: below the top level only the entry
    holding it can have changed, so only that entry is validated (jsonschema takes half a second
    over the whole manifest of a pipeline: its programs list every input)."""
    if len(path) == 1:
        return schema_errors(manifest)
    entry = jsonschema.Draft202012Validator({"$ref": f"{SCHEMA['$id']}#/properties/{path[0]}"}, registry=REGISTRY)
    return [e.message for e in entry.iter_errors(manifest[path[0]])]


def test_the_schema_is_a_valid_draft_2020_12_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert SCHEMA["properties"]["format_version"]["enum"] == list(spec.READABLE_VERSIONS)


@pytest.mark.parametrize("name", BUILDS)
def test_every_built_manifest_validates(matrix, name):
    manifest = json.loads((matrix[name] / "manifest.json").read_text())
    assert manifest["format_version"] == spec.FORMAT_VERSION
    assert schema_errors(manifest) == []
    # each optional entry this matrix is meant to cover is really there
    expected = {
        "mlp": "inference",
        "mlp-fsdp2": "sharding",
        "gpt-tp2": "tensor_parallel",
        "gpt4-pp2": "pipeline",
        "convnet-syncbn-dp2": "batchnorm",
        "moe-ep2": "expert_parallel",
    }
    if name in expected:
        assert manifest[expected[name]] is not None
    if name == "moe-ep2-capacity":
        assert manifest["expert_parallel"]["capacity"]["rows"] > 0 and manifest["programs"]["train"]["outputs"][-1] == "moe_dropped"
    if name == "moe-list-ep2":
        assert manifest["expert_parallel"]["capacity"] == "model" and len(manifest["state"]["stacked"]) == 6
    if name == "mlp-bf16":
        assert manifest["precision"]["compute"] == "bf16"


REMOVE = object()  # a mutation that deletes the field
# values of another type (or sign): NUMBER and other tuples of types get null, none of them
WRONG = {int: ["1", -1, True], str: [1], bool: ["true"], dict: [[]]}


def _wrong_values(schema) -> list:
    if isinstance(schema, (dict, spec.Map)):
        return [[]]
    if isinstance(schema, list):
        return [{}]
    if isinstance(schema, spec.OneOf):
        return ["no-such-value"]
    return WRONG.get(schema, [None])


def _runner_fields(schema, value, path=(), abstract=()):
    """(path, its abstract path, the runner's schema there, whether the key is required) for
    every place the runner's structural check (runner/format/artifact.py's *_SCHEMA dicts) defines in
    `value`: each required key, the first entry of each list and map, each element of a
    fixed-length pair. The abstract path has "*" for map keys and list positions."""
    if isinstance(schema, dict) and isinstance(value, dict):
        for key, sub in schema.items():
            yield (*path, key), (*abstract, key), sub, True
            yield from _runner_fields(sub, value[key], (*path, key), (*abstract, key))
    elif isinstance(schema, spec.Map) and isinstance(value, dict) and value:
        key = next(iter(value))
        yield (*path, key), (*abstract, "*"), schema.schema, False
        yield from _runner_fields(schema.schema, value[key], (*path, key), (*abstract, "*"))
    elif isinstance(schema, list) and isinstance(value, list) and value:
        for i in range(len(schema) if len(schema) > 1 else 1):
            sub = schema[i] if len(schema) > 1 else schema[0]
            position = i if len(schema) > 1 else "*"
            yield (*path, i), (*abstract, position), sub, False
            yield from _runner_fields(sub, value[i], (*path, i), (*abstract, position))


def _checked_schemas(manifest: dict) -> list[tuple[tuple, tuple, object]]:
    """(path, abstract path, the runner's schema) where the runner's schemas apply in this
    manifest: the whole manifest's, each optional entry's when present, and each program
    input's by its kind (the first input of each kind)."""
    out = [((), (), spec.SCHEMA), ((), (), spec.INIT_SCHEMA), ((), (), spec.PRECISION_SCHEMA)]
    optional = {
        "inference": spec.INFERENCE_SCHEMA,
        "memory": spec.MEMORY_SCHEMA,
        "time": spec.TIME_SCHEMA,
        "pipeline": spec.PIPELINE_SCHEMA,
        "batchnorm": spec.BATCHNORM_SCHEMA,
        "expert_parallel": spec.EXPERT_PARALLEL_SCHEMA,
    }
    out += [((key,), (key,), schema) for key, schema in optional.items() if manifest.get(key) is not None]
    for name, program in manifest["programs"].items():
        first = {}
        for j, slot in enumerate(program["inputs"]):
            first.setdefault(slot["kind"], j)
        out += [(("programs", name, "inputs", j), ("programs", "*", "inputs", f"<{kind}>"), spec.SLOT_FIELDS[kind]) for kind, j in first.items()]
    return out


def _at(manifest, path):
    for key in path:
        manifest = manifest[key]
    return manifest


def _edited(manifest: dict, path: tuple, new) -> dict:
    out = copy.deepcopy(manifest)
    parent = _at(out, path[:-1])
    if new is REMOVE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return out


def _describe(path, new) -> str:
    return ".".join(map(str, path)) + (" removed" if new is REMOVE else f" = {new!r}")


def runner_field_mutations(manifest: dict) -> list[tuple[tuple, tuple, object]]:
    """(path, abstract path, new value or REMOVE): each field the runner's schemas require
    removed, and each place they define given values of a wrong type."""
    out = {}
    for base, abstract_base, schema in _checked_schemas(manifest):
        for rel, abstract, sub, required in _runner_fields(schema, _at(manifest, base)):
            out.setdefault((*base, *rel), ((*abstract_base, *abstract), ([REMOVE] if required else []) + _wrong_values(sub)))
    return [(path, abstract, new) for path, (abstract, values) in out.items() for new in values]


# Fields the runner checks inline rather than in a *_SCHEMA dict, and the version bounds (each
# applied where its parent exists in the manifest).
HAND_MUTATIONS = [
    (("format_version",), spec.READABLE_VERSIONS[0] - 1),
    (("format_version",), spec.FORMAT_VERSION + 1),
    (("format",), "aot-checkpoint"),
    (("torch_version",), REMOVE),
    (("digest",), REMOVE),
    (("build", "seed"), "0"),
    (("sharding", "size"), "2"),
    (("sharding", "params", "0.weight"), -1),
    (("tensor_parallel", "sequence_parallel"), REMOVE),
    (("tensor_parallel", "plan", "blocks.0.attn.q"), 0),
    (("placement", "physical_rank_of_mesh_rank"), REMOVE),
    (("placement", "axes_outer_to_inner"), "dp"),
    (("custom_ops",), {"ops": []}),
    (("precision", "grad_scaler"), {"init_scale": 65536.0}),
    (("process_groups", "aot.dp", "groups", 0, 0), "0"),
]


def _applies(manifest: dict, path: tuple) -> bool:
    try:
        parent = _at(manifest, path[:-1])
    except (KeyError, IndexError, TypeError):
        return False
    return isinstance(parent, dict) or isinstance(parent, list) and path[-1] < len(parent)


def runner_refusal(folder, manifest: dict) -> str | None:
    """The runner's one line about this manifest in a copy of the artifact, or None if it
    accepts it. The digest is rewritten to match (as in tests/test_integrity_and_signing.py), so
    the structural check, not the digest, is what answers."""
    if "digest" in manifest:
        manifest = {**manifest, "digest": manifest_digest(manifest)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    try:
        Artifact(folder)
    except AotError as e:
        return str(e)
    return None


def test_the_schema_and_the_runner_refuse_the_same_broken_manifests(matrix, tmp_path):
    """Each mutation once, on the smallest manifest of the matrix that has the field."""
    done, failures = set(), []
    for name in sorted(BUILDS, key=lambda name: (matrix[name] / "manifest.json").stat().st_size):
        folder = writable_copy(matrix[name], tmp_path / name)
        manifest = json.loads((folder / "manifest.json").read_text())
        assert runner_refusal(folder, manifest) is None  # the copy, digest rewritten, loads as built
        cases = runner_field_mutations(manifest)
        cases += [(path, path, new) for path, new in HAND_MUTATIONS if _applies(manifest, path)]
        for path, abstract, new in cases:
            if _describe(abstract, new) in done:
                continue
            done.add(_describe(abstract, new))
            what, mutated = f"{name}: {_describe(path, new)}", _edited(manifest, path, new)
            if not schema_errors_after_edit(mutated, path):
                failures.append(f"{what}: the schema accepts it")
            refusal = runner_refusal(folder, mutated)
            named = [str(k) for k in path if not isinstance(k, int)][-2:]
            if refusal is None:
                failures.append(f"{what}: the runner accepts it")
            elif "\n" in refusal or not any(k in refusal or k.replace("_", " ") in refusal for k in named):
                failures.append(f"{what}: the runner's refusal is not one line naming {named}: {refusal}")
    assert len(done) > 250, len(done)
    assert not failures, "\n".join(failures)


def test_a_version_7_manifest_has_no_stacked_experts(matrix, tmp_path):
    """FORMAT.md "Version 7": a version-7 artifact has no `state.stacked` (a ModuleList's experts
    stacked under ep, version 8); the schema and the runner say so, and a version-7 manifest
    without one is valid."""
    folder = writable_copy(matrix["moe-ep2"], tmp_path / "moe")
    manifest = json.loads((folder / "manifest.json").read_text())
    name = manifest["expert_parallel"]["params"][0]
    rows = manifest["state"]["params"][name][0][0]
    stacked = {**manifest, "state": {**manifest["state"], "stacked": {name: manifest["state"]["state_dict_keys"][:rows]}}}
    assert schema_errors(stacked) == []
    assert schema_errors({**stacked, "format_version": 7})
    refusal = runner_refusal(folder, {**stacked, "format_version": 7})
    assert refusal is not None and "state.stacked is version 8" in refusal, refusal
    assert schema_errors({**manifest, "format_version": 7}) == []


def test_the_golden_artifact_of_the_format_before_loads_validates_and_trains_to_known_losses():
    """An artifact built by the aot of format 7 runs in this runner (the compatibility window),
    its manifest conforms, and its training is what it was: the losses eager PyTorch gave when the
    test was written, and eager PyTorch now. (tests/test_artifact_and_runner.py checks the Python
    API the same way on a freshly built format-8 artifact.)"""
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    # a format bump moves the window: replace the fixture with an artifact of the version before
    assert manifest["format_version"] == spec.READABLE_VERSIONS[0] == 7, "rebuild the golden artifact"
    assert schema_errors(manifest) == []
    trainer = runner.load(GOLDEN, rank=0, world_size=1)
    assert trainer.artifact.manifest == manifest
    source = trainer.data_source()
    batches = [source.batch(step) for step in range(len(GOLDEN_LOSSES))]
    losses = [trainer.step(inputs, targets) for inputs, targets in batches]
    eager, eager_state = eager_single_process(EXAMPLES / "mlp.py", batches, seed=manifest["build"]["seed"])
    assert max(abs(a - b) for a, b in zip(losses, GOLDEN_LOSSES)) <= 1e-6, losses
    assert max(abs(a - b) for a, b in zip(losses, eager)) <= 1e-6, (losses, eager)
    state = trainer.state_dict()
    assert list(state) == list(eager_state)
    for key, value in eager_state.items():
        assert torch.allclose(state[key], value, atol=1e-6), key


@pytest.mark.parametrize("program", ["train", "init"])
def test_program_json_is_torchs_serializer_output_with_the_debug_metadata_dropped(program):
    """encode_program turns the serde's schema objects into JSON with its own converter (torch's
    reflects on every object: half of a large build's writing); the bytes must be those of
    torch's own serializer, made reproducible as before."""
    from runner.format import program as codec

    folder = FIXTURES / "artifact_v7_mlp" / "programs"
    constants = folder / f"{program}.safetensors"
    ep = codec.decode_program((folder / f"{program}.json").read_bytes(), constants.read_bytes() if constants.exists() else None)
    ours, _ = codec.encode_program(ep)
    serde = codec._serde()
    with codec._no_canonical_form_check(serde):
        theirs = codec._reproducible(serde.serialize(ep, **codec._no_pickled_tables(serde)).exported_program)
    assert ours == theirs
