"""How this process was started: its rank, the world size, its local rank and the rendezvous.

torchrun says it in environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT). Clusters whose launcher is srun or a scheduler of their own start each process
themselves: `aot run --rank R --world-size N --master-addr H --master-port P` says it on the
command line, and under srun Slurm's variables say most of it (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID; the rendezvous from --master-addr/--master-port or MASTER_ADDR/MASTER_PORT).
`resolve_launch` reads whichever applies into one `Launch`; `Launch.export` writes it back as
torchrun's variables, so the rest of a run (the env:// rendezvous, the topology check's
reporting rank, the `[rank R]` prefix of errors) runs the same code whoever started it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from runner.errors import AotError

TORCHRUN = ("RANK", "WORLD_SIZE")  # set by torchrun (and torch.distributed's other launchers)
SLURM = ("SLURM_PROCID", "SLURM_NTASKS")  # set by srun for each task


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    launcher: str  # "torchrun", "slurm", "options" (--rank/--world-size) or "single" (one process, no launcher)

    def relaunch_hint(self, world_size: int) -> str:
        """How to start `world_size` processes with this run's launcher."""
        if self.launcher == "slurm":
            return f"launch with srun --ntasks {world_size}"
        if self.launcher == "options":
            return f"start {world_size} processes with --world-size {world_size}"
        return f"launch with torchrun --nproc-per-node {world_size}"

    def variables(self) -> dict[str, str]:
        """torchrun's variables for this launch (the rendezvous where known)."""
        out = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank)}
        if self.master_addr is not None:
            out["MASTER_ADDR"] = self.master_addr
        if self.master_port is not None:
            out["MASTER_PORT"] = str(self.master_port)
        return out

    def export(self, environ=None) -> None:
        """Set torchrun's variables in this process's environment (nothing to set under torchrun, or
        for one process that no launcher started)."""
        if self.launcher in ("slurm", "options"):
            (os.environ if environ is None else environ).update(self.variables())


def resolve_launch(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    env=None,
) -> Launch:
    """The launch from torchrun's variables, else Slurm's (both SLURM_PROCID and SLURM_NTASKS set),
    else the options, else one process. An option the launcher's variables contradict is an
    error, so is a rank outside the world."""
    env = os.environ if env is None else env
    given = {"--rank": rank, "--world-size": world_size, "--local-rank": local_rank, "--master-addr": master_addr, "--master-port": master_port}
    if any(env.get(name) not in (None, "") for name in TORCHRUN):
        launcher = "torchrun"
        said = {"--rank": ("RANK", _int(env, "RANK", 0)), "--world-size": ("WORLD_SIZE", _int(env, "WORLD_SIZE", 1))}
        said["--local-rank"] = ("LOCAL_RANK", _int(env, "LOCAL_RANK", said["--rank"][1]))
        said["--master-addr"] = ("MASTER_ADDR", env.get("MASTER_ADDR") or None)
        said["--master-port"] = ("MASTER_PORT", _int(env, "MASTER_PORT", None))
    elif all(env.get(name) not in (None, "") for name in SLURM):
        launcher = "slurm"
        said = {"--rank": ("SLURM_PROCID", _int(env, "SLURM_PROCID", 0)), "--world-size": ("SLURM_NTASKS", _int(env, "SLURM_NTASKS", 1))}
        said["--local-rank"] = ("SLURM_LOCALID", _int(env, "SLURM_LOCALID", said["--rank"][1]))
    else:
        launcher = "options" if rank is not None or world_size is not None else "single"
        said = {}
    for option, (variable, value) in said.items():
        if given[option] is not None and value is not None and given[option] != value:
            who = "torchrun" if launcher == "torchrun" else "Slurm"
            raise AotError(
                f"{option} {given[option]} but {who} set {variable}={value}: give the option only where no launcher sets {variable}, or the same value"
            )
    # the rendezvous outside torchrun: the options, else MASTER_ADDR/MASTER_PORT exported by the job script
    said.setdefault("--master-addr", ("MASTER_ADDR", env.get("MASTER_ADDR") or None))
    said.setdefault("--master-port", ("MASTER_PORT", _int(env, "MASTER_PORT", None)))
    value = {option: given[option] if given[option] is not None else said.get(option, (None, None))[1] for option in given}
    if launcher == "options" and value["--rank"] is not None and value["--world-size"] is None:
        raise AotError(f"--rank {value['--rank']} needs --world-size (the number of processes of the job)")
    if launcher == "options" and value["--world-size"] is not None and value["--rank"] is None:
        raise AotError(f"--world-size {value['--world-size']} needs --rank (this process's rank, 0 to {value['--world-size'] - 1})")
    this = value["--rank"] if value["--rank"] is not None else 0
    world = value["--world-size"] if value["--world-size"] is not None else 1
    if world < 1:
        raise AotError(f"--world-size {world}: a job has at least 1 process")
    if not 0 <= this < world:
        raise AotError(f"--rank {this} is outside --world-size {world} (ranks are 0 to {world - 1})")
    local = value["--local-rank"] if value["--local-rank"] is not None else this
    if local < 0:
        raise AotError(f"--local-rank {local}: a local rank is at least 0")
    return Launch(this, world, local, value["--master-addr"], value["--master-port"], launcher)


def _int(env, name: str, default):
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise AotError(f"{name}={raw!r} in the environment: expected a whole number") from None
