"""Bad input reaches the user as one line, never as a traceback.

Every test runs the real command line in a subprocess (`python -m aot ...`, and torchrun for
multi-rank runs) and checks the contract of runner/commands/console.py: a user error prints exactly one
`aot: error: ...` line (`aot: error: [rank r] ...` per rank under a multi-rank torchrun), exits 1,
and names the problem; tracebacks appear only with --debug. Failed builds leave no half-written
artifact. Bad model files live in tests/models/bad_*.py.

Tests marked xfail(strict=True), if any, document known bugs: they assert the
correct behaviour and fail today; when one starts passing, remove its marker.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runner.format.artifact import FORMAT_VERSION, manifest_digest
from helpers.artifacts import writable_copy
from helpers.commands import EXAMPLES, MODELS, REPO, TIMEOUT, aot, aot_each, clean_env, line_of, show, torchrun

MLP = REPO / "examples" / "mlp.py"

# A Python frame of aot's own code in a traceback (torchrun's launcher prints its own traceback
# when a child exits non-zero; that one is torch's, not aot's).
AOT_FRAME = re.compile(r'File "[^"]*[/\\](aot|runner)[/\\][^"]*\.py", line \d+')


# -- helpers ---------------------------------------------------------------------------------


def assert_user_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 1, no traceback, exactly one `aot: error:` line naming the problem; returns that line.

    `needles` are substrings the error line must contain (the distinctive part of the message).
    """
    assert r.returncode == 1, show(r)
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, show(r)
    assert "internal error" not in r.stderr, show(r)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("aot: error: ")]
    assert len(errors) == 1, show(r)
    # the error is the last thing printed: nothing (a warning, a stray log) follows it
    assert lines[-1] == errors[0], show(r)
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in the error line\n{show(r)}"
    return errors[0]


def assert_rank_errors(r: subprocess.CompletedProcess, *needles: str) -> list[str]:
    """The torchrun form: non-zero exit, aot's ranks print one-line errors, no aot traceback."""
    assert r.returncode != 0, show(r)
    assert not AOT_FRAME.search(r.stderr), show(r)
    assert "internal error" not in r.stderr, show(r)
    errors = [line for line in r.stderr.splitlines() if line.startswith("aot: error: ")]
    assert errors, show(r)
    for line in errors:
        for needle in needles:
            assert needle in line, f"{needle!r} not in {line!r}\n{show(r)}"
    return errors


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def edit_manifest(folder: Path, **changes) -> None:
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    # a consistent manifest (as another builder would write it), so the check under test is reached
    manifest["digest"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest, indent=1))


def staging_folders(folder: Path) -> list[Path]:
    return list(folder.glob(".staging-*")) if folder.is_dir() else []


# -- shared artifacts (the session's: read-only) -------------------------------------------


@pytest.fixture(scope="module")
def artifact1(built) -> Path:
    """examples/mlp.py built for world size 1 (runs without torchrun). Do not alter: copy it."""
    return built(MLP, "--world-size", 1, "--no-onnx")


@pytest.fixture(scope="module")
def artifact2(built) -> Path:
    """examples/mlp.py built for world size 2."""
    return built(MLP, "--world-size", 2, "--no-onnx")


@pytest.fixture(scope="module")
def checkpoint(artifact1, tmp_path_factory) -> Path:
    """A checkpoint written by one step of `aot run --save`."""
    folder = tmp_path_factory.mktemp("ckpt") / "checkpoint"
    r = aot("run", artifact1, "--steps", "1", "--save", folder, "--quiet")
    assert r.returncode == 0, show(r)
    assert (folder / "checkpoint.json").is_file()
    return folder


@pytest.fixture
def copy1(artifact1, tmp_path) -> Path:
    """A private copy of the world-size-1 artifact that a test may alter."""
    return writable_copy(artifact1, tmp_path / "artifact")


# -- 1. model files that break the model-file contract --------------------------------------


def test_model_file_without_model(tmp_path):
    r = aot("build", MODELS / "bad_no_model.py", "-o", tmp_path / "out", "--quiet")
    assert_user_error(r, "bad_no_model.py", "model()")


