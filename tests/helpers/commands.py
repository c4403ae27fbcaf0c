"""Running the real command line from tests: `python -m aot ...` and torchrun, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
MODELS = REPO / "tests" / "models"
FIXTURES = REPO / "tests" / "fixtures"
REFERENCE = REPO / "tests" / "helpers" / "ddp_reference.py"
TIMEOUT = 300


def clean_env() -> dict:
    """The environment of a fresh shell: no torchrun variables leaking in, no --debug."""
    env = dict(os.environ)
    env.pop("AOT_DEBUG", None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def aot(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m aot ARGS` from the repository root (`env`: variables to add, AOT_SIZE=1b say)."""
    return subprocess.run([sys.executable, "-m", "aot", *map(str, args)], cwd=REPO, env={**clean_env(), **(env or {})},
                          capture_output=True, text=True, timeout=TIMEOUT)


def aot_each(*commands: tuple) -> list[subprocess.CompletedProcess]:
    """`aot(*args)` for each tuple of arguments, two at a time (a build is mostly one core's work,
    and the machine has two); results in the order given."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda args: aot(*args), commands))


def torchrun(nproc: int, *args, module: str | None = "aot") -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m aot ARGS` (--standalone: a free port).
    With module=None, ARGS start with a script path instead."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           *(["-m", module] if module else []), *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT)


def show(r: subprocess.CompletedProcess) -> str:
    return f"exit {r.returncode}\n--- stdout ---\n{r.stdout[-3000:]}\n--- stderr ---\n{r.stderr[-6000:]}"


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, show(r)
    return r
