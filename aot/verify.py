"""`aot verify`: the user's proof, before shipping, that an artifact trains like eager PyTorch.

The artifact's ranks run as local CPU processes under torchrun (gloo). Each process runs its rank
of the artifact and, on the same rows of data, eager DistributedDataParallel built from the model
file with the same seed, optimizer, schedule and clipping; rank 0 reports the largest differences.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from aot.capture.model_file import load_model_file
from aot.errors import AotError
from runner.format.artifact import Artifact


def max_local_ranks() -> int:
    """How many CPU rank processes this machine is trusted to run at once."""
    return max(8, 4 * (os.cpu_count() or 1))


def verify(artifact_dir: Path, model_file: Path, *, steps: int, data: Path | None, tolerance: float) -> dict:
    artifact = Artifact(artifact_dir)
    mf = load_model_file(model_file)
    built = artifact.manifest["build"].get("model_sha256")
    if built != mf.sha256:
        raise AotError(f"{model_file}: differs from the model file the artifact was built from (sha256 {mf.sha256[:12]}... vs {str(built)[:12]}...)")
    world = artifact.world_size
    batchnorm = artifact.manifest.get("batchnorm") or {}
    if batchnorm.get("synced") and batchnorm.get("axes"):
        # eager SyncBatchNorm raises on CPU, and eager DDP's per-rank BatchNorm is not what the program computes
        raise AotError(
            f"{artifact_dir}: its SyncBatchNorm computes batch statistics over {','.join(batchnorm['axes'])}, "
            f"which eager DDP on CPU cannot (eager SyncBatchNorm needs GPUs); its reference is one process "
            f"over the global batch (see tests/test_sync_batchnorm.py)"
        )
    capacity = (artifact.manifest.get("expert_parallel") or {}).get("capacity", "dropless")
    if isinstance(capacity, dict):
        # eager PyTorch runs every expert on every token routed to it
        raise AotError(
            f"{artifact_dir}: its experts drop token choices past a capacity (--moe-capacity-factor {capacity['factor']:g}), which "
            f"eager PyTorch does not: it has no eager counterpart; verify a dropless build of the same strategy"
        )
    if world > max_local_ranks():
        raise AotError(
            f"{artifact_dir}: world size {world} cannot run on this machine "
            f"(at most {max_local_ranks()} local CPU processes); verify a build of the same strategy at a smaller world size"
        )
    with tempfile.TemporaryDirectory(prefix="aot-verify-") as tmp:
        result_path = Path(tmp) / "result.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(world),
            "-m",
            "aot.verify_worker",
            str(artifact_dir),
            str(model_file),
            str(result_path),
            "--steps",
            str(steps),
        ]
        if data is not None:
            command += ["--data", str(data)]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0 and "Signal 6 (SIGABRT)" in proc.stderr:
            # eager DDP under gloo has aborted in torch's teardown ("terminate called without an
            # active exception") on a loaded machine: that is torch's, not the artifact's; run once more
            result_path.unlink(missing_ok=True)
            proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0 or not result_path.exists():
            errors = [l for l in proc.stderr.splitlines() if "error:" in l]
            raise AotError(f"verification run failed: {errors[0] if errors else proc.stderr.strip()[-500:]}")
        result = json.loads(result_path.read_text())
    result["tolerance"] = tolerance
    result["ok"] = result["max_loss_diff"] <= tolerance and result["max_weight_diff"] <= tolerance
    return result
