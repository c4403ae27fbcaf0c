"""The artifact format and the runner: pickle-free files, hashes, the Python API, checkpoints,
resume, inspect and verify, run as a user would."""

from __future__ import annotations

import json
import math
import zipfile

import pytest
import torch
from safetensors.torch import load_file

import runner
from helpers.commands import EXAMPLES, aot, ok, torchrun
from helpers.training import eager_single_process
from runner.format.artifact import FORMAT_VERSION, Artifact
from runner.execution.init_program import initial_state


@pytest.fixture(scope="module")
def mlp1(built):
    """examples/mlp.py for one rank, with its ONNX export (the session's build: read-only)."""
    return built(EXAMPLES / "mlp.py")


@pytest.fixture(scope="module")
def gpt2(built):
    return built(EXAMPLES / "gpt.py", "--world-size", 2, "--batch-size", 4, "--no-onnx")


@pytest.mark.parametrize("name", ["gpt2", "mlp1"])
def test_no_file_is_a_pickle_and_every_file_is_hashed(name, request):
    art = request.getfixturevalue(name)
    manifest = json.loads((art / "manifest.json").read_text())
    on_disk = {str(p.relative_to(art)) for p in art.rglob("*") if p.is_file()} - {"manifest.json"}
    assert on_disk == set(manifest["files"])
    assert (name == "mlp1") == ("inference/model.onnx" in on_disk)  # the ONNX export is checked too
    for rel in on_disk:
        data = (art / rel).read_bytes()
        # a pickle (protocol 2 to 5) opens with PROTO and its number; a safetensors file with the
        # length of its header, which may be 0x80 bytes but then never exceeds 255 (8 bytes, little-endian)
        assert not (data[:1] == b"\x80" and data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), f"{rel} looks like a pickle"
        assert not zipfile.is_zipfile(art / rel), f"{rel} is a zip (torch.save / torch.export.save format)"
        if rel.endswith(".json"):
            json.loads(data)
        elif rel.endswith(".onnx"):  # the inference export: ONNX protobuf
            import onnx

            onnx.load_from_string(data)
        else:
            assert rel.endswith(".safetensors")
            load_file(art / rel)


