"""`aot run` without torchrun: each process started here (as srun or a scheduler would start it),
told who it is by --rank/--world-size/--master-addr/--master-port or by Slurm's variables, trains
exactly as the same artifact does under torchrun."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.commands import EXAMPLES, REPO, TIMEOUT, aot, clean_env, ok, show, torchrun

STEPS = 3


@pytest.fixture(scope="module")
def artifact(built) -> Path:
    """examples/mlp.py built for dp=2 (the session's build: read-only)."""
    return built(EXAMPLES / "mlp.py", "--world-size", 2, "--strategy", "dp=2", "--no-onnx")


@pytest.fixture(scope="module")
def torchrun_losses(artifact, tmp_path_factory) -> list[float]:
    metrics = tmp_path_factory.mktemp("torchrun") / "metrics.jsonl"
    ok(torchrun(2, "run", artifact, "--steps", STEPS, "--metrics", metrics, "--quiet"))
    return _losses(metrics)


def _losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _without_launchers(env: dict) -> dict:
    """No torchrun (clean_env) and no Slurm variables: this test may itself run inside a Slurm job."""
    return {k: v for k, v in env.items() if not k.startswith("SLURM_")}


def _start_each(artifact: Path, metrics: Path, processes: list[tuple[list, dict]]) -> None:
    """`python -m aot run ARTIFACT` once per (arguments, environment) at the same time, as a
    launcher other than torchrun would; each must succeed."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "aot", "run", str(artifact), "--steps", str(STEPS), "--metrics", str(metrics), "--quiet", *map(str, args)],
            cwd=REPO,
            env={**_without_launchers(clean_env()), **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args, env in processes
    ]
    try:
        results = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, show(subprocess.CompletedProcess(p.args, p.returncode, out, err))


def test_processes_started_with_rank_options_train_as_under_torchrun(artifact, torchrun_losses, tmp_path):
    metrics, port = tmp_path / "metrics.jsonl", _free_port()
    _start_each(artifact, metrics, [(["--rank", r, "--world-size", 2, "--master-addr", "127.0.0.1", "--master-port", port], {}) for r in range(2)])
    assert _losses(metrics) == torchrun_losses and len(torchrun_losses) == STEPS


def test_processes_started_by_slurm_variables_train_as_under_torchrun(artifact, torchrun_losses, tmp_path):
    metrics, port = tmp_path / "metrics.jsonl", _free_port()
    _start_each(
        artifact,
        metrics,
        [([], {"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(2)],
    )
    assert _losses(metrics) == torchrun_losses


def _one_line_error(r: subprocess.CompletedProcess, *words: str) -> str:
    assert r.returncode == 1 and "Traceback" not in r.stderr, show(r)
    errors = [line for line in r.stderr.splitlines() if line.startswith("aot: error: ")]
    assert len(errors) >= 1 and all(w in errors[0] for w in words), show(r)
    return errors[0]


def test_launch_options_that_contradict_the_launch_or_the_artifact_are_one_line_errors(artifact):
    port = str(_free_port())
    r = aot("run", artifact, "--rank", "2", "--world-size", "2", "--master-addr", "127.0.0.1", "--master-port", port)
    assert _one_line_error(r, "--rank 2 is outside --world-size 2") == r.stderr.strip()
    _one_line_error(aot("run", artifact, "--rank", "1"), "--rank 1 needs --world-size")
    r = aot("run", artifact, "--rank", "0", "--world-size", "3", "--master-addr", "127.0.0.1", "--master-port", port)
    _one_line_error(r, "built for world size 2 but this job has 3", "start 2 processes with --world-size 2")
    # Slurm's variables are facts about the process: an option may repeat them, never contradict them
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    r = aot("run", artifact, "--rank", "1", env=slurm)
    _one_line_error(r, "--rank 1 but Slurm set SLURM_PROCID=0")
    # so are torchrun's: each rank refuses a --rank that is not its RANK (rank 1's is)
    r = torchrun(2, "run", artifact, "--rank", "1", "--steps", "1", "--quiet")
    assert r.returncode != 0, show(r)
    assert "aot: error: [rank 0] --rank 1 but torchrun set RANK=0" in r.stderr, show(r)


def test_rank_options_need_a_rendezvous(artifact):
    r = aot("run", artifact, "--rank", "0", "--world-size", "2", "--steps", "1", "--quiet")
    _one_line_error(r, "no rendezvous set", "--master-addr and --master-port")
