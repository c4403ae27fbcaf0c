"""`aot run --init-from`: training starts from the user's weights, as eager DDP does after
`model.load_state_dict(...)`, for a merged-checkpoint-style file and a Hugging Face sharded folder;
bad weights get one line before any process group starts and leave nothing behind."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from helpers.commands import EXAMPLES, aot, ok
from helpers.training import assert_same_training, train_both


def _user_weights(seed: int) -> dict[str, torch.Tensor]:
    """examples/gpt.py's state_dict under another seed (so not what the init program makes),
    every key present as `aot checkpoint merge` writes it (the tied head under both names)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpt_init_from", EXAMPLES / "gpt.py")
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    torch.manual_seed(seed)
    return {k: v.clone().contiguous() for k, v in user.model().state_dict().items()}


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("init") / "model.safetensors"
    save_file(_user_weights(7), path)
    return path


def _hf_folder(folder, weights: dict[str, torch.Tensor]):
    """A Hugging Face style sharded folder: two shard files and model.safetensors.index.json;
    the tied head is stored once, under its second name, as tied checkpoints often are."""
    folder.mkdir()
    keys = [k for k in weights if k != "tok_emb.weight"]
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2], "model-00002-of-00002.safetensors": keys[len(keys) // 2 :]}
    for name, part in halves.items():
        save_file({k: weights[k] for k in part}, folder / name)
    index = {"metadata": {"total_size": 0}, "weight_map": {k: name for name, part in halves.items() for k in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_merged_weights_file_trains_like_ddp_under_fsdp(weights_file, tmp_path):
    losses, ref_losses, weights, ref_weights = train_both(EXAMPLES / "gpt.py", 2, tmp_path, strategy="fsdp=2", init_from=weights_file)
    assert_same_training(losses, ref_losses, weights, ref_weights)


@pytest.mark.slow  # the same reading code as the merged file, per shard; CI runs it
def test_hf_sharded_folder_trains_like_ddp_under_tp(weights_file, tmp_path):
    folder = _hf_folder(tmp_path / "hf", _user_weights(7))
    losses, ref_losses, weights, ref_weights = train_both(EXAMPLES / "gpt.py", 2, tmp_path, strategy="tp=2", init_from=folder, reference_init=weights_file)
    assert_same_training(losses, ref_losses, weights, ref_weights)


@pytest.fixture(scope="module")
def gpt1(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt1") / "art"
    ok(aot("build", EXAMPLES / "gpt.py", "--batch-size", "2", "--no-onnx", "-o", out, "--quiet"))
    return out


def _bad(tmp_path, case):
    good = _user_weights(7)
    path = tmp_path / "weights.safetensors"
    if case == "pickle":
        path = tmp_path / "pytorch_model.bin"
        path.write_bytes(b"\x80\x04not really")
    elif case == "missing":
        save_file({k: v for k, v in good.items() if not k.startswith("blocks.1.")}, path)
    elif case == "unexpected":
        save_file({**good, "extra.weight": torch.zeros(3)}, path)
    elif case == "shape":
        save_file({**good, "ln_f.weight": torch.zeros(7)}, path)
    elif case == "dtype":
        save_file({**good, "ln_f.weight": torch.zeros(64, dtype=torch.int64)}, path)
    elif case == "absent":
        path = tmp_path / "nothing.safetensors"
    return path


@pytest.mark.parametrize(
    "case, needles",
    [
        ("pickle", ["pytorch_model.bin", "pickle", "safetensors"]),
        ("missing", ["missing", "blocks.1."]),
        ("unexpected", ["unexpected", "extra.weight"]),
        ("shape", ["shape", "ln_f.weight"]),
        ("dtype", ["dtype", "ln_f.weight"]),
        ("absent", ["nothing.safetensors", "no such"]),
    ],
)
def test_bad_init_from_is_one_line_and_leaves_nothing(gpt1, tmp_path, case, needles):
    """Each kind of bad weights names itself: a pickle, missing keys, unexpected keys, a shape, a
    dtype, a path with no such file; before any process group starts, and no checkpoint is made."""
    path = _bad(tmp_path, case)
    ckpt = tmp_path / "ckpt"
    r = aot("run", gpt1, "--steps", "1", "--init-from", path, "--save", ckpt, "--quiet")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("aot: error: "), r.stderr
    assert "Traceback" not in r.stderr and all(n in lines[0] for n in needles), lines[0]
    assert not ckpt.exists()