def test_model_file_without_batch(tmp_path):
    r = aot("build", MODELS / "bad_no_batch.py", "-o", tmp_path / "out", "--quiet")
    assert_user_error(r, "bad_no_batch.py", "batch()")


def test_model_file_syntax_error_names_file_and_line(tmp_path):
    path = MODELS / "bad_syntax.py"
    line = assert_user_error(aot("build", path, "-o", tmp_path / "out", "--quiet"), "syntax error")
    assert f"bad_syntax.py:{line_of(path, 'def model(:')}" in line


def test_model_raising_names_file_and_line(tmp_path):
    path = MODELS / "bad_model_raises.py"
    line = assert_user_error(aot("build", path, "-o", tmp_path / "out", "--quiet"), "model()", "RuntimeError", "exploded on purpose")
    assert f"bad_model_raises.py:{line_of(path, 'MARK: raises')}" in line


def test_max_grad_norm_not_a_number(tmp_path):
    r = aot("build", MODELS / "bad_max_grad_norm.py", "-o", tmp_path / "out", "--quiet")
    assert_user_error(r, "max_grad_norm", "'x'")


def test_model_file_that_does_not_exist(tmp_path):
    r = aot("build", tmp_path / "no_such_model.py", "-o", tmp_path / "out", "--quiet")
    assert_user_error(r, "no_such_model.py", "no such model file")
    assert not (tmp_path / "out").exists()


def test_model_file_whose_name_does_not_end_in_py(tmp_path):
    # Python's import machinery finds no loader for model.txt (this used to be an internal AttributeError)
    model = tmp_path / "model.txt"
    shutil.copy(MLP, model)
    r = aot("build", model, "-o", tmp_path / "out", "--quiet")
    assert_user_error(r, "model.txt", "a model file's name ends in .py")
    assert not (tmp_path / "out").exists()


# -- 2. models that cannot be traced --------------------------------------------------------


def test_data_dependent_control_flow_names_problem_and_line(tmp_path):
    path = MODELS / "bad_data_dependent.py"
    line = assert_user_error(aot("build", path, "-o", tmp_path / "out", "--quiet"), "cannot be traced", "data-dependent")
    assert f"bad_data_dependent.py:{line_of(path, 'MARK: data-dependent')}" in line
    assert "if x.sum() > 0" in line
    # in words a user reads, with what to do instead; not torch's guard jargon
    assert "reads a tensor's value" in line and "torch.where" in line and "Guard" not in line and "u0" not in line


def test_reentrant_checkpoint_is_refused_with_the_fix(tmp_path):
    """torch.utils.checkpoint(use_reentrant=True) reruns forward in its own autograd.Function: one
    line saying to pass use_reentrant=False (which builds: tests/models/zoo/titan_llama.py)."""
    r = aot("build", MODELS / "bad_checkpoint_reentrant.py", "-o", tmp_path / "out", "--quiet", "--no-onnx")
    assert_user_error(r, "use_reentrant=True", "pass use_reentrant=False", "titan_llama.py:")
    assert not (tmp_path / "out").exists()


def test_frozen_parameters_are_refused_not_trained(tmp_path):
    r = aot("build", MODELS / "bad_frozen_parameters.py", "-o", tmp_path / "out", "--quiet", "--no-onnx")
    assert_user_error(r, "frozen parameters", "0.weight", "register them as buffers")
    assert not (tmp_path / "out").exists()


def test_trunc_normal_with_a_generator_of_its_own_is_refused(tmp_path):
    path = MODELS / "bad_trunc_normal_generator.py"
    r = aot("build", path, "-o", tmp_path / "out", "--quiet", "--no-onnx")
    line = assert_user_error(r, "generator of the model's own", "drop the generator argument")
    assert f"bad_trunc_normal_generator.py:{line_of(path, 'MARK: own generator')}" in line


