"""Artifacts that were altered, carry planted pickles, or come from an untrusted builder never run."""

from __future__ import annotations

import io
import json
import pickle
import shutil

import pytest
import torch
from safetensors.torch import save_file

from helpers.commands import EXAMPLES, aot, aot_each, ok
from runner.format.artifact import manifest_digest
from runner.format.integrity import sha256_bytes

PAYLOAD_MARK = "aot-test-pickle-executed"


class Exploit:
    """A pickle that, if ever unpickled, writes a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """A folder with two key pairs (keys/builder, keys/stranger) and examples/mlp.py built and
    signed with the builder's key (art; without the ONNX export, which test_infer_trusted_key.py
    checks signed)."""
    root = tmp_path_factory.mktemp("integrity")
    ok(aot("keygen", "-o", root / "keys" / "builder"))
    ok(aot("keygen", "-o", root / "keys" / "stranger"))
    ok(aot("build", EXAMPLES / "mlp.py", "-o", root / "art", "--sign", root / "keys" / "builder", "--no-onnx", "--quiet"))
    return root


@pytest.fixture
def art(signed, tmp_path):
    copy = tmp_path / "art"
    shutil.copytree(signed / "art", copy)
    return copy


def rewrite_manifest(art, edit):
    path = art / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    manifest["digest"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest))


def plant(art, relpath, data):
    """Replace a file and rewrite the manifest's hash and digest to match, as an attacker would."""
    (art / relpath).write_bytes(data)
    rewrite_manifest(art, lambda m: m["files"].__setitem__(relpath, {"sha256": sha256_bytes(data), "size": len(data)}))


def run(art, *extra):
    return aot("run", art, "--steps", "1", "--quiet", *extra)


def test_signed_artifact_runs_with_its_key(signed, art):
    ok(run(art, "--trusted-key", signed / "keys" / "builder.pub"))


@pytest.mark.parametrize("case", ["stranger", "altered", "unsigned"])
def test_untrusted_artifacts_are_refused(signed, art, case):
    if case == "altered":
        rewrite_manifest(art, lambda m: m["build"].__setitem__("seed", 1))
    if case == "unsigned":
        (art / "signature.json").unlink()
    key = signed / "keys" / ("stranger.pub" if case == "stranger" else "builder.pub")
    r = run(art, "--trusted-key", key)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    expected = {"stranger": "not among the trusted keys", "altered": "altered after signing", "unsigned": "not signed"}
    assert expected[case] in r.stderr


@pytest.mark.parametrize("relpath", ["programs/init.json", "programs/train.json", "data/example_batch.safetensors"])
def test_a_flipped_byte_in_any_file_is_refused_naming_it(art, relpath):
    data = bytearray((art / relpath).read_bytes())
    data[len(data) // 2] ^= 0x01
    (art / relpath).write_bytes(bytes(data))
    r = run(art)
    assert r.returncode == 1 and relpath in r.stderr and "sha256" in r.stderr


def test_a_hand_edited_manifest_fails_its_digest(art):
    path = art / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["build"]["seed"] = 7
    path.write_text(json.dumps(manifest))
    r = run(art)
    assert r.returncode == 1 and "digest does not match" in r.stderr


@pytest.mark.parametrize("relpath", ["programs/init.json", "programs/train.json", "data/example_batch.safetensors"])
def test_planted_pickle_with_rewritten_hashes_never_executes(art, relpath, tmp_path):
    marker = tmp_path / PAYLOAD_MARK
    buffer = io.BytesIO()
    torch.save({"x": Exploit(str(marker))}, buffer)  # what a torch.load-based loader would run
    for payload in (pickle.dumps(Exploit(str(marker))), buffer.getvalue()):
        plant(art, relpath, payload)
        r = run(art)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert relpath in r.stderr and "refusing to deserialize" in r.stderr
        assert not marker.exists(), "the planted pickle was executed"


def test_two_builds_are_byte_identical(tmp_path):
    outputs = [tmp_path / "one", tmp_path / "two"]
    for r in aot_each(*(("build", EXAMPLES / "gpt.py", "--world-size", "2", "--batch-size", "2", "-o", out, "--quiet") for out in outputs)):
        ok(r)
    files = [sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file()) for out in outputs]
    assert files[0] == files[1]
    for rel in files[0]:
        assert (outputs[0] / rel).read_bytes() == (outputs[1] / rel).read_bytes(), rel
    digests = [json.loads((out / "manifest.json").read_text())["digest"] for out in outputs]
    assert digests[0] == digests[1]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """examples/mlp.py built with its ONNX export (inference/model.onnx), which `aot run` never reads."""
    root = tmp_path_factory.mktemp("exported")
    ok(aot("build", EXAMPLES / "mlp.py", "-o", root / "art", "--quiet"))
    return root / "art"


def test_a_tampered_file_nothing_reads_is_refused_by_run_infer_and_inspect(exported, tmp_path):
    """The ONNX export replaced by a pickle: the artifact no longer matches its manifest, so no
    command takes it, including those that would never read that file."""
    art = tmp_path / "art"
    shutil.copytree(exported, art)
    (art / "inference" / "model.onnx").write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    batch = tmp_path / "batch.safetensors"
    save_file({"inputs": torch.randn(8, 32)}, str(batch))
    for r in (run(art), aot("inspect", art), aot("infer", art, "--input", batch, "-o", tmp_path / "out.safetensors")):
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "inference/model.onnx: sha256 does not match" in r.stderr, r.stderr


def test_torch_outside_the_window_is_refused_unless_allowed(art):
    """The runner reads artifacts of its own torch minor release (any patch); another is refused
    in one line naming the flag, and runs with it, saying the risk."""
    here = torch.__version__.split("+")[0].split(".")
    rewrite_manifest(art, lambda m: m.__setitem__("torch_version", f"{here[0]}.{here[1]}.99"))
    ok(run(art))  # another patch release: inside the window
    other = f"{here[0]}.{int(here[1]) - 2}.0"
    rewrite_manifest(art, lambda m: m.__setitem__("torch_version", other))
    r = run(art)
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"built with torch {other}" in r.stderr and "--allow-torch-skew" in r.stderr, r.stderr
    r = ok(run(art, "--allow-torch-skew"))
    assert f"built with torch {other}, run with torch" in r.stderr and "may fail to load" in r.stderr, r.stderr
