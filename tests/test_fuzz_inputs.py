"""Generated bad inputs (hypothesis): every one is answered by AotError, the one-line user error,
and never by another exception (which the CLI would report as an internal error)."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as save_safetensors

from helpers.artifacts import writable_copy
from helpers.commands import EXAMPLES, REPO
from runner.format.artifact import Artifact, manifest_digest
from runner.execution.data import DataSource
from runner.errors import AotError
from runner.hardware.topology import load_profile

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def artifact_dir(built):
    """examples/mlp.py for one rank, with its ONNX export (the manifest's inference entry is fuzzed too)."""
    return built(EXAMPLES / "mlp.py")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8,
)


def paths_of(value, prefix=()):
    """Every path into a JSON value, for choosing what to break."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths_of(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):
            yield from paths_of(v, prefix + (i,))


@FUZZ
@given(data=st.data())
def test_damaged_manifests_give_one_line_errors(artifact_dir, tmp_path_factory, data):
    manifest = json.loads((artifact_dir / "manifest.json").read_text())
    paths = [p for p in paths_of(manifest) if p and p[0] not in ("digest",)]
    path = data.draw(st.sampled_from(paths))
    broken = copy.deepcopy(manifest)
    parent = broken
    for key in path[:-1]:
        parent = parent[key]
    if data.draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(json_values)
    broken["digest"] = manifest_digest(broken)  # consistent, so the structure checks are reached
    folder = writable_copy(artifact_dir, tmp_path_factory.mktemp("m"))
    (folder / "manifest.json").write_text(json.dumps(broken))
    try:
        artifact = Artifact(folder)
        # whatever survives validation must still read as an artifact or fail cleanly
        for rel in artifact.manifest["files"]:
            artifact.read(rel)
        import runner

        trainer = runner.load(folder, rank=0, world_size=1)
        inputs, targets = trainer.data_source().batch(0)
        trainer.step(inputs, targets)
    except AotError as e:
        assert "\n" not in str(e)


@pytest.mark.parametrize("value", [[], {}, 3])
def test_a_file_name_that_is_not_a_string_is_one_line(artifact_dir, tmp_path, value):
    """What the fuzzing above once found: init.constants set to a list made a TypeError."""
    manifest = json.loads((artifact_dir / "manifest.json").read_text())
    assert manifest.get("init") is not None
    manifest["init"]["constants"] = value
    manifest["digest"] = manifest_digest(manifest)
    folder = writable_copy(artifact_dir, tmp_path / "m")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(AotError, match="init.constants is not listed in files"):
        Artifact(folder)


@FUZZ
@given(profile=st.dictionaries(st.sampled_from(["schema", "schema_version", "name", "device_kind", "nodes", "node", "backend"]), json_values, max_size=7))
def test_generated_profiles_give_one_line_errors(tmp_path_factory, profile):
    path = tmp_path_factory.mktemp("p") / "profile.json"
    path.write_text(json.dumps(profile))
    try:
        load_profile(str(path))
    except AotError as e:
        assert "\n" not in str(e)


FUNCTIONS = {
    "model": [
        "def model():\n    return torch.nn.Linear(4, 2)\n",
        "model = 3\n",
        "def model():\n    return 3\n",
        "def model():\n    raise ValueError('no')\n",
        "",
    ],
    "batch": [
        "def batch(n):\n    return torch.randn(n, 4), torch.randint(0, 2, (n,))\n",
        "def batch(n):\n    return 1\n",
        "def batch(n):\n    return torch.randn(n, 5), torch.randint(0, 2, (n,))\n",
        "batch = None\n",
        "",
    ],
    "optimizer": ["def optimizer(p):\n    return torch.optim.SGD(p, lr=0.1)\n", "def optimizer(p):\n    return None\n", ""],
    "loss": ["def loss(o, t):\n    return o.sum()\n", "def loss(o, t):\n    return o\n", ""],
    "extra": ["max_grad_norm = 1.0\n", "max_grad_norm = 'x'\n", "max_grad_norm = -1\n", "import nonexistent_module_xyz\n", "x = (\n", ""],
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.fixed_dictionaries({k: st.sampled_from(v) for k, v in FUNCTIONS.items()}))
def test_generated_model_files_build_or_fail_in_one_line(tmp_path_factory, parts):
    folder = tmp_path_factory.mktemp("model")
    path = folder / "model.py"
    path.write_text("import torch\n" + "".join(parts.values()))
    from aot.build import BuildOptions, build
    from aot.progress import Progress

    out = folder / "art"
    try:
        build(BuildOptions(model_path=path, output=out, topology="cpu"), Progress(total=6, quiet=True))
        assert (out / "manifest.json").is_file()
    except AotError as e:
        assert "\n" not in str(e)
        assert not (out / "manifest.json").exists() and not list(out.glob(".staging-*"))


@FUZZ
@given(
    names=st.sampled_from([("inputs", "targets"), ("inputs.0", "targets"), ("x", "targets"), ("inputs",), ("inputs", "y")]),
    rows=st.integers(0, 6),
    width=st.sampled_from([32, 31, 0]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.int64]),
    target_dtype=st.sampled_from([torch.int64, torch.float32]),
)
def test_generated_data_files_load_or_fail_in_one_line(artifact_dir, tmp_path_factory, names, rows, width, dtype, target_dtype):
    spec = Artifact(artifact_dir).manifest["data"]
    tensors = {}
    for name in names:
        tensors[name] = torch.zeros((rows,), dtype=target_dtype) if name in ("targets", "y") else torch.zeros((rows, width), dtype=dtype)
    path = tmp_path_factory.mktemp("d") / "data.safetensors"
    path.write_bytes(save_safetensors(tensors))
    try:
        source = DataSource.from_file(path, spec, 0, 1)
        inputs, targets = source.batch(3)
        assert inputs[0].shape == (spec["batch_size"], 32) and targets.dtype == torch.int64
    except AotError as e:
        assert "\n" not in str(e)


# -- 1,000 seeded mutations of the fields added since format 3 (issue #45) ---------------------

NEW_FIELDS = ("precision", "memory", "plan", "init", "pipeline", "schedule", "time", "replicas", "state", "data")
MUTATIONS = 1000
VALUES = (None, True, False, 0, 1, -1, 2, 0.5, -3.5, 1e30, "", "x", "fp32", "bf16", "pp", [], {}, [1], {"a": 1})


def _is_state_value(path: tuple) -> bool:
    """A field whose value the runner takes as the artifact's data, so that changing it changes the
    training as the manifest says: an optimizer state's initial fill (a custom optimizer's may be
    any number), fp16 loss scaling's settings (within GradScaler's bounds, which the runner checks).
    Everything else a run accepts must leave the run as it was."""
    return (path[:2] == ("state", "optimizer_init") and path[-1] == "fill") or path[:2] == ("precision", "grad_scaler")


def _mutated(manifest: dict, rng) -> tuple[dict, tuple]:
    chosen = {k: manifest[k] for k in NEW_FIELDS if k in manifest}
    path = rng.choice([p for p in paths_of(chosen) if p])
    broken = copy.deepcopy(manifest)
    parent = broken
    for key in path[:-1]:
        parent = parent[key]
    if rng.random() < 0.3 and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = rng.choice(VALUES)
    broken["digest"] = manifest_digest(broken)  # consistent, so the structure checks are reached
    return broken, path


def _linked_copy(source, folder):
    """`source` at `folder`, every file hard-linked (nothing copied) but the manifest, to be written."""
    for path in source.rglob("*"):
        target = folder / path.relative_to(source)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.name != "manifest.json":
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)
    return folder


def _one_step(folder):
    import runner

    trainer = runner.load(folder, rank=0, world_size=1)
    inputs, targets = trainer.data_source().batch(0)
    loss = float(trainer.step(inputs, targets))
    return loss, {name: t.clone() for name, t in trainer._weights.items()}


@pytest.mark.slow
def test_a_thousand_mutations_of_the_new_fields_are_refused_in_one_line_or_run_as_the_original(built, tmp_path):
    """Precision (fp16 with its loss scaler), recomputation, the plan, init constants, a pipeline's
    entry: each of 1,000 seeded mutations (a field removed or given another value, the digest made
    consistent, as another builder would write it) is refused in one line, or the artifact runs a
    step equal to the original's (loss and weights). The pipeline artifact's mutations are read
    (manifest and every file), not run: a step needs both its ranks."""
    import random

    single = built(EXAMPLES / "mlp.py", "--precision", "fp16", "--activation-budget", 0.5, "--strategy", "auto", "--topology", "cpu", "--no-onnx")
    pipeline = built(REPO / "tests" / "models" / "gpt4.py", "--strategy", "pp=2", "--world-size", 2, "--no-onnx")
    original = _one_step(single)
    rng = random.Random(45)
    tally = {"refused": 0, "ran": 0, "read": 0}
    for i in range(MUTATIONS):
        source = pipeline if i % 2 else single
        manifest = json.loads((source / "manifest.json").read_text())
        broken, path = _mutated(manifest, rng)
        folder = _linked_copy(source, tmp_path / f"m{i}")
        (folder / "manifest.json").write_text(json.dumps(broken))
        try:
            artifact = Artifact(folder)
            for rel in artifact.manifest["files"]:
                artifact.read(rel)
            if source == pipeline:
                tally["read"] += 1
                continue
            loss, weights = _one_step(folder)
            tally["ran"] += 1
            if not _is_state_value(path):
                assert loss == original[0], (path, broken)
                assert all(torch.equal(weights[k], original[1][k]) for k in original[1]), (path, broken)
        except AotError as e:
            tally["refused"] += 1
            assert "\n" not in str(e), (path, str(e))
        finally:
            shutil.rmtree(folder)
    assert sum(tally.values()) == MUTATIONS and tally["refused"] > MUTATIONS // 2 and tally["ran"] > 25, tally
