"""`--init-from` reading (runner/execution/init_from.py): real safetensors files against a synthetic manifest.

Every (tp, fsdp, coords) combination must give exactly what runner.format.sharding's tp_slice + shard
cut from the full tensors (fsdp=3 exercises padding and pieces that start mid-row), and every bad
input must fail in one AotError line naming the problem, from headers alone.
"""

from __future__ import annotations

import json
from itertools import product

import pytest
import torch
from safetensors.torch import save_file

import runner.execution.init_from as init_from
from runner.errors import AotError
from runner.execution.init_from import check_init_from, rank_weights
from runner.format.sharding import shard, tp_slice, tp_slice_shape

# name -> (shape, dtype, tp split dim or None); "lm_head.weight" is tied to "tok_emb.weight"
PARAMS = {
    "tok_emb.weight": ([7, 3], torch.float32, None),
    "blocks.0.attn.q.weight": ([4, 5], torch.float32, 0),
    "blocks.0.attn.q.bias": ([4], torch.float32, 0),
    "blocks.0.attn.o.weight": ([5, 4], torch.float32, 1),
    "blocks.0.attn.o.bias": ([5], torch.float32, None),
    "scale": ([], torch.float32, None),
}
BUFFERS = {"pos": ([5], torch.int64), "mask": ([3, 3], torch.bool)}  # mask is non-persistent
STATE_DICT_KEYS = [
    "tok_emb.weight",
    "blocks.0.attn.q.weight",
    "blocks.0.attn.q.bias",
    "blocks.0.attn.o.weight",
    "blocks.0.attn.o.bias",
    "scale",
    "pos",
    "lm_head.weight",
]
ALIASES = {"lm_head.weight": "tok_emb.weight"}
STORED = [*PARAMS, "pos"]  # canonical names rank_weights returns


def manifest(tp: int = 1, fsdp: int = 1) -> dict:
    dims = {n: d for n, (_, _, d) in PARAMS.items() if d is not None}
    numel = {n: torch.Size(tp_slice_shape(s, dims.get(n), tp)).numel() for n, (s, _, _) in PARAMS.items()}
    return {
        "state": {
            "params": {n: [s, str(dt).removeprefix("torch.")] for n, (s, dt, _) in PARAMS.items()},
            "buffers": {n: [s, str(dt).removeprefix("torch.")] for n, (s, dt) in BUFFERS.items()},
            "aliases": dict(ALIASES),
            "state_dict_keys": list(STATE_DICT_KEYS),
        },
        "sharding": {"axis": "fsdp", "group": "aot.fsdp", "size": fsdp, "layout": "flat-padded", "params": numel} if fsdp > 1 else None,
        "tensor_parallel": {"axis": "tp", "group": "aot.tp", "size": tp, "params": dims} if tp > 1 else None,
    }


