"""Point-to-point transfers between pipeline stages: what the runner needs for a program's
`isend` / `irecv` nodes (torch.ops._c10d_functional) to run step after step.

Their peers are ranks within the named group (the pipeline group: a stage's position), so one
program serves every data-parallel replica of its stage. A transfer completes only once both
sides have issued it; the build issues every send as soon as its value exists and waits for them
at the end of the step, so no rank waits on a peer that is itself waiting (see FORMAT.md,
"Pipeline").

torch 2.13's CPU kernel of `isend` registers the send's work under the placeholder it returns and
under the sent tensor; `wait_tensor` on the placeholder pops only the first, so every step would
keep its sent activations alive for the rest of the process (measured: 100 sends of 1 MiB, +102
MiB). `install_kernels` replaces that kernel, for this process only, with one that registers
the work under the placeholder alone; the program waits each placeholder exactly once.

It replaces `irecv`'s too, so that every transfer's work is waited through `_Watched`: while a
wait blocks, `waited_on()` says which transfer it is (its tag names the microbatch, the stage
pair and the direction: runner/format/transfers.py), so a dead or stuck peer ends in one line
naming it (runner/execution/trainer.py) rather than in a bare gloo timeout.
"""

from __future__ import annotations

import torch

from runner.format.transfers import Transfer

P2P_OPS = ("isend", "irecv", "batch_p2p_ops")
_library = None


def is_point_to_point(node: torch.fx.Node) -> bool:
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == "_c10d_functional"
        and node.target._schema.name.split("::")[-1] in P2P_OPS
    )


class _Watched(torch.distributed.Work):
    """A transfer's work, waited through Python so that a wait that never returns leaves its
    transfer in `_waiting` (c10d calls a Python Work's `wait`, measured on torch 2.13 with gloo)."""

    def __init__(self, work, transfer: tuple[str, int, int]):
        super().__init__()
        self._work, self._transfer = work, transfer

    def wait(self, timeout=None):
        _waiting.append(self._transfer)
        done = self._work.wait() if timeout is None or not timeout else self._work.wait(timeout)
        _waiting.pop()  # left in place when the wait raises: `waited_on` reads it
        return done

    def is_completed(self):
        return self._work.is_completed()


_waiting: list[tuple[str, int, int]] = []  # ("send" or "receive", peer, tag) of each wait under way


def waited_on() -> tuple[str, int, int] | None:
    """("send" or "receive", peer's rank in the pipeline group, tag) of the transfer a wait that
    failed or never returned was for, since the last `forget_waits`; None if none."""
    return _waiting[-1] if _waiting else None


def failed_transfer(error: Exception, timed_out: bool, timeout_s: float) -> str | None:
    """What a pipeline rank's failed step was waiting for, as the end of one line ("waited to
    receive microbatch 0's gradient from stage 1 to stage 0 (backward, sender: pipeline rank 1) and
    got no answer within 5 s; ..."), where a transfer's wait failed or timed out; else None."""
    waited = waited_on()
    if waited is None:
        return None
    kind, peer, tag = waited
    transfer = Transfer.of_tag(tag)
    how = f"got no answer within {timeout_s:g} s" if timed_out else "lost the link"
    other = "sender" if kind == "receive" else "receiver"
    return (
        f"waited to {kind} {transfer.describe()} ({transfer.direction}, {other}: pipeline rank {peer}) and {how}; "
        f"a stage is stuck or gone ({str(error).strip().splitlines()[0]})"
    )


def forget_waits() -> None:
    """Called before each step: a failed wait of an earlier step is not this step's."""
    _waiting.clear()


def install_kernels() -> None:
    """`isend` and `irecv` kernels for this process: sends registered under their placeholder
    alone, and every transfer waited through `_Watched` (see the module docstring)."""
    global _library
    if _library is not None:
        return
    import torch.distributed._functional_collectives  # noqa: F401  (registers the ops and their side effects)
    from torch._C._distributed_c10d import _register_work, _resolve_process_group

    def isend(tensor, dst, tag, group_name):
        work = _resolve_process_group(group_name).send([tensor], dst, tag)
        placeholder = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        _register_work(placeholder, _Watched(work, ("send", dst, tag)))
        return placeholder

    def irecv(tensor, src, tag, group_name):
        work = _resolve_process_group(group_name).recv([tensor], src, tag)
        _register_work(tensor, _Watched(work, ("receive", src, tag)))
        return tensor

    library = torch.library.Library("_c10d_functional", "IMPL")
    for name, kernel in (("isend", isend), ("irecv", irecv)):
        library.impl(name, kernel, "CPU")
        library.impl(name, kernel, "CUDA")
    _library = library