def test_a_shape_that_depends_on_values_is_refused_in_one_line(tmp_path):
    """A mixture of experts looping over the tokens each expert got (torch.where, then indexing)
    traces to sizes known only from values: refused after the trace, naming the op, before a pass
    meets them (it was an internal error from the passes)."""
    r = aot("build", MODELS / "bad_moe_module_list.py", "--world-size", "2", "--no-onnx", "-o", tmp_path / "out")
    line = assert_user_error(r, "the training step: nonzero", "size depends on values", "static graph")
    assert "internal error" not in line and "u0" not in line
    assert not (tmp_path / "out").exists()


def test_plan_of_an_untraceable_model_prints_one_line_and_nothing_else():
    """The planner traces in two processes and exports the forward to find a tp plan; torch's
    own logs and the partial graph it prints stay out of the user's way."""
    r = aot("plan", MODELS / "bad_data_dependent.py", "--topology", "dgx_a100", "--nodes", "2")
    assert_user_error(r, "cannot be traced", "data-dependent", "if x.sum() > 0")
    assert [line for line in r.stderr.splitlines() if line.strip()] == [r.stderr.strip()], show(r)


def test_shape_mismatch_in_forward_is_one_line(tmp_path):
    r = aot("build", MODELS / "bad_shape_mismatch.py", "-o", tmp_path / "out", "--quiet")
    assert_user_error(r, "bad_shape_mismatch.py", "cannot be traced", "[8, 4]", "[5, 3]")


# -- 3. data that does not match the built program ------------------------------------------


def _good_row(n: int = 16) -> dict:
    # examples/mlp.py: 32 float32 features per sample, int64 class targets
    return {"inputs": torch.randn(n, 32), "targets": torch.randint(0, 10, (n,))}


def test_data_with_wrong_sample_shape(artifact1, tmp_path):
    data = tmp_path / "bad.safetensors"
    save_file({**_good_row(), "inputs": torch.randn(16, 5)}, str(data))
    r = aot("run", artifact1, "--steps", "1", "--data", data, "--quiet")
    line = assert_user_error(r, str(data), "expected", "got")
    assert "[32] float32" in line and "[5] float32" in line  # expected vs got


def test_data_with_wrong_dtype(artifact1, tmp_path):
    data = tmp_path / "bad.safetensors"
    save_file({**_good_row(), "inputs": torch.randn(16, 32, dtype=torch.float64)}, str(data))
    r = aot("run", artifact1, "--steps", "1", "--data", data, "--quiet")
    line = assert_user_error(r, str(data), "float32")
    assert "float64" in line


def test_data_without_targets(artifact1, tmp_path):
    data = tmp_path / "bad.safetensors"
    save_file({"inputs": torch.randn(16, 32)}, str(data))
    r = aot("run", artifact1, "--steps", "1", "--data", data, "--quiet")
    assert_user_error(r, str(data), "'targets'")


def test_data_file_that_is_not_safetensors(artifact1, tmp_path):
    data = tmp_path / "bad.safetensors"
    data.write_text("this is not a safetensors file\n")
    r = aot("run", artifact1, "--steps", "1", "--data", data, "--quiet")
    assert_user_error(r, str(data), "safetensors")


def test_data_file_that_does_not_exist(artifact1, tmp_path):
    data = tmp_path / "missing.safetensors"
    r = aot("run", artifact1, "--steps", "1", "--data", data, "--quiet")
    assert_user_error(r, str(data), "no such data file")


# -- 4. world size of the launch differs from the artifact's --------------------------------


def test_torchrun_with_fewer_ranks_than_built(artifact2):
    r = torchrun(1, "run", artifact2, "--steps", "1", "--quiet")
    assert_rank_errors(r, "world size 2", "1 process")


def test_torchrun_with_more_ranks_than_built_prefixes_each_rank(artifact1):
    r = torchrun(2, "run", artifact1, "--steps", "1", "--quiet")
    errors = assert_rank_errors(r, "world size 1", "2 process")
    # torchrun may stop the other rank before it prints, so at least one rank reports
    assert all(re.match(r"aot: error: \[rank [01]\] ", line) for line in errors), show(r)


def test_world_size_2_artifact_without_torchrun(artifact2):
    r = aot("run", artifact2, "--steps", "1", "--quiet")
    assert_user_error(r, "world size 2", "1 process", "torchrun")


