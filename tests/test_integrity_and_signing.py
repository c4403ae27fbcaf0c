"""Artifacts that were altered, carry planted pickles, or come from an untrusted builder never run."""

from __future__ import annotations

import io
import json
import pickle
import shutil

import pytest
import torch

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
