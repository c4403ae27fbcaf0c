"""Faults under torchrun: a killed rank (dp, fsdp, pp), a crash while checkpointing, a rank stuck in a
collective, a pipeline stage that stops answering."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers.commands import EXAMPLES, REPO, clean_env, ok, torchrun

STEPS, EVERY = 160, 20


@pytest.fixture(scope="module")
def gpt(built):
    return built(EXAMPLES / "gpt.py", "--world-size", 2, "--batch-size", 4, "--no-onnx")


# the builds other test files make too (one build per session: conftest.built)
BUILDS = {
    "dp=2": (EXAMPLES / "gpt.py", "--world-size", 2, "--batch-size", 4, "--no-onnx"),
    "fsdp=2": (EXAMPLES / "mlp.py", "--world-size", 2, "--strategy", "fsdp=2", "--no-onnx"),
    "pp=2": (REPO / "tests" / "models" / "gpt4.py", "--strategy", "pp=2", "--world-size", 2, "--no-onnx"),
}


def launch(*args, restarts=0):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "-m",
        "aot",
        *map(str, args),
    ]
    return subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(metrics, step, proc, limit=240):
    deadline = time.time() + limit
    while time.time() < deadline:
        if metrics.exists():
            lines = metrics.read_text().splitlines()
            if lines and json.loads(lines[-1])["step"] >= step:
                return
        assert proc.poll() is None, "run ended before the fault could be injected"
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


def workers(agent_pid):
    out = subprocess.run(["pgrep", "-P", str(agent_pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def checkpoint_tensors(folder):
    """(step, weights and optimizer of every shard): one shard without sharding, one per rank
    under fsdp, one per stage under pp."""
    index = json.loads((folder / "checkpoint.json").read_text())
    parts = [load_file(folder / shard[part]) for shard in index["shards"] for part in ("weights", "optimizer")]
    return index["step"], *parts


@pytest.mark.parametrize("strategy", ["dp=2", pytest.param("fsdp=2", marks=pytest.mark.slow), pytest.param("pp=2", marks=pytest.mark.slow)])
def test_killed_rank_restarts_from_last_checkpoint_bit_identical(built, tmp_path, strategy):
    """kill -9 of one rank mid-run under torchrun --max-restarts: every rank restarts from the last
    good checkpoint and ends bit-identical to a run never killed (under fsdp=2 every rank's shard,
    under pp=2 every stage's)."""
    art = built(*BUILDS[strategy])
    clean = tmp_path / "clean"
    ok(torchrun(2, "run", art, "--steps", STEPS, "--save", clean, "--save-every", EVERY, "--quiet"))

    faulty, metrics = tmp_path / "faulty", tmp_path / "metrics.jsonl"
    proc = launch(
        "run", art, "--steps", STEPS, "--save", faulty, "--save-every", EVERY, "--metrics", metrics, restarts=2
    )  # a second chance if a restart's rendezvous races the dying group
    wait_for_step(metrics, 2 * EVERY + 5, proc)
    os.kill(workers(proc.pid)[-1], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "restarted by torchrun: resumed from" in err
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    # every step ran; those after the last checkpoint before the kill ran twice (none, when the kill
    # landed right after a checkpoint: seen once on a fast run)
    assert steps[-1] == STEPS and set(steps) == set(range(1, STEPS + 1))

    a, b = checkpoint_tensors(clean), checkpoint_tensors(faulty)
    assert a[0] == b[0] == STEPS and len(a) == len(b) == (3 if strategy == "dp=2" else 5)
    for clean_part, faulty_part in zip(a[1:], b[1:]):
        assert sorted(clean_part) == sorted(faulty_part)
        assert all(torch.equal(clean_part[k], faulty_part[k]) for k in clean_part)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signalled_rank_stops_every_rank_at_one_step_checkpointed_and_resumes_exactly(gpt, tmp_path, sig):
    """SIGTERM or SIGUSR1 to one rank only: both ranks finish the same step, the checkpoint is
    written, each exits with status 75 (torchrun reports the workers' failure); `--resume` then
    ends bit-identical to a run never interrupted."""
    clean = tmp_path / "clean"
    ok(torchrun(2, "run", gpt, "--steps", STEPS, "--save", clean, "--quiet"))
    stopped, metrics = tmp_path / "stopped", tmp_path / "metrics.jsonl"
    proc = launch("run", gpt, "--steps", STEPS, "--save", stopped, "--metrics", metrics)
    wait_for_step(metrics, 10, proc)
    os.kill(workers(proc.pid)[-1], sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0, err[-3000:]
    assert "exitcode  : 75" in err, err[-3000:]  # torchrun's report of each worker
    assert f"{sig.name} received: stopped with every rank after step" in err, err[-3000:]
    step = json.loads((stopped / "checkpoint.json").read_text())["step"]
    assert 10 < step < STEPS and f"preempted at step {step} of {STEPS}: resume with --resume {stopped}" in err, err[-3000:]
    ok(torchrun(2, "run", gpt, "--steps", STEPS - step, "--resume", stopped, "--save", stopped, "--quiet"))
    a, b = checkpoint_tensors(clean), checkpoint_tensors(stopped)
    assert a[0] == b[0] == STEPS
    for clean_part, resumed_part in zip(a[1:], b[1:]):
        assert sorted(clean_part) == sorted(resumed_part)
        assert all(torch.equal(clean_part[k], resumed_part[k]) for k in clean_part)


def test_a_save_the_disk_cannot_hold_fails_in_one_line_and_keeps_the_last_good_checkpoint(gpt, tmp_path):
    """A full disk, as a file-size limit on the ranks (a write past it fails with EFBIG, as with
    ENOSPC): the save fails on both ranks in one line each, the new step's files are gone, and the
    last good checkpoint still resumes."""
    import resource

    ckpt = tmp_path / "ckpt"
    ok(torchrun(2, "run", gpt, "--steps", 3, "--save", ckpt, "--quiet"))
    before = sorted(p.name for p in ckpt.iterdir())
    limit = min(p.stat().st_size for p in ckpt.glob("*.safetensors")) // 2

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "aot"]
    cmd += ["run", str(gpt), "--steps", "2", "--resume", str(ckpt), "--save", str(ckpt), "--quiet"]
    r = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, preexec_fn=small_files, timeout=300)
    assert r.returncode != 0 and "internal error" not in r.stderr, r.stderr[-3000:]  # (torchrun prints its own traceback)
    errors = [line for line in r.stderr.splitlines() if "aot: error:" in line]
    assert len(errors) == 2, r.stderr[-3000:]
    assert any("cannot write the checkpoint of step 5 (File too large)" in e for e in errors), errors
    assert all("the last good checkpoint (step 3) is intact" in e for e in errors), errors
    assert sorted(p.name for p in ckpt.iterdir()) == before  # nothing of step 5 left behind
    ok(torchrun(2, "run", gpt, "--steps", 2, "--resume", ckpt, "--save", ckpt, "--quiet"))
    assert json.loads((ckpt / "checkpoint.json").read_text())["step"] == 5


CRASHING_WRITER = """
import sys, torch
from runner.format.checkpoint import save_checkpoint
spec = {"state_dict_keys": ["w"], "aliases": {}, "params": {"w": [[1 << 22], "float32"]}}
step = int(sys.argv[2])
while True:
    step += 1
    w = torch.full((1 << 22,), float(step))
    save_checkpoint(sys.argv[1], step, {"w": w}, {"w:m": w.clone()}, spec)
"""


def test_crash_while_checkpointing_never_damages_the_last_good_one(tmp_path):
    from runner.format.checkpoint import load_checkpoint, save_checkpoint

    folder = tmp_path / "ck"
    save_checkpoint(
        folder,
        1,
        {"w": torch.full((1 << 22,), 1.0)},
        {"w:m": torch.full((1 << 22,), 1.0)},
        {"state_dict_keys": ["w"], "aliases": {}, "params": {"w": [[1 << 22], "float32"]}},
    )
    for attempt in range(6):
        writer = subprocess.Popen([sys.executable, "-c", CRASHING_WRITER, str(folder), str(10 * attempt + 1)], cwd=REPO, env=clean_env())
        time.sleep(0.4 + 0.23 * attempt)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        index, weights, optimizer = load_checkpoint(folder)  # verifies every hash
        assert torch.equal(weights["w"], torch.full((1 << 22,), float(index["step"])))
        assert torch.equal(optimizer["w:m"], weights["w"])


def test_stuck_rank_ends_with_a_timeout_naming_the_collective(gpt, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = launch("run", gpt, "--steps", 900, "--timeout", 5, "--metrics", metrics)
    stopped = None
    try:
        wait_for_step(metrics, 3, proc)
        stopped = workers(proc.pid)[-1]
        os.kill(stopped, signal.SIGSTOP)
        deadline = time.time() + 120
        err = ""
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
            if stopped and not any(os.path.exists(f"/proc/{p}") for p in workers(proc.pid) if p != stopped):
                break
        os.kill(stopped, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    line = next((l for l in err.splitlines() if l.startswith("aot: error:")), None)
    assert line is not None, err[-3000:]
    assert "did not complete within 5 s" in line and "all_reduce over aot.dp" in line, line


def test_a_pipeline_stage_that_stops_answering_ends_in_one_line_naming_the_transfer(built, tmp_path):
    """Stage 1's rank leaves after 3 steps (it is given --steps 3, stage 0's rank 900): stage 0
    waits in step 4 for microbatch 0's gradient and ends at --timeout in one line naming the
    microbatch, the stage pair and the direction; the rank that left says another rank did not
    reach the end. No traceback from either."""
    art = built(*BUILDS["pp=2"])
    steps = '"$([ "$RANK" = 1 ] && echo 3 || echo 900)"'
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python"]
    cmd += ["bash", "-c", f"exec {sys.executable} -m aot run {art} --steps {steps} --timeout 5"]
    r = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.startswith("aot: ")]
    stage0 = next((l for l in lines if l.startswith("aot: error: [rank 0]")), None)
    assert stage0 is not None, r.stderr[-3000:]
    expected = "step 4: pipeline rank 0 waited to receive microbatch 0's gradient from stage 1 to stage 0 (backward, sender: pipeline rank 1)"
    assert expected in stage0, stage0
    # stage 1's rank is gone or waits at the end of its run: a timeout, or the link closed
    assert "got no answer within 5 s" in stage0 or "lost the link" in stage0, stage0
    assert any(l.startswith("aot: error: [rank 1] finished, but another rank did not reach the end of the run") for l in lines), lines
    assert "[rank0]: Traceback" not in r.stderr and "[rank1]: Traceback" not in r.stderr, r.stderr[-3000:]