def test_cuda_graphs_on_a_cpu_rank_is_refused_before_any_step(artifact1):
    """`aot run --cuda-graphs on` where no graph can be captured (a CPU rank) is one line, before
    the process group starts; auto (the default) runs there uncaptured."""
    r = aot("run", artifact1, "--steps", "1", "--cuda-graphs", "on", "--quiet")
    assert_user_error(r, "--cuda-graphs on", "this rank runs on cpu", "--cuda-graphs off")


# -- 5. missing and altered artifact files --------------------------------------------------


def test_altered_init_program(copy1):
    flip_byte(copy1 / "programs" / "init.json")
    r = aot("run", copy1, "--steps", "1", "--quiet")
    assert_user_error(r, "programs/init.json", "sha256")


def test_altered_program_file(copy1):
    flip_byte(copy1 / "programs" / "train.json")
    r = aot("run", copy1, "--steps", "1", "--quiet")
    assert_user_error(r, "programs/train.json", "sha256")


def test_missing_example_batch(copy1):
    (copy1 / "data" / "example_batch.safetensors").unlink()
    r = aot("run", copy1, "--steps", "1", "--quiet")
    assert_user_error(r, "data/example_batch.safetensors", "missing")


def test_missing_manifest(copy1):
    (copy1 / "manifest.json").unlink()
    r = aot("run", copy1, "--steps", "1", "--quiet")
    assert_user_error(r, str(copy1), "manifest.json")


def test_artifact_folder_that_does_not_exist(tmp_path):
    r = aot("run", tmp_path / "nothing_here", "--steps", "1", "--quiet")
    assert_user_error(r, "nothing_here", "no such artifact folder")


def test_manifest_file_entry_without_sha256(copy1):
    manifest = json.loads((copy1 / "manifest.json").read_text())
    del manifest["files"]["programs/init.json"]["sha256"]
    manifest["digest"] = manifest_digest(manifest)
    (copy1 / "manifest.json").write_text(json.dumps(manifest))
    r = aot("run", copy1, "--steps", "1", "--quiet")
    assert_user_error(r, "programs/init.json")


# -- 6. artifacts from another torch or format version --------------------------------------


def test_artifact_from_another_torch_version(copy1):
    edit_manifest(copy1, torch_version="2.99.0")
    r = aot("run", copy1, "--steps", "1", "--quiet")
    assert_user_error(r, "2.99.0", torch.__version__.split("+")[0])


def test_artifact_of_another_format_version(copy1):
    edit_manifest(copy1, format_version=99)
    r = aot("run", copy1, "--steps", "1", "--quiet")
    line = assert_user_error(r, "format version 99")
    assert re.search(rf"\b{FORMAT_VERSION}\b", line.split("99", 1)[1]), line  # names the version it reads


# -- 7. bad command-line options ------------------------------------------------------------


@pytest.mark.parametrize(
    "options, needles",
    [
        (["--strategy", "cp=2"], ["'cp'", "not supported"]),
        (["--strategy", "dp=3", "--world-size", "2"], ["dp=3", "3", "world size 2"]),
        (["--batch-size", "0"], ["--batch-size", "0"]),
        (["--topology", "nonexistent_profile"], ["nonexistent_profile", "built-in: cpu"]),
        (["--topology", "gpu8"], ["'gpu8'", "no built-in profile"]),
    ],
    ids=["unsupported-axis", "degrees-vs-world-size", "batch-size-0", "topology-path", "unknown-builtin"],
)
def test_bad_build_options(tmp_path, options, needles):
    out = tmp_path / "out"
    r = aot("build", MLP, "-o", out, "--quiet", *options)
    assert_user_error(r, *needles)
    assert not out.exists()


