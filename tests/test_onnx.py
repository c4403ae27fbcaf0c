"""Exported inference: `aot build` exports the forward to ONNX; `aot infer` runs it with ONNX Runtime.

The reference is always eager PyTorch on the same model file and weights, loaded here with
importlib (not through aot): `torch.manual_seed(seed); model()`. ONNX Runtime must agree within
1e-4 at the example batch size and at other batch sizes (the batch dimension is dynamic), for the
initial weights of a build (which the artifact's ONNX file does not hold: the runner replays the
init program) and for a checkpoint's trained weights exported by `aot export` (inside the file,
or beside it as external data over the size limit). Bad input is one `aot: error:` line.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.commands import EXAMPLES, REPO, aot, clean_env, ok, show
from helpers.inference import assert_user_error, eager_model, load_user, max_diff

import runner
import runner.format.artifact
import runner.execution.infer
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
    assert manifest["format_version"] == runner.format.artifact.FORMAT_VERSION

    # protobuf (no pickle, no zip) that holds no weights: each parameter and buffer the graph reads
    # is an initializer without data, an external-data reference to a file the artifact lacks
    import onnx

    data = (gpt_artifact / inference["file"]).read_bytes()
    assert data[:1] != b"\x80" and data[:2] != b"PK"
    proto = onnx.load_from_string(data)
    state = {**manifest["state"]["params"], **manifest["state"]["buffers"]}
    weights_bytes = sum(math.prod(shape) * torch.empty(0, dtype=getattr(torch, dtype)).element_size() for shape, dtype in state.values())
    assert inference["weights_bytes"] == weights_bytes > 400_000
    mapping = inference["initializers"]
    assert sorted(mapping.values()) == sorted(state)  # gpt's forward reads every parameter and buffer
    aliases = manifest["state"]["aliases"]
    assert all(aliases.get(name, name) == target for name, target in mapping.items())  # lm_head.weight -> tok_emb.weight
    weights = [init for init in proto.graph.initializer if init.name in mapping]
    assert len(weights) == len(mapping)
    for init in weights:
        assert init.data_location == onnx.TensorProto.EXTERNAL and not init.HasField("raw_data"), init.name
        assert not (init.float_data or init.int32_data or init.int64_data or init.double_data), init.name
        assert {e.key: e.value for e in init.external_data}["location"] == "model.onnx.data"
        assert list(init.dims) == state[mapping[init.name]][0]
    constants = [init for init in proto.graph.initializer if init.name not in mapping]
    assert sum(len(init.raw_data) for init in constants) <= 1024  # what the graph computes with: arange(64), scalars
    assert len(data) < weights_bytes / 10
    assert not any(name.endswith(".data") for name in manifest["files"])
    assert not (gpt_artifact / "inference" / "model.onnx.data").exists()

    session = runner.execution.infer.load(gpt_artifact, "cpu")
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


@pytest.fixture(scope="module")
def checkpoint(gpt_artifact, tmp_path_factory):
    """(checkpoint folder after two steps of training, as `aot run --save`; its merged state_dict)."""
    root = tmp_path_factory.mktemp("ckpt")
    ckpt, merged = root / "ckpt", root / "merged.safetensors"
    trainer = runner.load(gpt_artifact, rank=0, world_size=1)
    source = trainer.data_source()
    for step in range(2):
        trainer.step(*source.batch(step))
    trainer.save(ckpt)
    ok(aot("checkpoint", "merge", ckpt, "-o", merged))
    return ckpt, load_file(merged)


def test_export_from_checkpoint_matches_eager_with_trained_weights(gpt_artifact, gpt, checkpoint, tmp_path):
    ckpt, merged = checkpoint
    onnx_file = tmp_path / "trained.onnx"
    r = ok(aot("export", gpt_artifact, GPT, "--checkpoint", ckpt, "-o", onnx_file, "--json"))
    result = json.loads(r.stdout)
    assert result["step"] == 2 and result["max_abs_diff"] <= TOL and onnx_file.is_file()
    assert result["checked_batch_sizes"] == [4, 1]
    # the default precision is fp32, checked as ever: ONNX Runtime, absolute tolerance 1e-4
    assert result["precision"] == "fp32" and result["tolerance"] == TOL and result["checked_with"] == "ONNX Runtime"
    # small weights go inside: one self-contained file, every initializer with its data
    import onnx

    assert result["weights_file"] is None and not (tmp_path / "trained.onnx.data").exists()
    proto = onnx.load(onnx_file)
    assert not any(init.data_location == onnx.TensorProto.EXTERNAL for init in proto.graph.initializer)
    assert "aot.precision" not in {p.key for p in proto.metadata_props}
    types = {init.data_type for init in proto.graph.initializer if init.name in result["initializers"]}
    assert types == {onnx.TensorProto.FLOAT, onnx.TensorProto.BOOL}  # the weights, the causal mask
    assert result["bytes"] == onnx_file.stat().st_size > result["weights_bytes"]

    trained = eager_model(gpt, merged)
    inputs, _ = gpt.batch(5)
    with torch.no_grad():
        expected, initial = trained(inputs), eager_model(gpt)(inputs)
    got = runner.execution.infer.load(onnx_file, "cpu").run(inputs)["outputs"]
    assert max_diff(got, expected) <= TOL
    assert max_diff(got, initial) > 10 * TOL  # the export holds the trained weights, not the initial ones


def test_export_over_the_size_limit_writes_external_data(gpt_artifact, gpt, checkpoint, tmp_path, monkeypatch):
    """Weights over protobuf's 2 GiB limit go to OUTPUT.data beside the file (the limit lowered
    here so that gpt's 440 KiB are over it); the runner checks that file's sha256 first."""
    import onnx

    import aot.emit.onnx_checkpoint as onnx_checkpoint

    ckpt, merged = checkpoint
    monkeypatch.setattr(onnx_checkpoint, "EMBED_LIMIT_BYTES", 1000)
    onnx_file = tmp_path / "out" / "trained.onnx"
    data_file = tmp_path / "out" / "trained.onnx.data"
    result = onnx_checkpoint.export_checkpoint(gpt_artifact, GPT, ckpt, onnx_file)
    assert result["weights_file"] == str(data_file) and result["max_abs_diff"] <= TOL
    assert sorted(p.name for p in onnx_file.parent.iterdir()) == ["trained.onnx", "trained.onnx.data"]  # no temporaries
    assert result["weights_bytes"] <= data_file.stat().st_size and onnx_file.stat().st_size < result["weights_bytes"] / 10
    proto = onnx.load(onnx_file, load_external_data=False)
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["aot.weights"] == "checkpoint at step 2" and meta["aot.weights_file"] == "trained.onnx.data"
    assert meta["aot.weights_sha256"] == result["weights_sha256"] == hashlib.sha256(data_file.read_bytes()).hexdigest()
    for init in proto.graph.initializer:
        if init.name in result["initializers"]:
            entries = {e.key: e.value for e in init.external_data}
            assert init.data_location == onnx.TensorProto.EXTERNAL and entries["location"] == "trained.onnx.data"
            assert int(entries["offset"]) % 64 == 0
    onnx.checker.check_model(str(onnx_file), full_check=True)  # onnx itself reads the data file

    inputs, _ = gpt.batch(3)
    with torch.no_grad():
        expected = eager_model(gpt, merged)(inputs)
    session = runner.execution.infer.load(onnx_file, "cpu")
    assert session.weights == str(data_file)
    assert max_diff(session.run(inputs)["outputs"], expected) <= TOL

    moved = tmp_path / "elsewhere.onnx"
    moved.write_bytes(onnx_file.read_bytes())
    with pytest.raises(AotError, match="weights are ONNX external data in trained.onnx.data, which is not beside it"):
        runner.execution.infer.load(moved, "cpu")
    blob = bytearray(data_file.read_bytes())
    blob[100] ^= 1
    data_file.write_bytes(bytes(blob))
    with pytest.raises(AotError, match="sha256 differs from the one trained.onnx records"):
        runner.execution.infer.load(onnx_file, "cpu")


# -- reduced precision (aot export --precision) ---------------------------------------------------
# The reference is eager PyTorch on the same merged weights, `.to(dtype)`. Tolerances are in the
# dtype's epsilon times the outputs' scale (max(1, max |eager|)), measured on these gpt weights at
# batch 5: |export - eager| = 0.4 eps x scale for fp16 (ONNX Runtime CPU computes fp16 ops in fp32
# between fp16 tensors; torch's fp16 CPU kernels round elsewhere), 1.2 for bf16 (onnx's reference
# evaluator, which rounds more intermediate values to bf16 than torch does).
FP16_TOL_EPS = 2.0
BF16_TOL_EPS = 4.0


def _within_eps(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, eps_units: float) -> float:
    """|got - expected| in units of eps(dtype) x max(1, max |expected|); asserts it is at most eps_units."""
    scale = max(1.0, expected.abs().max().item())
    measured = max_diff(got, expected) / (torch.finfo(dtype).eps * scale)
    assert measured <= eps_units, (dtype, measured)
    return measured


def _weights_in(proto, result: dict, merged: dict, dtype: torch.dtype) -> None:
    """Every trained weight of the file is the checkpoint's tensor rounded to `dtype`, bit for bit;
    the causal mask (bool, from the init program) stays bool."""
    import onnx

    from runner.execution.infer import ONNX_TYPES

    weights = {init.name: init for init in proto.graph.initializer if init.name in result["initializers"]}
    trained = {name: init for name, init in weights.items() if result["initializers"][name] in merged}
    assert len(trained) == len(weights) - 2  # the two blocks' masks
    assert all(init.data_type == onnx.TensorProto.BOOL for name, init in weights.items() if name not in trained)
    for name, init in trained.items():
        assert init.data_type == ONNX_TYPES[dtype] and init.data_location != onnx.TensorProto.EXTERNAL, name
        stored = torch.frombuffer(bytearray(init.raw_data), dtype=dtype).reshape(list(init.dims))
        assert torch.equal(stored, merged[result["initializers"][name]].to(dtype)), name


def test_export_in_fp16_runs_on_cpu_and_matches_eager_fp16(gpt_artifact, gpt, checkpoint, tmp_path):
    import onnx

    ckpt, merged = checkpoint
    onnx_file = tmp_path / "trained16.onnx"
    r = ok(aot("export", gpt_artifact, GPT, "--checkpoint", ckpt, "-o", onnx_file, "--precision", "fp16", "--json"))
    result = json.loads(r.stdout)
    assert result["precision"] == "fp16" and result["checked_with"] == "ONNX Runtime"
    assert 0 < result["max_abs_diff"] <= result["tolerance"] and result["checked_batch_sizes"] == [4, 1]
    fp32_bytes = sum(t.numel() * 4 for n, t in merged.items()) + 64 * 64  # + the causal mask (bool)
    assert result["weights_bytes"] < fp32_bytes * 0.51  # half the bytes
    proto = onnx.load(onnx_file)
    assert {p.key: p.value for p in proto.metadata_props}["aot.precision"] == "fp16"
    _weights_in(proto, result, merged, torch.float16)
    # the interface is the fp32 export's: int64 tokens in, float32 logits out
    assert [i.type.tensor_type.elem_type for i in proto.graph.input] == [onnx.TensorProto.INT64]
    assert [o.type.tensor_type.elem_type for o in proto.graph.output] == [onnx.TensorProto.FLOAT]

    inputs, _ = gpt.batch(5)
    session = runner.execution.infer.load(onnx_file, "cpu")  # as `aot infer` runs it (its CLI: test_aot_infer_end_to_end)
    got = session.run({"inputs": inputs})["outputs"]
    assert session.provider == "cpu" and got.dtype == torch.float32
    trained = eager_model(gpt, merged)
    with torch.no_grad():
        expected16, expected32 = trained.to(torch.float16)(inputs).float(), eager_model(gpt, merged)(inputs)
    _within_eps(got, expected16, torch.float16, FP16_TOL_EPS)
    assert max_diff(got, expected32) > TOL  # it does compute in fp16: not the fp32 export's numbers


def test_export_in_bf16_is_checked_by_the_reference_evaluator_and_refused_on_cpu(gpt_artifact, gpt, checkpoint, tmp_path):
    """ONNX Runtime's CPU provider has no bf16 kernels (MatMul, Add, Softmax, Gelu): the export is
    checked with onnx's reference evaluator instead, and `aot infer` refuses it on CPU in one line."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    from aot.emit.onnx_checkpoint import export_checkpoint

    ckpt, merged = checkpoint
    onnx_file = tmp_path / "trained_bf16.onnx"
    result = export_checkpoint(gpt_artifact, GPT, ckpt, onnx_file, precision="bf16")
    assert result["precision"] == "bf16" and result["checked_with"] == "onnx's reference evaluator"
    assert 0 < result["max_abs_diff"] <= result["tolerance"] and result["checked_batch_sizes"] == [4, 1]
    onnx.checker.check_model(str(onnx_file), full_check=True)
    proto = onnx.load(onnx_file)
    assert {p.key: p.value for p in proto.metadata_props}["aot.precision"] == "bf16"
    _weights_in(proto, result, merged, torch.bfloat16)
    assert [o.type.tensor_type.elem_type for o in proto.graph.output] == [onnx.TensorProto.FLOAT]

    inputs, targets = gpt.batch(5)
    got = torch.from_numpy(ReferenceEvaluator(proto).run(["outputs"], {"inputs": inputs.numpy()})[0])
    with torch.no_grad():
        expected = eager_model(gpt, merged).to(torch.bfloat16)(inputs).float()
    _within_eps(got, expected, torch.bfloat16, BF16_TOL_EPS)

    batch = tmp_path / "batch.safetensors"
    save_file({"inputs": inputs, "targets": targets}, batch)
    assert_user_error(
        aot("infer", onnx_file, "--input", batch),
        str(onnx_file),
        "computes in bf16",
        "no bf16 kernels",
        "GPU provider (cuda, tensorrt)",
        "--precision fp16",
        "passed over: TensorrtExecutionProvider",
    )
    with pytest.raises(AotError, match="computes in bf16") as e:
        runner.execution.infer.load(onnx_file, "cpu")
    assert "\n" not in str(e.value) and "passed over" not in str(e.value)


