"""`python -m aot ...` and torchrun for the tests, without paying for Python and torch's start-up each time.

Every `aot` command a test runs is a real process running the real command line (exit status,
stdout and stderr as a user sees them), but most of its time on this 2-core machine was importing
torch and torch._dynamo (3 to 4 s of a 6 s build). This server imports them once, then forks one
child per command: the child takes the command's environment, working folder and output files,
runs the module as `python -m` does (`aot`, or torchrun's launcher `torch.distributed.run`, whose
ranks are then new processes as always) and exits with its status. Nothing of one command
survives into the next (each child is a fresh copy of the server, which never runs a command).

The server never imports the project itself (a child imports what its command needs, as
`python -m aot` would), only torch: a test that checks what a command imports still sees the
command's own imports. AOT_TEST_FRESH=1 runs every command in a new interpreter instead.

Protocol (one Unix socket connection per command): the client sends one JSON line
{"module", "args", "env", "cwd", "stdout", "stderr"}; the child answers {"pid"} at once and {"status"} when done.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
import traceback


def _run_command(request: dict) -> int:
    """In the forked child: the command as `python -m MODULE ARGS` would run it; its exit status."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:0] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    sys.argv = [request["module"], *request["args"]]
    try:
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


def serve(path: str) -> None:
    import importlib

    # the point of the server: imported once (make_fx imports torch._dynamo on every build)
    for module in ("torch", "torch._dynamo"):
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
                request = json.loads(conn.makefile().readline())
                conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
                status = _run_command(request)
                conn.sendall(json.dumps({"status": status}).encode() + b"\n")
            finally:
                os._exit(status)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