def test_bad_tensor_parallel_degree_or_plan(tmp_path):
    """Refused at build time, before the step is traced (the capture stage never starts)."""
    cases = [
        (REPO / "examples" / "gpt.py", ["--strategy", "tp=8", "--world-size", "8"], ["tp=8", "attention heads", "n_head in gpt.py = 4"]),
        (MLP, ["--strategy", "tp=3", "--world-size", "3"], ["tp=3", "'0'", "output features do not divide by 3"]),
        (MODELS / "bad_tp_plan.py", ["--strategy", "tp=2", "--world-size", "2"], ["bad_tp_plan.py", "tp_plan", "'fc2'", "does not have"]),
        (MLP, ["--strategy", "dp=2", "--sequence-parallel"], ["--sequence-parallel", "needs --strategy with tp"]),
        (MLP, ["--strategy", "tp=2", "--sequence-parallel"], ["--sequence-parallel", "at the top of the model"]),
        (MODELS / "gpt_odd_sequence.py", ["--strategy", "tp=2", "--sequence-parallel"], ["sequence length 63 does not divide by 2"]),
        (MODELS / "gpt_block_mixer.py", ["--strategy", "tp=2", "--sequence-parallel"], ["blocks.0.mix", "holds weights on the sequence-split stream"]),
    ]
    results = aot_each(*(("build", path, "-o", tmp_path / path.stem, *options) for path, options, _ in cases))
    for (path, _options, needles), r in zip(cases, results):
        out = tmp_path / path.stem
        assert_user_error(r, *needles)
        assert "capturing" not in r.stderr
        assert not out.exists()


def test_topology_file_that_is_not_a_profile(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"schema": "something-else"}))
    r = aot("build", MLP, "-o", tmp_path / "out", "--quiet", "--topology", profile)
    assert_user_error(r, str(profile), "not a topology profile")


# -- 8. a failed build leaves no half-written artifact -------------------------------------


def test_failed_build_into_fresh_folder_leaves_nothing(tmp_path):
    out = tmp_path / "fresh"
    r = aot("build", MODELS / "bad_data_dependent.py", "-o", out, "--quiet")
    assert_user_error(r, "cannot be traced")
    assert not (out / "manifest.json").exists()
    assert not staging_folders(out)


def test_failed_rebuild_keeps_the_good_artifact(copy1):
    before = (copy1 / "manifest.json").read_bytes()
    r = aot("build", MODELS / "bad_data_dependent.py", "-o", copy1, "--quiet")
    assert_user_error(r, "cannot be traced")
    assert (copy1 / "manifest.json").read_bytes() == before
    assert not staging_folders(copy1)
    inspect = aot("inspect", copy1)
    assert inspect.returncode == 0, show(inspect)
    assert "mlp.py" in inspect.stdout


def test_failure_while_writing_keeps_the_good_artifact(copy1, tmp_path):
    """A signing key that is no key fails inside the staged write itself (signing is its last
    step): the artifact already there stays as it was, and nothing half-written is left."""
    bad_key = tmp_path / "not_a.key"
    bad_key.write_text("not a PEM key\n")
    before, names = (copy1 / "manifest.json").read_bytes(), sorted(p.name for p in copy1.iterdir())
    r = aot("build", EXAMPLES / "mlp.py", "--no-onnx", "--sign", bad_key, "-o", copy1, "--quiet")
    assert_user_error(r, "not_a.key", "PEM")
    assert (copy1 / "manifest.json").read_bytes() == before
    assert not staging_folders(copy1)
    assert sorted(p.name for p in copy1.iterdir()) == names == ["data", "manifest.json", "programs"]
    inspect = aot("inspect", copy1)
    assert inspect.returncode == 0, show(inspect)

    fresh = tmp_path / "fresh"
    r = aot("build", EXAMPLES / "mlp.py", "--no-onnx", "--sign", bad_key, "-o", fresh, "--quiet")
    assert r.returncode != 0, show(r)
    assert not (fresh / "manifest.json").exists()
    assert not staging_folders(fresh)


def test_buffer_sharing_memory_with_a_parameter(tmp_path):
    r = aot("build", MODELS / "bad_aliased_buffer.py", "-o", tmp_path / "out", "--quiet")
    if r.returncode == 0:
        return  # building it is a fine answer too
    assert_user_error(r, "first_row")


