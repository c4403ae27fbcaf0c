"""`python -m aot ...` and torchrun for the tests, without paying for Python and torch's start-up each time.

Every `aot` command a test runs is a real process running the real command line (exit status,
stdout and stderr as a user sees them), but most of its time on this 2-core machine was importing
torch and torch._dynamo (3 to 4 s of a 6 s build). This server imports them once, then forks one
child per command: the child takes the command's environment, working folder and output files,
runs the module as `python -m` does (`aot`, or torchrun's launcher `torch.distributed.run`) and
exits with its status. Nothing of one command survives into the next (each child is a fresh copy
of the server, which never runs a command). `fork_server.py SOCKET MODULE...` imports the MODULEs.

The ranks torchrun starts come from a second server, which imports torch alone as a rank's own
`python -m aot run` does first (helpers/fork_rank.py): torchrun, the real launcher, starts a small
client per rank (no torch import), which hands the server its environment (RANK, MASTER_PORT,
OMP_NUM_THREADS=1, ... as torchrun set them) and its standard streams; the forked child runs
`python -u -m aot ...` (or the reference script) on them, and the client exits with its status and
passes on torchrun's signals. A rank then costs its own work, not 3 s of imports.

The server never imports the project itself (a child imports what its command needs, as
`python -m aot` would), only torch: a test that checks what a command imports still sees the
command's own imports. AOT_TEST_FRESH=1 runs every command in a new interpreter instead.

Protocol (one Unix socket connection per command): the client sends one JSON line
{"module" or "path", "args", "env", "cwd", and "stdout", "stderr" (files) or "fds": true (its
standard streams passed along with the line)}; the child answers {"pid"} at once and {"status"}
when done. With "fds" the child also dies when the client's end of the connection closes (a
client killed by SIGKILL leaves no rank behind).
"""

from __future__ import annotations

import io
import json
import os
import runpy
import signal
import socket
import sys
import threading
import traceback


def _take_streams(request: dict, fds: list[int]) -> None:
    """The command's standard streams: the client's own (`fds`: stdin, stdout, stderr; unbuffered,
    as torchrun's `python -u` has them) or the output files the request names."""
    if request.get("fds"):
        for fd, theirs in zip((0, 1, 2), fds):
            os.dup2(theirs, fd)
            os.close(theirs)
        sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True, errors="backslashreplace")
        return
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)


def _run_command(request: dict, fds: list[int]) -> int:
    """In the forked child: the command as `python -m MODULE ARGS` (or `python PATH ARGS`) would
    run it; its exit status."""
    import torch

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:0] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    # torch read the thread count when the server imported it; a fresh interpreter reads it from
    # the command's environment (torchrun sets OMP_NUM_THREADS=1 for its ranks)
    if request["env"].get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
    _take_streams(request, fds)
    try:
        if "path" in request:
            sys.argv = [request["path"], *request["args"]]
            sys.path.insert(0, os.path.dirname(os.path.abspath(request["path"])))
            runpy.run_path(request["path"], run_name="__main__")
        else:
            sys.argv = [request["module"], *request["args"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # what the interpreter does with an uncaught exception (--debug)
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """The request line, and the file descriptors that came with it."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("the client left before its request was complete")
        data += more
    return json.loads(data), fds


def _die_with_client(conn: socket.socket) -> None:
    """A rank lives as long as its client (the process torchrun started and watches): the client
    sends nothing more, so the read returns when it is gone."""
    try:
        conn.recv(1)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def serve(path: str, preload: list[str]) -> None:
    import importlib

    # the point of the server: imported once (make_fx imports torch._dynamo on every build)
    for module in preload:
        importlib.import_module(module)

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            status = 1
            try:
                request, fds = _receive(conn)
                conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
                if request.get("fds"):
                    threading.Thread(target=_die_with_client, args=(conn,), daemon=True).start()
                status = _run_command(request, fds)
                conn.sendall(json.dumps({"status": status}).encode() + b"\n")
            finally:
                os._exit(status)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
