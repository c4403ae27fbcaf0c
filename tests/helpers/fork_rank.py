"""One torchrun rank, forked from the tests' fork server (helpers/fork_server.py) instead of a new
interpreter that imports torch again: `torchrun ... tests/helpers/fork_rank.py -m MODULE ARGS` or
`... fork_rank.py SCRIPT ARGS`.

This process is what torchrun starts and watches: it imports nothing heavy, hands the server its
environment (as torchrun set it for this rank), working folder and standard streams, passes on the
signals torchrun sends (SIGTERM when another rank failed), and exits with the rank's status, or
dies of SIGKILL when the rank died without one (killed, crashed). It dies with torchrun, and the
rank with it (helpers/fork_server.py). The server's socket is named by
AOT_FORK_SERVER, which helpers/commands.py sets for torchrun and which the rank does not see.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys


def _die_with_launcher() -> None:
    """SIGKILL when torchrun ends (killed by a test's timeout, say), so no rank outlives its launch."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # torchrun already gone
        os._exit(1)


def main(argv: list[str]) -> int:
    _die_with_launcher()
    env = dict(os.environ)
    path = env.pop("AOT_FORK_SERVER")
    if argv[0] == "-m":
        target, args = {"module": argv[1]}, argv[2:]
    else:
        target, args = {"path": argv[0]}, argv[1:]
    request = {**target, "args": args, "env": env, "cwd": os.getcwd(), "fds": True}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    replies = conn.makefile()
    pid = json.loads(replies.readline())["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda number, _frame: os.kill(pid, number))
    line = replies.readline()
    if not line:  # the rank ended without exiting: end as a process killed by a signal does
        os.kill(os.getpid(), signal.SIGKILL)
    return json.loads(line)["status"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
