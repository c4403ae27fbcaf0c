"""Model code as users write it (issue #40): torchtitan's, nanoGPT's and transformers' idioms build
and train as eager does (the zoo's titan_llama and nanogpt families, tests/test_model_zoo.py), or are
refused in one line that names the line of model code and says what to change; never an internal
error. The idioms' mechanisms have their own tests: trunc_normal_ in tests/test_init_program.py,
checkpoint calls in tests/test_recompute.py, value reads and reentrant checkpoints in
tests/test_bad_input.py."""

from __future__ import annotations

import json

import pytest

from helpers.commands import MODELS, aot, aot_each, line_of, ok
from helpers.inference import assert_user_error

NANOGPT = MODELS / "zoo" / "nanogpt.py"


def test_a_found_tp_plan_leaves_layers_whole_whose_forward_fixes_the_head_count(tmp_path):
    """nanoGPT's attention views its q, k, v with `self.n_head`: split, a rank's share of the heads
    cannot take that shape. The build runs the found plan split, leaves the attention whole (the
    MLP still splits) and names the line and the change."""
    r = ok(aot("build", NANOGPT, "--strategy", "tp=2", "--no-onnx", "-o", tmp_path / "art"))
    line = f"nanogpt.py:{line_of(NANOGPT, 'k = k.view(B, T, self.n_head')}"
    whole = [s for s in r.stderr.splitlines() if "left whole: transformer.h.*.attn.c_attn" in s]
    assert whole and line in whole[0] and "view(B, T, -1, head_dim)" in whole[0], r.stderr
    plan = json.loads((tmp_path / "art" / "manifest.json").read_text())["tensor_parallel"]["params"]
    assert any("mlp.c_fc" in n for n in plan) and not any("attn" in n for n in plan)


def test_a_given_tp_plan_the_forward_cannot_run_split_is_refused_naming_the_line(tmp_path):
    path = MODELS / "bad_nanogpt_tp_plan.py"
    r = aot("build", path, "--strategy", "tp=2", "--no-onnx", "-o", tmp_path / "art")
    error = assert_user_error(r, "tp_plan in bad_nanogpt_tp_plan.py", "transformer.h.0.attn cannot be split as planned", "view(B, T, -1, head_dim)")
    assert f"nanogpt.py:{line_of(NANOGPT, 'k = k.view(B, T, self.n_head')}" in error
    assert not (tmp_path / "art").exists()


@pytest.mark.slow
def test_no_model_file_of_the_tests_ends_in_an_internal_error(tmp_path):
    """Every model file under tests/models (the zoo's too) builds, or is refused in one line of
    aot's own: an internal error or a traceback is a defect in aot, never an answer."""
    files = sorted([*MODELS.glob("*.py"), *(MODELS / "zoo").glob("*.py")])
    # gpt6, llama6, llama8, llama16, checkpointed6: gpt.py, llama.py and checkpointed_dropout.py at
    # another depth (for the planner's written-out blocks), the same code as files built here or by
    # examples' tests
    deeper = ("gpt6.py", "llama6.py", "llama8.py", "llama16.py", "checkpointed6.py")
    skip = ("families.py", "hf_causal_lm.py", "__init__.py", *deeper)
    files = [f for f in files if f.name not in skip]
    results = aot_each(*(("build", f, "--no-onnx", "--quiet", "-o", tmp_path / f"{f.parent.name}-{f.stem}") for f in files))
    for f, r in zip(files, results):
        output = r.stdout + r.stderr
        assert "internal error" not in output and "Traceback" not in output, f"{f}:\n{output[-3000:]}"
        assert r.returncode in (0, 1), f"{f}: exit {r.returncode}\n{output[-3000:]}"
