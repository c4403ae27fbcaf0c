"""The init program (runner/execution/init_program.py) replays a model's construction exactly, and a rank
that keeps only its piece of each parameter holds about that piece plus one whole parameter."""

from __future__ import annotations

import subprocess
import sys

import torch

from aot.capture.model_file import load_model_file
from aot.capture.training_state import build_training_state
from aot.emit.artifact import export_init
from helpers.commands import MODELS, REPO
from runner.execution.init_program import load_init_graph, replay
from runner.format.program import encode_program


def _init_graph(model_file):
    mf = load_model_file(model_file)
    state = build_training_state(mf, 0, 1)
    code, constants = encode_program(export_init(state))
    return mf, load_init_graph(code, constants), [*state.params, *state.buffers]


def test_reinitialized_weights_are_released_between_their_draws():
    """nanoGPT-style construction: every Linear is built (kaiming uniform_) and later drawn again
    (normal_) by `_init_weights`. Keeping an eighth of each parameter, the replay never holds
    more than the kept pieces plus the largest parameter (and a bias), though the eager
    constructor holds every weight at once; and the pieces are eager's, bit for bit."""
    mf, graph, names = _init_graph(MODELS / "reinit_weights.py")
    peak = []
    eighth = replay(graph, names, 3, keep=lambda name, t: t.reshape(-1)[: t.numel() // 8].clone(), peak=peak)
    torch.manual_seed(3)
    eager = dict(mf.model().named_parameters())
    whole = sum(p.numel() * p.element_size() for p in eager.values())
    kept = sum(t.numel() * t.element_size() for t in eighth.values())
    largest = max(p.numel() * p.element_size() for p in eager.values())
    assert peak[0] <= kept + largest + 64 * 1024 and peak[0] < whole / 2, (peak[0], kept, largest, whole)
    for name, p in eager.items():
        assert torch.equal(eighth[name], p.detach().reshape(-1)[: p.numel() // 8]), name


def test_only_the_constant_buffers_replay_without_the_random_draws():
    """--init-from needs just the buffers no state_dict holds (a mask): only their ops run."""
    mf, graph, names = _init_graph(MODELS / "reinit_weights.py")
    torch.manual_seed(0)
    eager = mf.model()
    got = replay(graph, names, 0, only={"mask"})
    assert list(got) == ["mask"] and torch.equal(got["mask"], eager.mask)


def test_a_pipeline_rank_keeps_only_its_stage():
    """A pipeline rank's replay (`only`: its stages' tensors) still draws every random number in
    order, so its tensors are eager's bit for bit, but holds no other stage's tensor past its last
    use: its peak is its own tensors plus the largest parameter, not the whole model."""
    mf, graph, names = _init_graph(MODELS / "reinit_weights.py")
    torch.manual_seed(5)
    eager = dict(mf.model().named_parameters())
    ordered = list(eager)
    stage = set(ordered[len(ordered) // 2 :])  # the second half: the draws before it must still happen
    peak = []
    mine = replay(graph, names, 5, only=stage, peak=peak)
    assert set(mine) == stage
    for name in stage:
        assert torch.equal(mine[name], eager[name].detach()), name
    whole = sum(p.numel() * p.element_size() for p in eager.values())
    kept = sum(t.numel() * t.element_size() for t in mine.values())
    largest = max(p.numel() * p.element_size() for p in eager.values())
    assert peak[0] <= kept + largest + 64 * 1024 and kept < whole, (peak[0], kept, largest, whole)


def test_a_library_queried_on_import_while_constructing_stays_out_of_the_program(tmp_path):
    """A constructor that imports a library which calls its own operator on import (torchaudio's
    cuda_version(), imported by transformers' GPT-2 on the H200 machine) records that call; the
    runner, which never imports the library, then could not decode the init program. The
    capture drops such calls (unused, no graph inputs, no tensor out), and the program decodes in
    a process that has never imported the library."""
    mf, graph, names = _init_graph(MODELS / "queries_an_op_library.py")
    assert not any("aot_test_query" in str(n.target) for n in graph.graph.nodes)
    state = build_training_state(load_model_file(MODELS / "queries_an_op_library.py"), 0, 1)
    code, constants = encode_program(export_init(state))
    (tmp_path / "init.json").write_bytes(code)
    (tmp_path / "init.safetensors").write_bytes(constants or b"")
    decode = (
        "import sys; from pathlib import Path; from runner.execution.init_program import load_init_graph; "
        "d = Path(sys.argv[1]); c = (d / 'init.safetensors').read_bytes(); "
        "load_init_graph((d / 'init.json').read_bytes(), c or None); "
        "assert 'helpers.query_op_library' not in sys.modules; print('decoded')"
    )
    r = subprocess.run([sys.executable, "-c", decode, str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "decoded" in r.stdout, r.stderr[-2000:]
    torch.manual_seed(0)
    eager = dict(mf.model().named_parameters())
    got = replay(graph, names, 0)
    for name, p in eager.items():
        assert torch.equal(got[name], p), name


def test_initializers_that_draw_or_read_values_replay_as_eager():
    """nn.init's initializers, trunc_normal_'s rejection sampler (issue #40) among them, replay
    bit-identical to `torch.manual_seed(seed); model()` for several seeds."""
    mf, graph, names = _init_graph(MODELS / "initializers.py")
    ops = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert "aot_init.trunc_normal_.default" in ops, ops  # recorded as one op, not its draws
    for seed in (0, 1, 7):
        torch.manual_seed(seed)
        eager = mf.model().state_dict()
        got = replay(graph, names, seed)
        for name, t in eager.items():
            assert torch.equal(got[name], t), (seed, name)


def test_the_planners_state_is_the_builds_without_its_init_program():
    """The planner makes the model on fake tensors of the mode make_fx records it in, without
    recording (`build_training_state(..., record=False)`): every parameter, buffer, optimizer
    state tensor and setting is the recorded state's; only the init program is missing."""
    import os

    from torch._subclasses.fake_tensor import FakeTensor

    def facts(t: torch.Tensor) -> tuple:
        return (tuple(t.shape), t.dtype, t.stride(), t.requires_grad, type(t).__name__)

    # initializers.py draws with every torch.nn.init initializer (trunc_normal_ through the
    # runner's init op, as the build records it); a constructor the build refuses is recorded (and
    # refused) instead: tests/test_bad_input.py
    for file, size in [("examples/gpt.py", None), ("examples/llama.py", "tiny"), ("examples/moe.py", "tiny"), ("tests/models/initializers.py", None)]:
        path = REPO / file
        if size:
            os.environ["AOT_SIZE"] = size
        try:
            mf = load_model_file(path)
            recorded, made = build_training_state(mf, 0, 3), build_training_state(mf, 0, 3, record=False)
        finally:
            os.environ.pop("AOT_SIZE", None)
        assert recorded.init_graph is not None and made.init_graph is None, path
        for name in ("params", "buffers", "optimizer_state"):
            a, b = getattr(recorded, name), getattr(made, name)
            assert {k: facts(v) for k, v in a.items()} == {k: facts(v) for k, v in b.items()}, (path, name)
            assert all(isinstance(v, FakeTensor) for v in b.values()), (path, name)
        settings = ("optimizer_slots", "optimizer_fills", "param_groups", "optimizer_class", "group_settings", "lr_schedule", "lr_constant")
        for name in (*settings, "aliases", "state_dict_keys"):
            assert getattr(recorded, name) == getattr(made, name), (path, name)
        assert [n for n, _ in recorded.model.named_modules()] == [n for n, _ in made.model.named_modules()], path
