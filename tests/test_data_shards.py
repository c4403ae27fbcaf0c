"""--data as users have it (issue #43, first part): token shards (llm.c's .bin, raw .bin, .npy) and
folders or globs of them, memory-mapped and cut into windows of T + 1 tokens, train as eager DDP
does on the same windows; safetensors rows read through a memory map the same as read whole; bad
shards refused in one line."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.commands import EXAMPLES, MODELS, aot, ok, torchrun
from helpers.inference import assert_user_error
from helpers.training import STEPS, assert_same_training, reference
from runner.format.checkpoint import merge_checkpoint

GPT = EXAMPLES / "gpt.py"
T, VOCAB, WINDOWS, BATCH = 64, 96, 24, 4


def _llmc(path, tokens: np.ndarray) -> None:
    """llm.c's shard: 256 int32 (magic, version 1, token count, zeros), then uint16 tokens."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16).tobytes())


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    """One token stream in every form: two llm.c shards cut mid-window, a .npy, a raw uint32 .bin,
    and its windows as safetensors rows (what eager reads)."""
    root = tmp_path_factory.mktemp("tokens")
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=WINDOWS * T + 1 + 7)  # a tail shorter than a window
    (root / "shards").mkdir()
    cut = 5 * T + 13
    _llmc(root / "shards" / "train_000.bin", tokens[:cut])
    _llmc(root / "shards" / "train_001.bin", tokens[cut:])
    np.save(root / "tokens.npy", tokens.astype(np.int32))
    tokens.astype(np.uint32).tofile(root / "raw.bin")
    windows = torch.from_numpy(np.stack([tokens[i * T : i * T + T + 1] for i in range(WINDOWS)])).long()
    save_file({"inputs": windows[:, :-1].contiguous(), "targets": windows[:, 1:].contiguous()}, str(root / "windows.safetensors"))
    return root


def _train(art, data, folder, *extra):
    metrics, ckpt = folder / "m.jsonl", folder / "ckpt"
    ok(torchrun(2, "run", art, "--steps", STEPS, "--data", data, "--metrics", metrics, "--save", ckpt, "--quiet", *extra))
    merge_checkpoint(ckpt, folder / "merged.safetensors")
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()], load_file(folder / "merged.safetensors")


def test_token_shards_train_as_eager_ddp_on_the_same_windows(built, stream, tmp_path):
    """Two llm.c shards (a window straddles them) under dp=2 against eager DDP reading the windows
    as rows; the .npy, the raw .bin (--token-dtype), a glob of the shards and the windows as
    safetensors rows (memory-mapped) train bit-identically to the shards."""
    art = built(GPT, "--world-size", 2, "--batch-size", BATCH, "--no-onnx")
    losses, weights = _train(art, stream / "shards", tmp_path / "shards")
    ref = reference(GPT, stream / "windows.safetensors", 2, BATCH, tmp_path, steps=STEPS)
    assert_same_training(losses, json.loads((ref / "losses.json").read_text()), weights, load_file(ref / "state_dict.safetensors"))
    for name, data, extra in (
        ("npy", stream / "tokens.npy", ()),
        ("raw", stream / "raw.bin", ("--token-dtype", "uint32")),
        ("glob", stream / "shards" / "train_*.bin", ()),
        ("rows", stream / "windows.safetensors", ()),
    ):
        (tmp_path / name).mkdir()
        other, other_weights = _train(art, data, tmp_path / name, *extra)
        assert other == losses, name
        assert all(torch.equal(other_weights[k], weights[k]) for k in weights), name