def full_tensors(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {n: torch.randn(s, generator=g).to(dtype) for n, (s, _, _) in PARAMS.items()}
    out["pos"] = torch.arange(5) * 3
    return out


def state_dict(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """As `aot checkpoint merge` writes it: tied weight under both names, each its own copy."""
    return {k: full[ALIASES.get(k, k)].clone() for k in STATE_DICT_KEYS}


def expected(full: dict, m: dict, coords: dict) -> dict[str, torch.Tensor]:
    tp, fsdp = m["tensor_parallel"] or {}, m["sharding"] or {}
    out = {}
    for name in STORED:
        dim = tp.get("params", {}).get(name)
        t = tp_slice(full[name], dim, tp.get("size", 1), coords["tp"])
        out[name] = shard(t, fsdp["size"], coords["fsdp"]) if name in fsdp.get("params", {}) else t
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A single file and an HF-style sharded folder holding the same state_dict."""
    root = tmp_path_factory.mktemp("init_from")
    sd = state_dict(full_tensors())
    save_file(sd, root / "ckpt.safetensors")
    folder = root / "hf"
    folder.mkdir()
    keys = list(sd)
    shards = {"model-00001-of-00002.safetensors": keys[:4], "model-00002-of-00002.safetensors": keys[4:]}
    for file, names in shards.items():
        save_file({k: sd[k] for k in names}, folder / file)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": {k: f for f, names in shards.items() for k in names}})
    )
    return root


# -- every layout -------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["ckpt.safetensors", "hf"])
def test_every_rank_gets_its_exact_piece(files, source):
    full = full_tensors()
    for tp, fsdp in product([1, 2], [1, 2, 3]):
        m = manifest(tp, fsdp)
        init = check_init_from(files / source, m)
        assert init.notes == []
        for t, i in product(range(tp), range(fsdp)):
            coords = {"dp": 0, "fsdp": i, "tp": t}
            got, want = rank_weights(init, coords), expected(full, m, coords)
            assert sorted(got) == sorted(want), (tp, fsdp, coords)
            for name in want:
                assert got[name].dtype == want[name].dtype and got[name].is_contiguous()
                assert torch.equal(got[name], want[name]), (tp, fsdp, coords, name)


@pytest.mark.parametrize("tp,fsdp", [(2, 1), (2, 3), (1, 2)])
def test_reads_only_the_rows_a_piece_needs(files, monkeypatch, tp, fsdp):
    """A tp slice is read alone; an fsdp piece with at most the partial rows at its two ends."""
    read = init_from._read
    seen: dict[str, int] = {}

    def counting(f, key, region):
        t = read(f, key, region)
        seen[key] = seen.get(key, 0) + t.numel()
        return t

    monkeypatch.setattr(init_from, "_read", counting)
    init = check_init_from(files / "ckpt.safetensors", manifest(tp, fsdp))
    for t, i in product(range(tp), range(fsdp)):
        seen.clear()
        rank_weights(init, {"fsdp": i, "tp": t})
        assert "lm_head.weight" not in seen  # the tied weight is read once, by its canonical name
        for name, (shape, _, dim) in PARAMS.items():
            local = tp_slice_shape(shape, dim, tp)
            numel, row = torch.Size(local).numel(), torch.Size(local[1:]).numel() if local else 1
            limit = numel if fsdp == 1 else -(-numel // fsdp) + 2 * row
            assert seen.get(name, 0) <= limit, (name, t, i)


def test_tied_weight_from_its_alias_alone(tmp_path):
    full = full_tensors()
    sd = state_dict(full)
    del sd["tok_emb.weight"]
    save_file(sd, tmp_path / "w.safetensors")
    got = rank_weights(check_init_from(tmp_path / "w.safetensors", manifest()), {})
    assert torch.equal(got["tok_emb.weight"], full["tok_emb.weight"])


def test_tied_weight_prefers_its_canonical_name(tmp_path):
    sd = state_dict(full_tensors())
    sd["lm_head.weight"] = torch.zeros(7, 3)
    save_file(sd, tmp_path / "w.safetensors")
    got = rank_weights(check_init_from(tmp_path / "w.safetensors", manifest()), {})
    assert torch.equal(got["tok_emb.weight"], sd["tok_emb.weight"])


def test_bf16_file_is_cast_with_a_note(tmp_path):
    full = full_tensors(torch.bfloat16)
    full["pos"] = torch.arange(5) * 3
    save_file(state_dict(full), tmp_path / "w.safetensors")
    m = manifest(tp=2, fsdp=3)
    init = check_init_from(tmp_path / "w.safetensors", m)
    assert len(init.notes) == 1
    assert "6 tensor(s) stored as bfloat16, cast to float32" in init.notes[0] and "\n" not in init.notes[0]
    as_fp32 = {n: t.float() if t.is_floating_point() else t for n, t in full.items()}
    coords = {"fsdp": 2, "tp": 1}
    got, want = rank_weights(init, coords), expected(as_fp32, m, coords)
    assert all(got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]) for n in want)
    assert got["scale"].dtype == torch.float32


# -- bad input: one line each ---------------------------------------------------------------------


def refused(path, m=None) -> str:
    with pytest.raises(AotError) as e:
        check_init_from(path, m or manifest(2, 2))
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    return message


def write(tmp_path, sd, name="w.safetensors"):
    save_file(sd, tmp_path / name)
    return tmp_path / name


def test_missing_keys(tmp_path):
    sd = state_dict(full_tensors())
    for k in ["blocks.0.attn.q.weight", "blocks.0.attn.q.bias", "tok_emb.weight", "lm_head.weight"]:
        del sd[k]
    msg = refused(write(tmp_path, sd))
    assert "3 missing keys (tok_emb.weight, blocks.0.attn.q.weight, blocks.0.attn.q.bias)" in msg


def test_missing_list_is_cut_short(tmp_path):
    msg = refused(write(tmp_path, {"pos": torch.arange(5)}))
    assert "6 missing keys (" in msg and ", ...)" in msg


def test_unexpected_keys(tmp_path):
    sd = state_dict(full_tensors())
    sd["mask"] = torch.ones(3, 3, dtype=torch.bool)  # non-persistent: not in state_dict()
    sd["extra.weight"] = torch.zeros(2)
    assert "2 unexpected keys (extra.weight, mask)" in refused(write(tmp_path, sd))


def test_renamed_keys_report_missing_and_unexpected_on_one_line(tmp_path):
    sd = {"model." + k: v for k, v in state_dict(full_tensors()).items()}
    msg = refused(write(tmp_path, sd))
    assert "7 missing keys" in msg and "8 unexpected keys (model.blocks.0.attn.o.bias" in msg


def test_shape_mismatch(tmp_path):
    sd = state_dict(full_tensors())
    sd["blocks.0.attn.o.weight"] = torch.zeros(4, 5)
    assert "1 shape mismatch (blocks.0.attn.o.weight is [4, 5] (model: [5, 4]))" in refused(write(tmp_path, sd))


def test_dtype_kind_mismatch(tmp_path):
    sd = state_dict(full_tensors())
    sd["pos"] = sd["pos"].float()
    sd["scale"] = torch.tensor(1, dtype=torch.int32)
    msg = refused(write(tmp_path, sd))
    assert "2 dtype mismatches (scale is int32 (model: float32), pos is float32 (model: int64))" in msg


def test_pickle_file_refused(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    torch.save(state_dict(full_tensors()), path)
    msg = refused(path)
    assert "pickles" in msg and "convert it to safetensors" in msg and "save_file" in msg


def test_folder_of_pickles_refused(tmp_path):
    torch.save(state_dict(full_tensors()), tmp_path / "pytorch_model.bin")
    msg = refused(tmp_path)
    assert "pytorch_model.bin" in msg and "safe_serialization=True" in msg


def test_missing_shard(files, tmp_path):
    index = json.loads((files / "hf" / "model.safetensors.index.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = refused(tmp_path)
    assert "names 2 missing shard(s) (model-00001-of-00002.safetensors, model-00002-of-00002.safetensors)" in msg


def test_nonexistent_path(tmp_path):
    assert "no such file or folder" in refused(tmp_path / "nope.safetensors")


def test_not_safetensors(tmp_path):
    (tmp_path / "w.safetensors").write_text("hello")
    assert "not a readable safetensors file" in refused(tmp_path / "w.safetensors")


def test_empty_folder(tmp_path):
    assert "has no model.safetensors or model.safetensors.index.json" in refused(tmp_path)


def test_index_file_path_accepted(files):
    init = check_init_from(files / "hf" / "model.safetensors.index.json", manifest(2, 2))
    assert init.sources["pos"].file.name == "model-00002-of-00002.safetensors"


def test_index_naming_a_key_its_shard_lacks(files, tmp_path):
    for f in (files / "hf").iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["pos"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "1 key(s) are not in the shard it names (pos in model-00001-of-00002.safetensors)" in refused(tmp_path)


def test_a_fake_tensors_piece_has_the_shape_and_strides_of_the_real_ones():
    """The build cuts each rank's fake parameters from meta stand-ins (aot.capture.step.cut_like):
    every cut (tp slices, fused q/k/v, expert slices, flat-padded fsdp shards) gives the shape,
    strides and dtype the real tensor's piece has."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from aot.capture.step import cut_like
    from runner.format.sharding import expert_slice, shard, tp_slice

    real = torch.randn(8, 6, 10, dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        fake = torch.empty(8, 6, 10, dtype=torch.bfloat16)
    cuts = [
        lambda t: tp_slice(t, 1, 2, 1),
        lambda t: tp_slice(t, 1, 2, 0, fused=3),
        lambda t: expert_slice(t, 4, 3),
        lambda t: shard(t, 7, 6),  # padded: 480 elements over 7 shards
        lambda t: shard(expert_slice(tp_slice(t, 2, 2, 1), 2, 1), 3, 2),
        lambda t: t.detach().transpose(0, 1),  # a view: its strides, not a contiguous copy's
    ]
    for cut in cuts:
        want, got = cut(real), cut_like(fake, cut)
        assert isinstance(got, FakeTensor) and got.fake_mode is mode
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
        assert cut_like(real, cut).equal(want)