def test_constructor_that_reads_tensor_values(tmp_path):
    out = tmp_path / "out"
    path = MODELS / "bad_constructor_reads_values.py"
    r = aot("build", path, "-o", out, "--quiet")
    assert_user_error(r, f"bad_constructor_reads_values.py:{line_of(path, 'MARK: reads values')}", "must not read tensor values")
    assert not out.exists()


def test_constructor_that_loads_weights_from_outside_torch(tmp_path):
    out = tmp_path / "out"
    r = aot("build", MODELS / "bad_constructor_loads_weights.py", "-o", out, "--quiet")
    assert_user_error(r, "parameter 'embedding'", "2.0 MiB", "--init-from")
    assert not out.exists()


def test_plan_refuses_a_constructor_the_build_refuses():
    """The planner makes the model without recording its construction (aot/capture/training_state.py
    `_made_fake`), but where the build would refuse it, it records it and says the build's line."""
    r = aot("plan", MODELS / "bad_constructor_loads_weights.py", "--world-size", "2")
    assert_user_error(r, "parameter 'embedding'", "2.0 MiB", "--init-from")
    path = MODELS / "bad_constructor_reads_values.py"
    r = aot("plan", path, "--world-size", "2")
    assert_user_error(r, f"bad_constructor_reads_values.py:{line_of(path, 'MARK: reads values')}", "must not read tensor values")


