"""Custom operators end to end: a model using `torch.library.custom_op` (examples/custom_op.py, op
library examples/custom_ops.py) builds, trains under torchrun like eager DDP, and exports to ONNX
through the model file's translation; the artifact names the op library and the runner imports it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.commands import EXAMPLES, MODELS, REFERENCE, REPO, aot, clean_env, ok, show, torchrun
from helpers.inference import assert_user_error, eager_model, load_user, max_diff

import runner.execution.infer
from runner.execution.custom_ops import import_op_libraries
from runner.errors import AotError

MODEL = EXAMPLES / "custom_op.py"
NO_ONNX = MODELS / "custom_op_no_onnx.py"
STEPS = 3
OP = "aot_examples::swish"

if str(REPO) not in sys.path:  # the model files import the op library as examples.custom_ops
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    art = tmp_path_factory.mktemp("custom_op") / "art"
    ok(aot("build", MODEL, "--world-size", 2, "--batch-size", 4, "-o", art, "--quiet"))
    return art


@pytest.fixture(scope="module")
def no_onnx_artifact(tmp_path_factory):
    """tests/models/custom_op_no_onnx.py (no ONNX translation) built with --no-onnx for one rank."""
    art = tmp_path_factory.mktemp("custom_op_no_onnx") / "art"
    r = ok(aot("build", NO_ONNX, "--no-onnx", "-o", art))
    assert "[6/6]" in r.stderr and "ONNX" not in r.stderr, show(r)  # one stage fewer than with ONNX
    return art


def test_manifest_names_the_op_library_and_onnx_uses_the_translation(artifact):
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["custom_ops"] == {"ops": [OP], "modules": ["examples.custom_ops"]}
    assert manifest["inference"]["custom_ops"] == [OP]
    import onnx

    proto = onnx.load_from_string((artifact / "inference" / "model.onnx").read_bytes())
    assert {n.op_type for n in proto.graph.node} >= {"Sigmoid", "Mul"}  # the translation, inlined
    user = load_user(MODEL)
    model = eager_model(user)
    session = runner.execution.infer.load(artifact, "cpu")
    for batch_size in (1, 6):
        inputs, _ = user.batch(batch_size)
        with torch.no_grad():
            expected = model(inputs)
        assert max_diff(session.run(inputs)["outputs"], expected) <= 1e-4


def test_trains_under_torchrun_like_eager_ddp(artifact, tmp_path):
    metrics, ckpt, ref, merged = tmp_path / "m.jsonl", tmp_path / "ckpt", tmp_path / "ref", tmp_path / "merged.safetensors"
    ok(torchrun(2, "run", artifact, "--steps", STEPS, "--metrics", metrics, "--save", ckpt, "--quiet"))
    ok(torchrun(2, REFERENCE, MODEL, artifact / "data" / "example_batch.safetensors", ref, "--steps", STEPS, "--batch-size", 4, module=None))
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    ref_losses = json.loads((ref / "losses.json").read_text())
    assert len(losses) == len(ref_losses) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)
    assert losses[-1] < losses[0]
    ok(aot("checkpoint", "merge", ckpt, "-o", merged))
    weights, ref_weights = load_file(merged), load_file(ref / "state_dict.safetensors")
    assert sorted(weights) == sorted(ref_weights)
    assert max(max_diff(weights[k], ref_weights[k]) for k in ref_weights) <= 1e-5
    # the op's slope trained through its registered backward
    assert not torch.equal(weights["1.beta"], torch.ones(64))


def test_runner_cannot_import_the_op_library(no_onnx_artifact, tmp_path):
    """Run from a folder where `examples` is not importable: one line naming the module and the op."""
    env = clean_env()
    env["PYTHONPATH"] = ""  # aot itself is installed; the op library is not
    r = subprocess.run(
        [sys.executable, "-m", "aot", "run", no_onnx_artifact, "--steps", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert_user_error(r, "examples.custom_ops", OP, "cannot be imported here", "PYTHONPATH")


def test_import_op_libraries_checks_modules_and_ops():
    assert import_op_libraries({}) == []
    assert import_op_libraries({"custom_ops": {"modules": ["examples.custom_ops"], "ops": [OP]}}) == ["examples.custom_ops"]
    with pytest.raises(AotError, match="'no_such_op_library', which cannot be imported"):
        import_op_libraries({"custom_ops": {"modules": ["no_such_op_library"], "ops": [OP]}})
    with pytest.raises(AotError, match="aot_examples::nope is not registered"):
        import_op_libraries({"custom_ops": {"modules": ["examples.custom_ops"], "ops": ["aot_examples::nope"]}})
    with pytest.raises(AotError, match="custom_ops needs modules and ops"):
        import_op_libraries({"custom_ops": {"modules": "examples.custom_ops"}})


def test_no_translation_warns_by_default_and_fails_when_onnx_is_asked_for():
    from aot.capture.model_file import load_model_file
    from aot.emit.onnx_export import OnnxUnsupported, build_inference

    mf = load_model_file(NO_ONNX)
    torch.manual_seed(0)
    model, (inputs, _) = mf.model(), mf.batch(4)
    warnings = []
    assert build_inference(mf, model, [inputs], required=False, warn=warnings.append) is None
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert f"custom operator {OP} has no ONNX translation" in warnings[0] and "onnx_translations" in warnings[0]
    with pytest.raises(OnnxUnsupported, match=f"no ONNX export: custom operator {OP} has no ONNX translation"):
        build_inference(mf, model, [inputs], required=True, warn=warnings.append)


def test_artifact_without_inference_export(no_onnx_artifact, tmp_path):
    manifest = json.loads((no_onnx_artifact / "manifest.json").read_text())
    assert "inference" not in manifest and manifest["custom_ops"]["ops"] == [OP]
    batch = tmp_path / "batch.safetensors"
    save_file({"inputs": torch.zeros(2, 8)}, batch)
    assert_user_error(aot("infer", no_onnx_artifact, "--input", batch), "has no inference export", "--no-onnx")


def test_custom_op_defined_in_the_model_file_is_refused():
    from aot.capture.custom_ops import custom_op_spec
    from aot.capture.model_file import load_model_file

    mf = load_model_file(MODELS / "bad_custom_op_in_model_file.py")
    torch.manual_seed(0)
    inputs, _ = mf.batch(2)
    ep = torch.export.export(mf.model(), (inputs,))
    with pytest.raises(AotError, match="aot_tests_inline::double is defined in the model file itself"):
        custom_op_spec(mf, ep.graph)


def test_custom_op_modules_must_be_importable(tmp_path):
    from aot.capture.custom_ops import custom_op_spec
    from aot.capture.model_file import load_model_file

    model_file = tmp_path / "model.py"
    model_file.write_text(NO_ONNX.read_text() + '\ncustom_op_modules = ["examples.no_such_module"]\n')
    mf = load_model_file(model_file)
    with pytest.raises(AotError, match="custom_op_modules names 'examples.no_such_module', which cannot be imported"):
        custom_op_spec(mf, torch.fx.Graph())
