"""The validation loss (issue #43): the eval program the build emits (forward and loss in eval
mode, no backward, the training step's sharding; under pp every microbatch through the stages) gives, after training, what eager PyTorch gives
for the merged weights with `model.eval()` under `no_grad` over the same batches; `aot eval` of
the checkpoint gives the run's figure; an artifact without an eval program (built before there
were any) says so in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.artifacts import writable_copy
from helpers.commands import MODELS, aot, ok, torchrun
from helpers.inference import assert_user_error, eager_model, load_user
from runner.format.artifact import manifest_digest
from runner.format.checkpoint import merge_checkpoint

MODEL = MODELS / "gpt_dropout.py"  # dropout 0.1: eval mode matters
BATCH, BATCHES, T, VOCAB = 4, 2, 64, 96


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """Validation rows for examples/gpt.py's shapes, more than the batches read (the rest unread)."""
    path = tmp_path_factory.mktemp("val") / "val.safetensors"
    tokens = torch.randint(0, VOCAB, (3 * BATCH * BATCHES, T + 1), generator=torch.Generator().manual_seed(3))
    save_file({"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}, str(path))
    return path


def _eager_losses(merged, rows, data_ranks: int) -> tuple[float, float]:
    """(eval-mode loss, train-mode loss) of eager PyTorch on the merged weights over the batches
    `aot` reads: global batch k is rows [k*G, (k+1)*G), G = BATCH * data_ranks."""
    user = load_user(MODEL)
    model = eager_model(user, load_file(merged))
    data, size = load_file(rows), BATCH * data_ranks
    batches = [(data["inputs"][k * size : (k + 1) * size], data["targets"][k * size : (k + 1) * size]) for k in range(BATCHES)]
    with torch.no_grad():
        evaluated = sum(float(user.loss(model(x), y)) for x, y in batches) / BATCHES
        torch.manual_seed(0)
        trained = sum(float(user.loss(model.train()(x), y)) for x, y in batches) / BATCHES
    return evaluated, trained


@pytest.mark.parametrize("strategy", ["dp=2", "fsdp=2", "tp=2", "pp=2"])
def test_val_loss_equals_eager_eval_mode_on_the_trained_weights(built, rows, strategy, tmp_path):
    art = built(MODEL, "--world-size", 2, "--batch-size", BATCH, "--strategy", strategy, "--no-onnx")
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    ok(torchrun(2, "run", art, "--steps", 2, "--eval-data", rows, "--eval-batches", BATCHES, "--metrics", metrics, "--save", ckpt, "--quiet"))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r.get("val_loss") is not None for r in records] == [False, True]  # once, after the last step (no --eval-every)
    merge_checkpoint(ckpt, tmp_path / "merged.safetensors")
    evaluated, trained = _eager_losses(tmp_path / "merged.safetensors", rows, 1 if strategy in ("tp=2", "pp=2") else 2)
    assert abs(records[-1]["val_loss"] - evaluated) <= 1e-5, (records[-1]["val_loss"], evaluated)
    assert abs(trained - evaluated) > 10 * 1e-5  # dropout changes the loss more than the tolerance: the figure is eval mode's
    if strategy == "dp=2":  # the command alone, on the checkpoint: the same program on the same weights
        r = ok(torchrun(2, "eval", art, "--data", rows, "--batches", BATCHES, "--resume", ckpt, "--json"))
        once = json.loads(r.stdout.strip().splitlines()[-1])
        assert once["val_loss"] == records[-1]["val_loss"] and once["step"] == 2 and once["samples"] == BATCH * 2 * BATCHES
        # the same weights given as a state_dict (what `aot checkpoint merge` wrote)
        r = ok(torchrun(2, "eval", art, "--data", rows, "--batches", BATCHES, "--init-from", tmp_path / "merged.safetensors", "--json"))
        assert json.loads(r.stdout.strip().splitlines()[-1])["val_loss"] == records[-1]["val_loss"]


def test_eval_every_records_each_and_an_artifact_without_an_eval_program_says_so(built, rows, tmp_path):
    art = built(MODEL, "--world-size", 2, "--batch-size", BATCH, "--strategy", "dp=2", "--no-onnx")
    metrics = tmp_path / "m.jsonl"
    r = ok(torchrun(2, "run", art, "--steps", 4, "--eval-data", rows, "--eval-every", 2, "--eval-batches", 1, "--metrics", metrics))
    assert [json.loads(line).get("val_loss") is not None for line in metrics.read_text().splitlines()] == [False, True, False, True]
    assert r.stderr.count("val_loss") == 2
    assert_user_error(aot("run", art, "--eval-every", 2), "--eval-every needs --eval-data")
    # an artifact built before there were eval programs: its ranks name none
    older = writable_copy(art, tmp_path / "older")
    manifest = json.loads((older / "manifest.json").read_text())
    manifest["ranks"] = [{k: v for k, v in entry.items() if k != "eval_program"} for entry in manifest["ranks"]]
    manifest["digest"] = manifest_digest(manifest)
    (older / "manifest.json").write_text(json.dumps(manifest))
    for command in (("run", older, "--eval-data", rows), ("eval", older, "--data", rows)):
        assert_user_error(aot(*command, "--rank", 0, "--world-size", 2), "has no eval program")