def test_build_output_below_a_file(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder\n")
    r = aot("build", MLP, "-o", blocker / "out", "--quiet")
    assert_user_error(r, "a_file")


# -- 9. --debug shows the traceback ---------------------------------------------------------


@pytest.mark.parametrize("where", ["after", "before"])
def test_debug_shows_traceback(tmp_path, where):
    args = ["build", MODELS / "bad_no_model.py", "-o", tmp_path / "out", "--quiet"]
    r = aot(*(args + ["--debug"] if where == "after" else ["--debug"] + args))
    assert r.returncode != 0, show(r)
    assert "Traceback (most recent call last)" in r.stderr, show(r)
    assert "AotError" in r.stderr and "defines no model()" in r.stderr, show(r)


def test_debug_env_shows_traceback_for_run(copy1):
    flip_byte(copy1 / "programs" / "init.json")
    r = subprocess.run(
        [sys.executable, "-m", "aot", "run", str(copy1), "--steps", "1", "--quiet"],
        cwd=REPO,
        env={**clean_env(), "AOT_DEBUG": "1"},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert r.returncode != 0, show(r)
    assert "Traceback (most recent call last)" in r.stderr and "sha256" in r.stderr, show(r)


# -- 10. checkpoints ------------------------------------------------------------------------


def test_merge_of_a_folder_that_is_not_a_checkpoint(artifact1, tmp_path):
    out = tmp_path / "merged.safetensors"
    r = aot("checkpoint", "merge", artifact1, "-o", out)
    assert_user_error(r, str(artifact1), "not an aot checkpoint")
    assert not out.exists()


def test_resume_from_a_folder_that_is_not_a_checkpoint(artifact1):
    r = aot("run", artifact1, "--steps", "1", "--resume", artifact1, "--quiet")
    assert_user_error(r, str(artifact1), "not an aot checkpoint")


def test_resume_from_a_folder_that_does_not_exist(artifact1, tmp_path):
    missing = tmp_path / "no_checkpoint_here"
    r = aot("run", artifact1, "--steps", "1", "--resume", missing, "--quiet")
    assert_user_error(r, str(missing), "no such")


def test_merge_of_an_altered_checkpoint(checkpoint, tmp_path):
    altered = Path(shutil.copytree(checkpoint, tmp_path / "altered"))
    weights = json.loads((altered / "checkpoint.json").read_text())["shards"][0]["weights"]
    flip_byte(altered / weights, offset=-3)
    out = tmp_path / "merged.safetensors"
    r = aot("checkpoint", "merge", altered, "-o", out)
    assert_user_error(r, weights, "sha256")
    assert not out.exists()


def test_merge_into_an_existing_folder(checkpoint, tmp_path):
    out = tmp_path / "a_folder"
    out.mkdir()
    r = aot("checkpoint", "merge", checkpoint, "-o", out)
    try:
        assert_user_error(r, str(out))
    finally:
        assert not (tmp_path / "a_folder.tmp").exists(), "half-written merge output left behind"


def test_metrics_path_that_is_a_folder(artifact1, tmp_path):
    r = aot("run", artifact1, "--steps", "1", "--metrics", tmp_path, "--quiet")
    assert_user_error(r, str(tmp_path))


# -- 8. mixed precision the target or the model cannot take -----------------------------------


def _with(tmp_path, source: Path, **names) -> Path:
    """A copy of `source` with module-level names set (precision = "fp8", ...)."""
    path = tmp_path / source.name
    path.write_text(source.read_text() + "".join(f"\n{k} = {v!r}\n" for k, v in names.items()))
    return path


def test_unknown_precision(tmp_path):
    r = aot("build", MLP, "-o", tmp_path / "out", "--quiet", "--precision", "fp8")
    assert r.returncode == 2 and "fp8" in r.stderr and "Traceback" not in r.stderr, show(r)
    assert_user_error(aot("build", _with(tmp_path, MLP, precision="fp8"), "-o", tmp_path / "out", "--quiet"), "mlp.py: precision", "fp32, bf16, fp16", "'fp8'")
    assert not (tmp_path / "out").exists()


def test_bf16_on_gpus_without_bf16(tmp_path):
    """A V100 profile (compute capability 7.0) cannot compute in bf16; fp16 it can."""
    profile = json.loads((REPO / "runner" / "hardware" / "profiles" / "dgx_a100.json").read_text())
    for gpu in profile["node"]["gpus"].values():
        gpu.update(name="Tesla V100-SXM2-32GB", compute_capability=[7, 0])
    path = tmp_path / "v100.json"
    path.write_text(json.dumps(profile))
    r = aot("build", MLP, "-o", tmp_path / "out", "--quiet", "--topology", path, "--world-size", 1, "--precision", "bf16")
    assert_user_error(r, "Tesla V100-SXM2-32GB", "cannot compute in bf16", "use fp16")
    assert not (tmp_path / "out").exists()


def test_reduce_dtype_other_than_the_compute_dtype(tmp_path):
    r = aot("build", MLP, "-o", tmp_path / "out", "--quiet", "--precision", "bf16", "--reduce-dtype", "fp16")
    assert_user_error(r, "--reduce-dtype", "fp32, bf16", "'fp16'")


def test_bad_grad_scaler(tmp_path):
    model = _with(tmp_path, MLP, precision="fp16", grad_scaler={"init_scale": 0})
    assert_user_error(aot("build", model, "-o", tmp_path / "out", "--quiet"), "grad_scaler", "init_scale > 0")


def test_mixed_precision_of_fp16_parameters(tmp_path):
    model = tmp_path / "half.py"
    model.write_text(MLP.read_text().replace("nn.Linear(n_in, n_hidden)", "nn.Linear(n_in, n_hidden, dtype=torch.float16)"))
    r = aot("build", model, "-o", tmp_path / "out", "--quiet", "--precision", "bf16")
    assert_user_error(r, "fp32 master weights", "float16")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_optimizer_stepping_with_a_closure(tmp_path, precision):
    """LBFGS re-evaluates the loss inside step(): no static step can hold it (nor GradScaler, fp16)."""
    model = tmp_path / "lbfgs.py"
    model.write_text(MLP.read_text() + "\n\ndef optimizer(params):\n    return torch.optim.LBFGS(params)\n")
    r = aot("build", model, "-o", tmp_path / "out", "--quiet", "--precision", precision)
    assert_user_error(r, "LBFGS", "closure")


# -- 9. recomputation budgets that cannot be met, policies that say nothing ---------------------------


def test_memory_budget_that_is_not_a_size(tmp_path):
    r = aot("build", MLP, "-o", tmp_path / "out", "--quiet", "--memory-budget", "lots")
    assert_user_error(r, "--memory-budget must be a positive size", "'lots'")
    assert not (tmp_path / "out").exists()


def test_memory_budget_below_the_smallest_peak(tmp_path):
    r = aot("build", MLP, "-o", tmp_path / "out", "--quiet", "--no-onnx", "--memory-budget", "1KiB")
    assert_user_error(r, "below the smallest peak recomputation reaches", "without recomputation")
    assert not (tmp_path / "out").exists()


def test_activation_budget_out_of_range_or_below_the_feasible(tmp_path):
    assert_user_error(aot("build", MLP, "-o", tmp_path / "out", "--quiet", "--activation-budget", "1.5"), "fraction of saved activations kept, from 0 to 1")
    r = aot("build", MLP, "-o", tmp_path / "out", "--quiet", "--no-onnx", "--activation-budget", "0")
    assert_user_error(r, "below what recomputation can reach", "smallest feasible is")
    assert_user_error(aot("build", MLP, "-o", tmp_path / "out", "--quiet", "--activation-budget", "0.5", "--memory-budget", "1"), "give one")
    assert not (tmp_path / "out").exists()


def test_bad_recompute_policy(tmp_path):
    for policy, words in [
        (5, "must be a list of module name patterns"),
        ({"modules": ["0"], "save": "everything"}, '"save" must be "matmuls"'),
        (["decoder.*"], "no module call matching"),
    ]:
        r = aot("build", _with(tmp_path, MLP, recompute=policy), "-o", tmp_path / "out", "--quiet", "--no-onnx")
        assert_user_error(r, "recompute", words)
        assert not (tmp_path / "out").exists()


# -- 11. pipelines the model or the batch cannot take: refused before tracing ----------------------


def test_microbatches_the_batch_or_schedule_cannot_take(tmp_path):
    build = lambda *args: aot("build", MLP, "-o", tmp_path / "out", "--quiet", "--no-onnx", "--batch-size", 4, *args)
    assert_user_error(build("--strategy", "pp=2", "--microbatches", 3), "does not split into --microbatches 3")
    assert_user_error(build("--strategy", "pp=2", "--microbatches", 1), "at least as many microbatches as pipeline ranks")
    assert_user_error(
        build("--strategy", "pp=2", "--pp-schedule", "interleaved-1f1b", "--microbatches", 4, "--world-size", 2, "--batch-size", 6), "does not split into"
    )
    assert_user_error(build("--strategy", "pp=2", "--stages-per-rank", 2), "needs --pp-schedule interleaved-1f1b")
    assert_user_error(build("--microbatches", 2), "need --strategy with pp=N")
    assert_user_error(build("--strategy", "dp=1,pp=2"), "pp must be the first (outermost) axis")
    assert not (tmp_path / "out").exists()


def test_pipeline_stages_the_model_cannot_take(tmp_path):
    r = aot("build", _with(tmp_path, MLP, pp_split=["decoder.3"]), "-o", tmp_path / "out", "--quiet", "--no-onnx", "--strategy", "pp=2", "--batch-size", 4)
    assert_user_error(r, "pp_split names 'decoder.3', which is not a module of the model")
    r = aot("build", _with(tmp_path, MLP, pp_split=["2", "4"]), "-o", tmp_path / "out", "--quiet", "--no-onnx", "--strategy", "pp=2", "--batch-size", 4)
    assert_user_error(r, "pp_split names 2 module(s) for 2 stages")
    r = aot("build", MLP, "-o", tmp_path / "out", "--quiet", "--no-onnx", "--strategy", "pp=8", "--batch-size", 8, "--microbatches", 8)
    assert_user_error(r, "8 stages need at least 8 layers; the model has 5")
    r = aot("build", MLP, "-o", tmp_path / "out", "--quiet", "--no-onnx", "--strategy", "pp=4", "--batch-size", 8)
    assert_user_error(r, "would hold no parameters")  # 3 Linears and 2 ReLUs cannot give 4 ranks weights
    r = aot("build", REPO / "tests" / "models" / "bn_adam.py", "-o", tmp_path / "out", "--quiet", "--no-onnx", "--strategy", "pp=2", "--batch-size", 4)
    assert_user_error(r, "updates buffer", "in place", "not supported with pp yet")
    assert not (tmp_path / "out").exists()
