"""Exported inference: `aot build` exports the forward to ONNX; `aot infer` runs it with ONNX Runtime.

The reference is always eager PyTorch on the same model file and weights, loaded here with
importlib (not through aot). ONNX Runtime must agree within 1e-4 at the example batch size and at
other batch sizes (the batch dimension is dynamic), for the initial weights of a build and for a
checkpoint's trained weights exported by `aot export`. Bad input is one `aot: error:` line.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.commands import EXAMPLES, REPO, aot, clean_env, ok, show
from helpers.inference import assert_user_error, eager_model, load_user, max_diff

import runner
import runner.artifact
import runner.infer
from runner.errors import AotError

TOL = 1e-4
GPT = EXAMPLES / "gpt.py"
MLP = EXAMPLES / "mlp.py"


@pytest.fixture(scope="module")
def gpt():
    return load_user(GPT)


@pytest.fixture(scope="module")
def gpt_artifact(tmp_path_factory):
    """examples/gpt.py built with the default ONNX export, batch 4 per rank."""
    art = tmp_path_factory.mktemp("onnx") / "gpt"
    r = ok(aot("build", GPT, "--batch-size", 4, "-o", art))
    assert "[7/7]" in r.stderr and "ONNX" in r.stderr, show(r)  # one more stage than without ONNX
    return art


def test_build_exports_onnx_that_matches_eager_at_any_batch_size(gpt_artifact, gpt):
    manifest = json.loads((gpt_artifact / "manifest.json").read_text())
    inference = manifest["inference"]
    assert inference["file"] == "inference/model.onnx" and inference["file"] in manifest["files"]
    assert inference["inputs"] == [{"name": "inputs", "shape": ["batch", 64], "dtype": "int64"}]
    assert inference["outputs"] == [{"name": "outputs", "shape": ["batch", 64, 96], "dtype": "float32"}]
    assert inference["batch_dim"] == "batch" and isinstance(inference["opset"], int)
    assert 0 <= inference["max_abs_diff"] <= TOL
    assert manifest["format_version"] == runner.artifact.FORMAT_VERSION

    # protobuf that onnx accepts, with the weights inside: no pickle, no zip, no external data
    import onnx
    data = (gpt_artifact / inference["file"]).read_bytes()
    assert data[:1] != b"\x80" and data[:2] != b"PK"
    proto = onnx.load_from_string(data)
    onnx.checker.check_model(proto)
    assert not any(init.data_location == onnx.TensorProto.EXTERNAL for init in proto.graph.initializer)

    session = runner.infer.load(gpt_artifact, "cpu")
    assert session.provider == "cpu" and session.input_names == ["inputs"]
    model = eager_model(gpt)
    for batch_size in (4, 1, 7):  # the example batch, one sample, another size
        inputs, _ = gpt.batch(batch_size)
        with torch.no_grad():
            expected = model(inputs)
        got = session.run({"inputs": inputs})["outputs"]
        assert max_diff(got, expected) <= TOL, batch_size


def test_aot_infer_end_to_end(gpt_artifact, gpt, tmp_path):
    inputs, targets = gpt.batch(3)
    batch = tmp_path / "batch.safetensors"
    save_file({"inputs": inputs, "targets": targets}, batch)  # a --data file: targets are ignored
    out = tmp_path / "out" / "logits.safetensors"
    r = ok(aot("infer", gpt_artifact, "--input", batch, "-o", out, "--warmup", 2, "--iters", 5, "--json"))
    timing = json.loads(r.stdout)
    assert timing["provider"] == "CPUExecutionProvider" and timing["batch_size"] == 3
    assert timing["iters"] == 5 and timing["warmup"] == 2
    assert 0 < timing["latency_ms_p50"] <= timing["latency_ms_p90"] and timing["samples_per_s"] > 0
    # no GPU here: the fallback from TensorRT/CUDA is one notice line, not an error
    notices = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(notices) == 1 and notices[0].startswith("notice: running on CPUExecutionProvider"), show(r)
    with torch.no_grad():
        expected = eager_model(gpt)(inputs)
    assert max_diff(load_file(out)["outputs"], expected) <= TOL

    r = ok(aot("infer", gpt_artifact, "--input", batch, "--provider", "cpu", "--iters", 2))
    assert "p50" in r.stderr and "p90" in r.stderr and "samples/s" in r.stderr and "notice" not in r.stderr, show(r)


def test_export_from_checkpoint_matches_eager_with_trained_weights(gpt_artifact, gpt, tmp_path):
    ckpt, onnx_file, merged = tmp_path / "ckpt", tmp_path / "trained.onnx", tmp_path / "merged.safetensors"
    trainer = runner.load(gpt_artifact, rank=0, world_size=1)  # two steps of training, as `aot run --save`
    source = trainer.data_source()
    for step in range(2):
        trainer.step(*source.batch(step))
    trainer.save(ckpt)
    r = ok(aot("export", gpt_artifact, GPT, "--checkpoint", ckpt, "-o", onnx_file, "--json"))
    result = json.loads(r.stdout)
    assert result["step"] == 2 and result["max_abs_diff"] <= TOL and onnx_file.is_file()
    ok(aot("checkpoint", "merge", ckpt, "-o", merged))

    trained = eager_model(gpt, load_file(merged))
    inputs, _ = gpt.batch(5)
    with torch.no_grad():
        expected, initial = trained(inputs), eager_model(gpt)(inputs)
    got = runner.infer.load(onnx_file, "cpu").run(inputs)["outputs"]
    assert max_diff(got, expected) <= TOL
    assert max_diff(got, initial) > 10 * TOL  # the export holds the trained weights, not the initial ones


# -- bad input --------------------------------------------------------------------------------

def test_inputs_that_do_not_match_the_export(gpt_artifact):
    session = runner.infer.load(gpt_artifact, "cpu")
    cases = [
        ({"input": torch.zeros(2, 64, dtype=torch.int64)}, "no tensor named 'inputs'"),
        ({"inputs": torch.zeros(2, 32, dtype=torch.int64)}, "inputs is [2, 32] int64, the exported model takes [N, 64] int64"),
        ({"inputs": torch.zeros(2, 64, 1, dtype=torch.int64)}, "inputs is [2, 64, 1] int64"),
        ({"inputs": torch.zeros(2, 64, dtype=torch.int32)}, "inputs is [2, 64] int32, the exported model takes [N, 64] int64"),
        ({"inputs": torch.zeros(0, 64, dtype=torch.int64)}, "holds no samples"),
    ]
    for tensors, needle in cases:
        with pytest.raises(AotError) as e:
            session.run(tensors, where="batch.safetensors")
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_aot_infer_bad_input_is_one_line(gpt_artifact, tmp_path):
    batch = tmp_path / "batch.safetensors"
    save_file({"inputs": torch.zeros(2, 64, dtype=torch.float32)}, batch)
    assert_user_error(aot("infer", gpt_artifact, "--input", batch), str(batch), "float32", "the exported model takes [N, 64] int64")
    save_file({"inputs": torch.zeros(2, 64, dtype=torch.int64)}, batch)
    # an explicit provider that cannot run here is an error, not a fallback
    assert_user_error(aot("infer", gpt_artifact, "--input", batch, "--provider", "cuda"),
                      "provider cuda", "CUDAExecutionProvider", "not usable here")
    # `aot export` needs the very model file the artifact was built from
    assert_user_error(aot("export", gpt_artifact, MLP, "--checkpoint", tmp_path, "-o", tmp_path / "x.onnx"),
                      "mlp.py", "differs from the model file the artifact was built from")


def test_several_inputs_and_outputs_and_a_batch_of_one(tmp_path):
    """Inputs and outputs are named as in data files; an example batch of one still exports with a
    dynamic batch dimension (the export traces batch(2) instead)."""
    from aot.capture.model_file import load_model_file
    from aot.emit.onnx_export import export_onnx

    model_file = tmp_path / "two_heads.py"
    model_file.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.a = torch.nn.Linear(4, 3); self.e = torch.nn.Embedding(10, 3)\n"
        "    def forward(self, x, ids):\n"
        "        h = self.a(x) + self.e(ids).sum(1)\n"
        "        return h, h.argmax(-1)\n"
        "def model(): return M()\n"
        "def batch(n):\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    return (torch.randn(n, 4, generator=g), torch.randint(0, 10, (n, 5), generator=g)), torch.zeros(n, dtype=torch.long)\n"
    )
    mf = load_model_file(model_file)
    torch.manual_seed(0)
    model = mf.model()
    (x, ids), _ = mf.batch(1)
    result = export_onnx(mf, model, [x, ids])
    assert [i["name"] for i in result.spec["inputs"]] == ["inputs.0", "inputs.1"]
    assert result.spec["inputs"][1] == {"name": "inputs.1", "shape": ["batch", 5], "dtype": "int64"}
    assert [(o["name"], o["dtype"]) for o in result.spec["outputs"]] == [("outputs.0", "float32"), ("outputs.1", "int64")]
    onnx_file = tmp_path / "two_heads.onnx"
    onnx_file.write_bytes(result.data)
    session = runner.infer.load(onnx_file, "cpu")  # a bare file: names and shapes come from the graph
    assert session.batch_dim == "batch" and session.input_names == ["inputs.0", "inputs.1"]
    (x, ids), _ = mf.batch(6)
    got = session.run({"inputs.0": x, "inputs.1": ids, "targets": torch.zeros(6)})
    with torch.no_grad():
        h, label = model.eval()(x, ids)
    assert max_diff(got["outputs.0"], h) <= TOL and torch.equal(got["outputs.1"], label)
    with pytest.raises(AotError, match="inputs.1 has 2 samples but inputs.0 has 6"):
        session.run([x, ids[:2]])


def test_training_never_imports_onnxruntime():
    r = ok(subprocess.run([sys.executable, "-c", "import sys, aot.cli, runner.trainer; "
                           "print(sorted(m for m in ('onnxruntime', 'onnx', 'onnxscript') if m in sys.modules))"],
                          capture_output=True, text=True, env=clean_env(), cwd=REPO))
    assert r.stdout.strip() == "[]", show(r)
