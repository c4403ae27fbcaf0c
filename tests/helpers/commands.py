"""Running the real command line from tests: `python -m aot ...` and torchrun, as a user would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
MODELS = REPO / "tests" / "models"
FIXTURES = REPO / "tests" / "fixtures"
REFERENCE = REPO / "tests" / "helpers" / "ddp_reference.py"
FORK_RANK = REPO / "tests" / "helpers" / "fork_rank.py"
TIMEOUT = 300
_lock = threading.Lock()


def clean_env() -> dict:
    """The environment of a fresh shell: no torchrun variables leaking in, no --debug."""
    env = dict(os.environ)
    env.pop("AOT_DEBUG", None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def aot(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m aot ARGS` from the repository root (`env`: variables to add, AOT_SIZE=1b say): a
    process of its own, forked from a server that has imported torch (helpers/fork_server.py)."""
    args, env = [str(a) for a in args], {**clean_env(), **(env or {})}
    if os.environ.get("AOT_TEST_FRESH") == "1":
        return subprocess.run([sys.executable, "-m", "aot", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    return _forked("aot", args, env)


# What each fork server imports before it forks: commands (builds trace with make_fx, which imports
# torch._dynamo), and torchrun's ranks, which get what a new `python -m aot run` has when it starts
# (torch._dynamo imported beforehand changes how a rank runs: a compiled-tier fsdp x tp step then
# deadlocked on gloo's thread waiting for the GIL, which fresh ranks never do).
_PRELOADS = {"commands": ("torch", "torch._dynamo"), "ranks": ("torch",)}
_servers: dict[str, dict] = {}


def _server_socket(kind: str = "commands") -> str:
    """The socket of the fork server of `kind` (_PRELOADS), started on first use and stopped when
    the test session ends."""
    with _lock:
        if kind not in _servers:
            import atexit
            import tempfile

            folder = tempfile.mkdtemp(prefix="aot-fork-server-")
            path = os.path.join(folder, "socket")
            process = subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "helpers" / "fork_server.py"), path, *_PRELOADS[kind]],
                cwd=REPO,
                env=clean_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert process.stdout.readline().strip() == "ready", "the fork server did not start"
            atexit.register(lambda: (process.kill(), process.wait(), shutil.rmtree(folder, ignore_errors=True)))
            _servers[kind] = {"path": path, "folder": folder}
        return _servers[kind]["path"]


def _forked(module: str, args: list[str], env: dict) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` with environment `env`, forked by the server: exit status and output."""
    import json
    import signal
    import socket
    import tempfile

    path = _server_socket()
    with tempfile.TemporaryDirectory(dir=_servers["commands"]["folder"]) as out, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        conn.sendall(
            json.dumps({"module": module, "args": args, "env": env, "cwd": str(REPO), "stdout": f"{out}/stdout", "stderr": f"{out}/stderr"}).encode() + b"\n"
        )
        conn.settimeout(TIMEOUT)
        replies = conn.makefile()
        pid = json.loads(replies.readline())["pid"]
        try:
            line = replies.readline()
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired([module, *args], TIMEOUT) from None
        # no reply: the child died without exiting (a crash); report it as a signal would be
        status = json.loads(line)["status"] if line else -signal.SIGKILL
        read = lambda name: open(f"{out}/{name}", errors="replace").read()  # noqa: E731
        return subprocess.CompletedProcess([module, *args], status, read("stdout"), read("stderr"))


def aot_each(*commands: tuple, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """`aot(*args, env=env)` for each tuple of arguments, two at a time (a build is mostly one
    core's work, and the machine has two); results in the order given."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda args: aot(*args, env=env), commands))


def torchrun(nproc: int, *args, module: str | None = "aot", env: dict | None = None, launcher: list | None = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m aot ARGS` (--standalone: a free port).
    With module=None, ARGS start with a script path instead; `env`: variables to add; `launcher`:
    torchrun's options in place of --standalone --nproc-per-node N. The launcher and its ranks are
    forked from the server (AOT_TEST_FRESH=1: new interpreters)."""
    launcher_args = [str(a) for a in launcher] if launcher else ["--standalone", "--nproc-per-node", str(nproc)]
    command = [*(["-m", module] if module else []), *map(str, args)]
    env = {**clean_env(), **(env or {})}
    if os.environ.get("AOT_TEST_FRESH") == "1":
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", *launcher_args, *command], cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT
        )
    # each rank forked from the server as well (helpers/fork_rank.py), not a new interpreter
    return _forked("torch.distributed.run", [*launcher_args, str(FORK_RANK), *command], {**env, "AOT_FORK_SERVER": _server_socket("ranks")})


def show(r: subprocess.CompletedProcess) -> str:
    return f"exit {r.returncode}\n--- stdout ---\n{r.stdout[-3000:]}\n--- stderr ---\n{r.stderr[-6000:]}"


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, show(r)
    return r


def line_of(path: Path, marker: str) -> int:
    """1-based number of the line of `path` that contains `marker`."""
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if marker in text:
            return number
    raise AssertionError(f"{marker!r} not in {path}")