@pytest.mark.parametrize("strategy", ["fsdp=2", pytest.param("tp=2", marks=pytest.mark.slow), pytest.param("pp=2", marks=pytest.mark.slow)])
def test_token_shards_train_as_eager_ddp_under_every_strategy(built, stream, strategy, tmp_path):
    """The two llm.c shards under fsdp, tp and pp against eager DDP over the data-parallel ranks
    reading the windows as rows: losses and merged weights (tp ranks read the same rows; pipeline
    ranks the rows their stages take)."""
    art = built(GPT, "--world-size", 2, "--batch-size", BATCH, "--strategy", strategy, "--no-onnx", "--no-eval")
    losses, weights = _train(art, stream / "shards", tmp_path)
    ref = reference(GPT, stream / "windows.safetensors", 2 if strategy == "fsdp=2" else 1, BATCH, tmp_path, steps=STEPS)
    assert_same_training(losses, json.loads((ref / "losses.json").read_text()), weights, load_file(ref / "state_dict.safetensors"))


def test_shuffled_epochs_read_the_seeded_order_and_resume_exactly(built, stream, tmp_path):
    """--shuffle 7 over two epochs of the token shards trains bit-identically to an unshuffled run on
    the windows written out in runner.execution.data.shuffled_rows's order; stopped after epoch 1 and resumed
    with the same seed, it reads the same samples and ends with the same weights."""
    from runner.execution.data import shuffled_rows

    art = built(GPT, "--world-size", 2, "--batch-size", BATCH, "--no-onnx")
    steps = 2 * WINDOWS // (2 * BATCH)  # two epochs
    run = lambda folder, data, *extra: ok(
        torchrun(2, "run", art, "--data", data, "--metrics", folder / "m.jsonl", "--save", folder / "ckpt", "--quiet", *extra)
    )
    (tmp_path / "shuffled").mkdir()
    run(tmp_path / "shuffled", stream / "shards", "--steps", steps, "--shuffle", 7)
    rows = load_file(stream / "windows.safetensors")
    order = torch.cat([shuffled_rows(WINDOWS, 7, epoch) for epoch in range(2)])
    save_file({k: v[order].contiguous() for k, v in rows.items()}, str(tmp_path / "in_order.safetensors"))
    (tmp_path / "in_order").mkdir()
    run(tmp_path / "in_order", tmp_path / "in_order.safetensors", "--steps", steps)
    (tmp_path / "resumed").mkdir()
    run(tmp_path / "resumed", stream / "shards", "--steps", steps // 2, "--shuffle", 7)
    run(tmp_path / "resumed", stream / "shards", "--steps", steps - steps // 2, "--shuffle", 7, "--resume", tmp_path / "resumed" / "ckpt")
    losses = {
        name: [json.loads(line)["loss"] for line in (tmp_path / name / "m.jsonl").read_text().splitlines()] for name in ("shuffled", "in_order", "resumed")
    }
    assert losses["shuffled"] == losses["in_order"] == losses["resumed"] and len(losses["shuffled"]) == steps
    for name in ("in_order", "resumed"):
        merge_checkpoint(tmp_path / name / "ckpt", tmp_path / f"{name}.safetensors")
    merge_checkpoint(tmp_path / "shuffled" / "ckpt", tmp_path / "shuffled.safetensors")
    weights = {name: load_file(tmp_path / f"{name}.safetensors") for name in ("shuffled", "in_order", "resumed")}
    assert all(torch.equal(weights["shuffled"][k], weights[other][k]) for other in ("in_order", "resumed") for k in weights["shuffled"])


def test_bad_token_data_is_one_line(built, stream, tmp_path):
    art = built(GPT, "--world-size", 1, "--batch-size", BATCH, "--no-onnx")
    short = tmp_path / "short.bin"
    _llmc(short, np.arange(T, dtype=np.uint16))  # one token short of a window
    wrong_count = tmp_path / "wrong.bin"
    _llmc(wrong_count, np.arange(3 * T, dtype=np.uint16))
    with open(wrong_count, "ab") as f:
        f.write(b"\0\0")
    out_of_vocab = tmp_path / "vocab.bin"
    tokens = np.arange(3 * T) % VOCAB
    tokens[100] = VOCAB  # one id past gpt.py's vocabulary: its embedding's rows (the manifest's data.below)
    _llmc(out_of_vocab, tokens)
    rows = load_file(stream / "windows.safetensors")
    rows["targets"][2, 5] = VOCAB + 3
    save_file(rows, str(tmp_path / "vocab_rows.safetensors"))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.bin").write_bytes((stream / "shards" / "train_000.bin").read_bytes())
    (mixed / "b.safetensors").write_bytes((stream / "windows.safetensors").read_bytes())
    cases = [
        ((stream / "raw.bin",), "no llm.c header", "--token-dtype"),
        ((short,), "fewer than one window of 65"),
        ((wrong_count,), "its header says 192 tokens, the file holds 193"),
        ((tmp_path / "nothing_*.bin",), "the pattern matches no file"),
        ((mixed,), "mixes safetensors and token shards"),
        ((stream / "windows.safetensors", "--token-dtype", "uint16"), "--token-dtype applies to token streams"),
        ((out_of_vocab,), "vocab.bin: token offset 100: token id 96 is outside the model's vocabulary of 96"),
        ((tmp_path / "vocab_rows.safetensors",), "targets row 2, position [5]: token id 99 is outside the model's vocabulary of 96"),
    ]
    assert json.loads((art / "manifest.json").read_text())["data"]["targets"]["below"] == VOCAB
    for (data, *extra), *needles in cases:
        r = aot("run", art, "--steps", 3, "--data", data, *extra, "--quiet")
        assert_user_error(r, *needles)
    # rank 0 of a 2-rank job, alone and given no rendezvous: the shards (--data and --eval-data) are
    # refused before any process group would start (or say it has no rendezvous)
    two = built(GPT, "--world-size", 2, "--batch-size", BATCH, "--no-onnx")
    for flag in ("--data", "--eval-data"):
        assert_user_error(aot("run", two, "--rank", 0, "--world-size", 2, flag, short), "fewer than one window of 65")


def test_a_shard_rewritten_during_the_run_is_refused(stream, tmp_path):
    """A shard changed under a run would feed other samples than the run's order says: the next
    read of it refuses, in one line naming it (token streams and safetensors rows)."""
    from runner.errors import AotError
    from runner.execution.data import DataSource

    spec = {"batch_size": BATCH, "inputs": [{"shape": [BATCH, T], "dtype": "int64"}], "targets": {"shape": [BATCH, T], "dtype": "int64"}}
    for name in ("shards/train_001.bin", "windows.safetensors"):
        copy = tmp_path / name.replace("/", "_")
        copy.write_bytes((stream / name).read_bytes())
        source = DataSource.from_file(copy, spec, 0, 1)
        first = source.batch(0)
        assert torch.equal(source.batch(0)[1], first[1])  # read again unchanged: fine
        data = bytearray(copy.read_bytes())
        data[-2:] = b"\x01\x00" if data[-2:] != b"\x01\x00" else b"\x02\x00"
        copy.write_bytes(bytes(data))
        stamp = copy.stat()
        os.utime(copy, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))  # a second later, whatever the clock's resolution
        with pytest.raises(AotError, match=r"was rewritten during the run"):
            source.batch(source.rows // BATCH - 1)  # the last rows: in the changed shard
        copy.write_bytes(bytes(data) + b"\0\0")
        with pytest.raises(AotError, match=r"changed size \(\d+ -> \d+ bytes\) during the run"):
            source.batch(source.rows // BATCH - 1)


def test_resuming_in_another_data_order_is_refused(built, stream, tmp_path):
    """The checkpoint records --shuffle's seed (or none); a --resume with another would read other
    samples than the run without the restart: refused in one line, before a step."""
    art = built(GPT, "--world-size", 1, "--batch-size", BATCH, "--no-onnx")
    ckpt = tmp_path / "ckpt"
    ok(aot("run", art, "--steps", 1, "--data", stream / "shards", "--shuffle", 7, "--save", ckpt, "--quiet"))
    index = json.loads((ckpt / "checkpoint.json").read_text())
    assert index["data_order"] == {"shuffle": 7, "order": "feistel-4"}
    for extra, said in (((), "no --shuffle"), (("--shuffle", 8), "--shuffle 8")):
        r = aot("run", art, "--steps", 1, "--data", stream / "shards", *extra, "--resume", ckpt, "--quiet")
        assert_user_error(r, "the run read its data --shuffle 7", f"resuming with {said}")
    ok(aot("run", art, "--steps", 1, "--data", stream / "shards", "--shuffle", 7, "--resume", ckpt, "--quiet"))
    # a checkpoint of a runner that shuffled with torch.randperm (it recorded no order)
    index = json.loads((ckpt / "checkpoint.json").read_text())
    (ckpt / "checkpoint.json").write_text(json.dumps({**index, "data_order": {"shuffle": 7}}))
    r = aot("run", art, "--steps", 1, "--data", stream / "shards", "--shuffle", 7, "--resume", ckpt, "--quiet")
    assert_user_error(r, "shuffled its data in an order this runner does not reproduce (torch.randperm")


def test_a_4_gib_token_file_adds_under_200_mb_of_resident_memory(built, tmp_path):
    """A 4 GiB llm.c shard (sparse: 2^31 tokens, its holes read as zeros) under dp=2, shuffled (windows
    from anywhere in the file; the order computed row by row, runner.execution.data.RowOrder): rank 0's peak
    resident memory (the metrics' host_peak_rss_mib) is within 200 MB of the same run's on a 1 MiB
    shard, and the prefetching reader's wait is in every record: the file is memory-mapped and a
    rank brings in only the pages of the windows it reads."""
    art = built(GPT, "--world-size", 2, "--batch-size", BATCH, "--no-onnx")
    big = tmp_path / "big.bin"
    count = (4 * 2**30 - 1024) // 2
    header = np.zeros(256, dtype=np.int32)
    header[:3] = 20240520, 1, count
    with open(big, "wb") as f:
        f.write(header.tobytes())
        f.truncate(1024 + 2 * count)
    assert big.stat().st_size == 4 * 2**30
    small = tmp_path / "small.bin"
    _llmc(small, np.zeros(2**19, dtype=np.uint16))
    peaks = {}
    for name, data in (("small", small), ("big", big)):
        metrics = tmp_path / f"{name}.jsonl"
        ok(torchrun(2, "run", art, "--steps", 5, "--data", data, "--shuffle", 1, "--metrics", metrics, "--quiet"))
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert all(r["data_wait_s"] >= 0 for r in records) and len(records) == 5
        peaks[name] = records[-1]["host_peak_rss_mib"]
    assert peaks["big"] - peaks["small"] < 200e6 / 2**20, peaks


def test_a_pipelines_middle_rank_reads_no_data(built, stream, tmp_path):
    """pp=3: the middle stage's program takes no inputs or targets, so its rank reads nothing (it
    says so) while the first and last read the shards; training from them equals eager on the same
    windows."""
    gpt4 = MODELS / "gpt4.py"
    art = built(gpt4, "--world-size", 3, "--strategy", "pp=3", "--batch-size", BATCH, "--microbatches", 4, "--no-onnx")
    metrics = tmp_path / "m.jsonl"
    r = ok(torchrun(3, "run", art, "--steps", 2, "--data", stream / "shards", "--metrics", metrics))
    said = [line for line in r.stderr.splitlines() if "reads no data" in line]
    assert said == ["[rank 1] pipeline rank 1's program takes no inputs or targets: it reads no data"], r.stderr
    ref = reference(gpt4, stream / "windows.safetensors", 1, BATCH, tmp_path, steps=2)
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert losses == pytest.approx(json.loads((ref / "losses.json").read_text()), abs=1e-5)
