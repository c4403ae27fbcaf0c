"""`aot infer --trusted-key` refuses what `aot run --trusted-key` refuses: an artifact signed by
another key, or none; a bare .onnx file cannot prove who built it, so it is refused too."""

from __future__ import annotations

import shutil

import pytest

from helpers.commands import EXAMPLES, aot, ok, show
from runner.errors import AotError
from runner.format.signing import read_public_key


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    root = tmp_path_factory.mktemp("signed-infer")
    ok(aot("keygen", "-o", root / "builder"))
    ok(aot("keygen", "-o", root / "stranger"))
    ok(aot("build", EXAMPLES / "mlp.py", "-o", root / "art", "--sign", root / "builder", "--onnx", "--quiet"))
    return root


def infer(target, batch, *extra):
    return aot("infer", target, "--input", batch / "data" / "example_batch.safetensors", "--warmup", "0", "--iters", "1", *extra)


def test_aot_infer_with_trusted_key_runs_signed_artifacts_only(signed, tmp_path):
    art = signed / "art"
    ok(infer(art, art, "--trusted-key", signed / "builder.pub"))
    r = infer(art, art, "--trusted-key", signed / "stranger.pub")
    assert r.returncode == 1 and "Traceback" not in r.stderr, show(r)
    assert "not among the trusted keys" in r.stderr, show(r)

    unsigned = shutil.copytree(art, tmp_path / "unsigned")
    (unsigned / "signature.json").unlink()
    r = infer(unsigned, art, "--trusted-key", signed / "builder.pub")
    assert r.returncode == 1 and "not signed" in r.stderr, show(r)

    onnx = tmp_path / "model.onnx"
    shutil.copy(art / "inference" / "model.onnx", onnx)
    r = infer(onnx, art, "--trusted-key", signed / "builder.pub")
    assert r.returncode == 1 and "Traceback" not in r.stderr, show(r)
    assert "carries no signature" in r.stderr, show(r)


def test_runner_infer_load_takes_trusted_keys(signed):
    import runner.execution.infer

    session = runner.execution.infer.load(signed / "art", "cpu", trusted_keys=[read_public_key(signed / "builder.pub")])
    assert session.input_names == ["inputs"]
    with pytest.raises(AotError, match="not among the trusted keys"):
        runner.execution.infer.load(signed / "art", "cpu", trusted_keys=[read_public_key(signed / "stranger.pub")])