def test_loading_never_calls_torch_load(mlp1, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.load called while loading an artifact")

    monkeypatch.setattr(torch, "load", refuse)
    trainer = runner.load(mlp1, rank=0, world_size=1)
    inputs, targets = trainer.data_source().batch(0)
    assert torch.isfinite(torch.tensor(trainer.step(inputs, targets)))


def test_program_files_are_shared_across_ranks(gpt2):
    manifest = json.loads((gpt2 / "manifest.json").read_text())
    assert len(manifest["ranks"]) == 2 and set(manifest["programs"]) == {"train", "eval"}
    assert {r["program"] for r in manifest["ranks"]} == {"train"} and {r["eval_program"] for r in manifest["ranks"]} == {"eval"}
    assert manifest["process_groups"] == {"aot.dp": {"axis": "dp", "groups": [[0, 1]]}}
    assert manifest["build"]["world_size"] == 2


def _user_module(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    return user


def test_python_api_matches_eager_single_process(mlp1):
    """runner.load(...).step() against a plain eager loop in this process. The golden artifact of
    the format before (tests/fixtures/artifact_v7_mlp) gets the same check, and known losses, in
    tests/test_format_conformance.py."""
    trainer = runner.load(mlp1, rank=0, world_size=1)
    assert trainer.artifact.manifest["format_version"] == FORMAT_VERSION
    source = trainer.data_source()
    batches = [source.batch(step) for step in range(3)]
    losses = [trainer.step(inputs, targets) for inputs, targets in batches]
    eager, eager_state = eager_single_process(EXAMPLES / "mlp.py", batches)
    assert max(abs(a - b) for a, b in zip(losses, eager)) <= 1e-6, (losses, eager)
    state = trainer.state_dict()
    assert list(state) == list(eager_state)
    for k, v in eager_state.items():
        assert torch.allclose(state[k], v, atol=1e-6)


@pytest.mark.parametrize("model", ["mlp.py", "gpt.py"])
def test_init_program_replays_eager_construction_bit_for_bit(model, mlp1, gpt2):
    """No weights are stored: the runner replays the recorded construction after the build's seed,
    and gets exactly `torch.manual_seed(seed); model()`, tied weights and buffers included."""
    artifact = mlp1 if model == "mlp.py" else gpt2
    assert not any(p.startswith("state/") for p in json.loads((artifact / "manifest.json").read_text())["files"])
    torch.manual_seed(0)
    eager = _user_module(EXAMPLES / model).model()
    torch.manual_seed(1234)  # the replay uses the build's seed and leaves the caller's RNG alone
    before = torch.get_rng_state()
    weights, optimizer = initial_state(Artifact(artifact), {"dp": 0})
    assert torch.equal(torch.get_rng_state(), before)
    named = {**dict(eager.named_parameters()), **dict(eager.named_buffers())}
    assert sorted(weights) == sorted(named)
    for name, tensor in named.items():
        assert torch.equal(weights[name], tensor) and weights[name].dtype == tensor.dtype, name
    assert optimizer and all(not t.any() for t in optimizer.values())  # zero moments, step counters at 0


def test_resume_is_bit_identical_to_an_uninterrupted_run(gpt2, tmp_path):
    full, first, resumed = tmp_path / "full", tmp_path / "first", tmp_path / "resumed"
    ok(torchrun(2, "run", gpt2, "--steps", "4", "--save", full, "--quiet"))
    ok(torchrun(2, "run", gpt2, "--steps", "2", "--save", first, "--quiet"))
    ok(torchrun(2, "run", gpt2, "--steps", "2", "--resume", first, "--save", resumed, "--quiet"))
    assert json.loads((resumed / "checkpoint.json").read_text())["step"] == 4
    for role in ("weights", "optimizer"):
        name = json.loads((full / "checkpoint.json").read_text())["shards"][0][role]
        assert name == json.loads((resumed / "checkpoint.json").read_text())["shards"][0][role]
        a, b = load_file(full / name), load_file(resumed / name)
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_merged_checkpoint_loads_into_the_users_model(gpt2, tmp_path):
    ok(torchrun(2, "run", gpt2, "--steps", "1", "--save", tmp_path / "ck", "--quiet"))
    ok(aot("checkpoint", "merge", tmp_path / "ck", "-o", tmp_path / "full.safetensors"))
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpt_example", EXAMPLES / "gpt.py")
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    model = user.model()
    result = model.load_state_dict(load_file(tmp_path / "full.safetensors"))
    assert not result.missing_keys and not result.unexpected_keys


def test_metrics_and_progress(gpt2, tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = ok(torchrun(2, "run", gpt2, "--steps", "3", "--metrics", metrics))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(set(r) >= {"step", "loss", "step_time_s", "samples_per_s"} for r in records)
    assert all(r["samples_per_s"] > 0 for r in records)
    assert "step     3" in r.stderr and "loss" in r.stderr


def test_inspect_reports_collectives_per_step(gpt2):
    summary = json.loads(ok(aot("inspect", gpt2, "--json")).stdout)
    train = summary["programs"]["train"]
    params = len(Artifact(gpt2).manifest["state"]["params"])
    # gradients (and the loss) travel in one 25 MB bucket, not one collective per parameter
    assert train["collectives_per_step"] == 1 < params
    assert train["collectives"][0]["kind"] == "all_reduce" and train["collectives"][0]["group"] == "aot.dp"
    assert summary["world_size"] == 2 and summary["ranks"][1]["coords"] == {"dp": 1}
    text = ok(aot("inspect", gpt2)).stdout
    assert "1 collectives per step" in text and "programs/train.json" in text


def test_small_buckets_give_more_collectives(built):
    out = built(EXAMPLES / "mlp.py", "--world-size", 2, "--bucket-mb", 0.01, "--no-onnx")
    summary = json.loads(ok(aot("inspect", out, "--json")).stdout)
    assert summary["programs"]["train"]["collectives_per_step"] > 1


def test_verify_passes_on_a_good_artifact_and_fails_on_a_wrong_model(gpt2, tmp_path):
    result = json.loads(ok(aot("verify", gpt2, EXAMPLES / "gpt.py", "--steps", "3", "--json")).stdout)
    assert result["ok"] and result["max_loss_diff"] <= 1e-5 and result["max_weight_diff"] <= 1e-5
    # the worst parameter is named, and every parameter's distance is given
    assert result["weight_diffs"][result["worst_weight"]] == result["max_weight_diff"] == max(result["weight_diffs"].values())
    assert set(result["weight_diffs"]) == set(json.loads((gpt2 / "manifest.json").read_text())["state"]["state_dict_keys"])
    other = tmp_path / "gpt_changed.py"
    other.write_text((EXAMPLES / "gpt.py").read_text().replace("n_layer = 2", "n_layer = 3"))
    r = aot("verify", gpt2, other)
    assert r.returncode == 1 and "differs from the model file the artifact was built from" in r.stderr


def test_builds_for_many_ranks_on_one_machine(tmp_path):
    """A laptop builds for a large cluster: 1024 ranks, one program, no real collective."""
    out = tmp_path / "big"
    summary = json.loads(ok(aot("build", EXAMPLES / "mlp.py", "--world-size", "1024", "--no-onnx", "-o", out, "--json")).stdout)
    assert summary["world_size"] == 1024 and summary["programs"] == 1
    manifest = json.loads((out / "manifest.json").read_text())
    # the step, eval and init programs and the example batch: nothing per rank, no weights
    files = ["data/example_batch.safetensors", "programs/eval.json", "programs/init.json", "programs/train.json"]
    assert len(manifest["ranks"]) == 1024 and sorted(manifest["files"]) == files


def test_fsdp_shards_parameters_and_optimizer_state(built, tmp_path):
    """Per-rank parameters + optimizer state, measured on the runner's live tensors, are about
    1/N of data parallel's; resuming a sharded run is exact."""
    sizes = {}
    strategies = ("dp=4", "fsdp=4")
    # the resume below runs the small model: the same sharded checkpoint code, a quarter of the time
    *arts, resumable = built.many(
        *((EXAMPLES / "gpt.py", "--strategy", s, "--batch-size", 2, "--no-onnx") for s in strategies),
        (EXAMPLES / "mlp.py", "--strategy", "fsdp=4", "--no-onnx"),
    )
    for strategy, out in zip(strategies, arts):
        manifest = json.loads((out / "manifest.json").read_text())
        per_rank = []
        for rank in range(4):
            weights, optimizer = initial_state(Artifact(out), manifest["ranks"][rank]["coords"])
            state = weights | optimizer
            params = set(manifest["state"]["params"])
            per_rank.append(sum(t.numel() * t.element_size() for k, t in state.items() if k in params or k.split(":")[0] in params))
        sizes[strategy] = per_rank
    for rank in range(4):
        assert abs(sizes["fsdp=4"][rank] / sizes["dp=4"][rank] - 0.25) < 0.05 * 0.25
    out = resumable
    full, first, resumed = tmp_path / "full", tmp_path / "first", tmp_path / "resumed"
    ok(torchrun(4, "run", out, "--steps", "3", "--save", full, "--quiet"))
    ok(torchrun(4, "run", out, "--steps", "1", "--save", first, "--quiet"))
    ok(torchrun(4, "run", out, "--steps", "2", "--resume", first, "--save", resumed, "--quiet"))
    a, b = json.loads((full / "checkpoint.json").read_text()), json.loads((resumed / "checkpoint.json").read_text())
    assert len(a["shards"]) == 4 and a["shards"] == b["shards"]
    for shard in a["shards"]:
        for name in shard.values():
            x, y = load_file(full / name), load_file(resumed / name)
            assert all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("strategy", ["dp=2,fsdp=2,tp=2", "fsdp=2,tp=4"])
def test_tensor_parallel_meshes_build_for_8_ranks(strategy, built):
    """Built on this 2-core machine for 8 ranks: one state shard per (tp, fsdp) position, each
    rank creating its slice of the split layers and its fsdp shard of everything."""
    out = built(EXAMPLES / "gpt.py", "--world-size", 8, "--strategy", strategy, "--no-onnx")
    manifest = json.loads((out / "manifest.json").read_text())
    degrees = dict(zip(manifest["mesh"]["axes"], manifest["mesh"]["shape"]))
    tp, fsdp = degrees["tp"], degrees["fsdp"]
    assert len({(r["coords"]["tp"], r["coords"]["fsdp"]) for r in manifest["ranks"]}) == tp * fsdp
    assert manifest["tensor_parallel"]["params"]["blocks.0.attn.q.weight"] == 0
    assert manifest["tensor_parallel"]["params"]["blocks.0.mlp.proj.weight"] == 1
    assert {c["group"] for c in manifest["programs"]["train"]["collectives"]} >= {"aot.tp", "aot.fsdp"}
    weights, _ = initial_state(Artifact(out), manifest["ranks"][5]["coords"])
    q = manifest["state"]["params"]["blocks.0.attn.q.weight"][0]
    assert weights["blocks.0.attn.q.weight"].numel() == q[0] * q[1] // tp // fsdp
    summary = json.loads(ok(aot("inspect", out, "--json")).stdout)
    full = sum(math.prod(s) for s, _ in manifest["state"]["params"].values())
    assert summary["ranks"][5]["parameters"] < full / fsdp


def test_tensor_parallel_2d_resume_is_exact(built, tmp_path):
    """fsdp=2,tp=2 at 4 ranks: 3 steps straight == 1 step, save, resume, 2 steps (bit for bit)."""
    out = built(EXAMPLES / "mlp.py", "--world-size", 4, "--strategy", "fsdp=2,tp=2", "--no-onnx")
    full, first, resumed = tmp_path / "full", tmp_path / "first", tmp_path / "resumed"
    ok(torchrun(4, "run", out, "--steps", "3", "--save", full, "--quiet"))
    ok(torchrun(4, "run", out, "--steps", "1", "--save", first, "--quiet"))
    ok(torchrun(4, "run", out, "--steps", "2", "--resume", first, "--save", resumed, "--quiet"))
    a, b = json.loads((full / "checkpoint.json").read_text()), json.loads((resumed / "checkpoint.json").read_text())
    assert len(a["shards"]) == 4 and a["shards"] == b["shards"] and a["tensor_parallel"]["size"] == 2
    for shard in a["shards"]:
        for name in shard.values():
            x, y = load_file(full / name), load_file(resumed / name)
            assert all(torch.equal(x[k], y[k]) for k in x)