def test_export_precision_bad_input(tmp_path):
    # click refuses the value before anything is read
    r = aot("export", tmp_path / "art", GPT, "--checkpoint", tmp_path / "ckpt", "-o", tmp_path / "x.onnx", "--precision", "fp8")
    assert r.returncode == 2 and "Traceback" not in r.stderr, show(r)
    assert "Invalid value for '--precision': 'fp8' is not one of 'fp32', 'bf16', 'fp16'" in r.stderr, show(r)
    assert not (tmp_path / "x.onnx").exists()
    r = ok(aot("export", "--help"))
    assert "--precision [fp32|bf16|fp16]" in r.stdout and "bf16 needs a GPU provider" in " ".join(r.stdout.split())


def test_bare_copy_of_the_artifacts_onnx_file_is_refused(gpt_artifact, tmp_path):
    bare = tmp_path / "model.onnx"
    bare.write_bytes((gpt_artifact / "inference" / "model.onnx").read_bytes())
    with pytest.raises(AotError, match="inference/model.onnx holds no weights: run the artifact folder"):
        runner.execution.infer.load(bare, "cpu")


# -- bad input --------------------------------------------------------------------------------


def test_inputs_that_do_not_match_the_export(gpt_artifact):
    session = runner.execution.infer.load(gpt_artifact, "cpu")
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
    assert_user_error(aot("infer", gpt_artifact, "--input", batch, "--provider", "cuda"), "provider cuda", "CUDAExecutionProvider", "not usable here")
    # `aot export` needs the very model file the artifact was built from
    assert_user_error(
        aot("export", gpt_artifact, MLP, "--checkpoint", tmp_path, "-o", tmp_path / "x.onnx"),
        "mlp.py",
        "differs from the model file the artifact was built from",
    )


