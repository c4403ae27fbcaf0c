"""`aot diff A B`: what changed between two real builds, its exit statuses and its JSON."""

from __future__ import annotations

import json

import pytest

from helpers.artifacts import writable_copy
from helpers.commands import EXAMPLES, aot, show
from helpers.inference import load_user
from runner.format.artifact import manifest_digest
from runner.commands.formatting import human


@pytest.fixture(scope="module")
def builds(built):
    """examples/mlp.py built for two ranks as dp=2 and as fsdp=2 (the session's builds: read-only)."""
    dp, fsdp = built.many(*((EXAMPLES / "mlp.py", "--strategy", strategy, "--no-onnx") for strategy in ("dp=2", "fsdp=2")))
    return {"dp": dp, "fsdp": fsdp}


def _parameters():
    """The eager model's parameter element counts, built without aot."""
    return [p.numel() for p in load_user(EXAMPLES / "mlp.py").model().parameters()]


def test_dp_to_fsdp_names_the_changed_collectives(builds):
    r = aot("diff", builds["dp"], builds["fsdp"])
    assert r.returncode == 1, show(r)
    numel = _parameters()
    # dp: one bucket of every fp32 gradient and the 4-byte global loss; fsdp: a reduce_scatter of
    # each whole gradient (its element count padded to a multiple of 2) and all_gathers of shards
    grads = 4 * sum(n + n % 2 for n in numel)
    assert f"- all_reduce over aot.dp (float32): 1 x, {human(4 * sum(numel) + 4)}" in r.stdout, show(r)
    assert f"+ reduce_scatter_tensor over aot.fsdp (float32): {len(numel)} x, {human(grads)}" in r.stdout, show(r)
    assert "+ all_gather_into_tensor over aot.fsdp (float32): " in r.stdout, show(r)
    assert "+ all_reduce over aot.fsdp (float32): 1 x, 4 B" in r.stdout, show(r)
    for line in (
        "strategy                   dp=2 -> fsdp=2",
        "sharding                   none -> fsdp=2 over aot.fsdp",
        "_c10d_functional.reduce_scatter_tensor   0 -> 6",
        "peak memory per rank",
        "B/A",
    ):
        assert line in r.stdout, show(r)


def test_json_holds_the_same_facts(builds):
    r = aot("diff", builds["dp"], builds["fsdp"], "--json")
    assert r.returncode == 1, show(r)
    d = json.loads(r.stdout)
    numel = _parameters()
    assert d["identical"] is False
    (program,) = d["programs"]
    assert program["ranks"] == [0, 1] and program["a"] == program["b"] == "train"
    changes = {(c["kind"], c["group"], c["change"]): c for c in program["collectives"]}
    assert set(changes) == {
        ("all_reduce", "aot.dp", "removed"),
        ("all_reduce", "aot.fsdp", "added"),
        ("all_gather_into_tensor", "aot.fsdp", "added"),
        ("reduce_scatter_tensor", "aot.fsdp", "added"),
    }
    assert changes["all_reduce", "aot.dp", "removed"]["a"]["sizes"] == [4 * sum(numel) + 4]
    assert sorted(changes["reduce_scatter_tensor", "aot.fsdp", "added"]["b"]["sizes"]) == sorted(4 * (n + n % 2) for n in numel)
    # each all_gather sends this rank's shard of one parameter
    assert set(changes["all_gather_into_tensor", "aot.fsdp", "added"]["b"]["sizes"]) <= {4 * (n + n % 2) // 2 for n in numel}
    ops = {o["op"]: (o["a"], o["b"]) for o in program["ops"]}
    assert ops["_c10d_functional.reduce_scatter_tensor"] == (0, len(numel))
    assert ops["_c10d_functional.all_gather_into_tensor"][1] == changes["all_gather_into_tensor", "aot.fsdp", "added"]["b"]["count"]
    assert {"field": "mesh", "a": "dp=2", "b": "fsdp=2"} in d["plan"]["changed"]
    step = d["plan"]["predicted"]["step_s"]
    assert step["ratio"] == pytest.approx(step["b"] / step["a"])
    assert {"mesh", "sharding", "programs"} <= set(d["manifest_entries_changed"])


def test_a_byte_copy_is_identical(builds, tmp_path):
    writable_copy(builds["fsdp"], tmp_path / "copy")
    r = aot("diff", builds["fsdp"], tmp_path / "copy")
    assert r.returncode == 0, show(r)
    assert r.stdout.startswith("identical: ") and r.stdout.count("\n") == 1, show(r)
    d = json.loads(aot("diff", builds["fsdp"], tmp_path / "copy", "--json").stdout)
    assert d["identical"] is True and d["build"] == d["plan"]["changed"] == d["files"] == []
    assert all(not p["collectives"] and not p["ops"] for p in d["programs"])


def test_another_torch_release_is_compared_not_refused(builds, tmp_path):
    # an artifact rebuilt for a torch upgrade: `aot run` refuses it here, `aot diff` shows it
    copy = tmp_path / "copy"
    writable_copy(builds["dp"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["torch_version"] = "2.12.0+cpu"
    manifest["digest"] = manifest_digest(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    r = aot("diff", copy, builds["dp"])
    assert r.returncode == 1, show(r)
    assert "torch_version              2.12.0+cpu -> 2." in r.stdout, show(r)
    assert "ranks 0-1: train, same collectives (1 per step) and ops" in r.stdout, show(r)


def _one_error_line(r) -> str:
    assert r.returncode == 2, show(r)
    assert "Traceback" not in r.stdout + r.stderr and r.stdout == "", show(r)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("aot: error: "), show(r)
    return lines[0]


def test_diff_with_a_missing_artifact(builds, tmp_path):
    line = _one_error_line(aot("diff", builds["dp"], tmp_path / "missing"))
    assert "no such artifact folder" in line and "missing" in line


def test_diff_with_an_altered_artifact(builds, tmp_path):
    copy = tmp_path / "copy"
    writable_copy(builds["dp"], copy)
    with open(copy / "data" / "example_batch.safetensors", "ab") as f:
        f.write(b"\0")
    line = _one_error_line(aot("diff", builds["dp"], copy))
    assert "sha256 does not match" in line and "example_batch.safetensors" in line