def test_several_inputs_and_outputs_and_a_batch_of_one(tmp_path):
    """Inputs and outputs are named as in data files; an example batch of one still exports with a
    dynamic batch dimension (the export traces batch(2) instead)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from aot.capture.model_file import load_model_file
    from aot.emit.onnx_checkpoint import save_onnx
    from aot.emit.onnx_export import _fake_model, export_onnx, state_tensors

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
    assert 0 <= result.spec["max_abs_diff"] <= TOL and result.spec["checked_batch_sizes"] == [2, 1]
    assert result.spec["initializers"] == {n: n for n in ("a.weight", "a.bias", "e.weight")}
    # the same export from the model on fake tensors (as `aot build` has it), checked on given weights
    fake = _fake_model(mf)
    assert isinstance(fake.a.weight, FakeTensor)
    from_fake = export_onnx(mf, fake, [x, ids], weights=state_tensors(model))
    assert from_fake.data == result.data and from_fake.spec == result.spec | {"max_abs_diff": from_fake.spec["max_abs_diff"]}
    onnx_file = tmp_path / "two_heads.onnx"
    save_onnx(result.data, result.weights_for(state_tensors(model)), onnx_file)
    session = runner.execution.infer.load(onnx_file, "cpu")  # a bare file: names and shapes come from the graph
    assert session.batch_dim == "batch" and session.input_names == ["inputs.0", "inputs.1"]
    (x, ids), _ = mf.batch(6)
    got = session.run({"inputs.0": x, "inputs.1": ids, "targets": torch.zeros(6)})
    with torch.no_grad():
        h, label = model.eval()(x, ids)
    assert max_diff(got["outputs.0"], h) <= TOL and torch.equal(got["outputs.1"], label)
    with pytest.raises(AotError, match="inputs.1 has 2 samples but inputs.0 has 6"):
        session.run([x, ids[:2]])


def _user_model(tmp_path, body: str):
    from aot.capture.model_file import load_model_file

    path = tmp_path / "user.py"
    path.write_text("import torch\n" + body + "\ndef batch(n):\n    return torch.randn(n, 4, generator=torch.Generator().manual_seed(0)), torch.zeros(n)\n")
    return load_model_file(path)


def test_build_inference_on_the_builds_fake_model_checks_with_the_init_programs_weights():
    """What `aot build` has: the model on fake tensors and the init program; the check makes the
    weights by replaying that program (as the runner does), bit-identical to eager construction."""
    from aot.capture.model_file import load_model_file
    from aot.capture.training_state import build_training_state
    from aot.emit.artifact import export_init
    from aot.emit.onnx_export import build_inference, init_program_weights

    mf = load_model_file(GPT)
    state = build_training_state(mf, 3, 10)
    names = [*state.params, *state.buffers]
    made = init_program_weights(state.init_graph, names, 3)
    from_program = init_program_weights(export_init(state), names, 3)()  # as the artifact stores it
    torch.manual_seed(3)
    eager = mf.model()
    weights = made()
    assert sorted(weights) == sorted(names)
    assert all(torch.equal(weights[n], t) and torch.equal(from_program[n], t) for n, t in [*eager.named_parameters(), *eager.named_buffers()])
    calls, warnings = [], []
    result = build_inference(mf, state.model, [mf.batch(4)[0]], required=True, warn=warnings.append, weights=lambda: calls.append(1) or made())
    assert calls == [1] and not warnings
    assert 0 <= result.spec["max_abs_diff"] <= TOL and result.spec["checked_batch_sizes"] == [4, 1]


def test_check_is_skipped_over_its_budget_with_one_warning(tmp_path, monkeypatch):
    import aot.emit.onnx_export as onnx_export

    mf = _user_model(tmp_path, "def model(): return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))")
    inputs = [mf.batch(3)[0]]
    made = []
    monkeypatch.setattr(onnx_export, "CHECK_BUDGET_BYTES", 100)  # the model's weights are 232 bytes
    warnings = []
    result = onnx_export.build_inference(mf, onnx_export._fake_model(mf), inputs, required=True, warn=warnings.append, weights=lambda: made.append(1))
    assert not made  # the weights are never made
    assert result.spec["max_abs_diff"] is None and result.spec["checked_batch_sizes"] == []
    assert result.spec["unchecked"].startswith("the weights (0.0 GiB) exceed the numeric check's budget")
    assert len(warnings) == 1 and "not checked against eager PyTorch" in warnings[0] and "\n" not in warnings[0]
    runner.format.artifact._conform({"file": "inference/model.onnx", **result.spec}, runner.format.artifact.INFERENCE_SCHEMA, "inference")

    monkeypatch.setattr(onnx_export, "CHECK_BUDGET_BYTES", 2**30)  # within it: weights recorded and replayed here
    warnings.clear()
    result = onnx_export.build_inference(mf, onnx_export._fake_model(mf), inputs, required=True, warn=warnings.append)
    assert 0 <= result.spec["max_abs_diff"] <= TOL and "unchecked" not in result.spec and not warnings


def test_tensor_attribute_that_is_no_buffer_is_refused(tmp_path):
    from aot.emit.onnx_export import OnnxUnsupported, _fake_model, build_inference

    mf = _user_model(
        tmp_path,
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.a = torch.nn.Linear(4, 3); self.scale = torch.ones(3) * 2\n"
        "    def forward(self, x): return self.a(x) * self.scale\n"
        "def model(): return M()",
    )
    with pytest.raises(OnnxUnsupported, match="reads tensor attribute 'scale', which is neither a parameter nor a buffer"):
        build_inference(mf, _fake_model(mf), [mf.batch(2)[0]], required=True, warn=print)


def test_training_never_imports_onnxruntime():
    r = ok(
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys, aot.cli, runner.execution.trainer; print(sorted(m for m in ('onnxruntime', 'onnx', 'onnxscript') if m in sys.modules))",
            ],
            capture_output=True,
            text=True,
            env=clean_env(),
            cwd=REPO,
        )
    )
    assert r.stdout.strip() == "[]", show(r)
