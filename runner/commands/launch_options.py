"""What `aot run` and `aot eval` share: who this process is and how the run may start (the
launch options), and the Trainer made from them, with a topology mismatch printed as one line per
mismatch class."""

from __future__ import annotations

from pathlib import Path

import click

from runner.execution.launch import Launch


def launch_options(command):
    """The options of a command that joins a job of ranks: rank, world size, rendezvous, the
    checks it may relax (topology, torch release), trusted keys, the collective timeout and
    binding."""
    for option in reversed(LAUNCH_OPTIONS):
        command = option(command)
    return command


LAUNCH_OPTIONS = [
    click.option(
        "--rank",
        type=click.IntRange(min=0),
        help="This process's rank, for launchers other than torchrun (default: torchrun's $RANK, else srun's "
        "$SLURM_PROCID, else 0). With --world-size, --master-addr and --master-port: one process per rank, "
        "started by you, srun or your scheduler.",
    ),
    click.option(
        "--world-size",
        type=click.IntRange(min=1),
        help="Processes in the job (default: torchrun's $WORLD_SIZE, else srun's $SLURM_NTASKS, else 1); must be the artifact's.",
    ),
    click.option(
        "--local-rank",
        type=click.IntRange(min=0),
        help="This process's rank on its node, its GPU index (default: torchrun's $LOCAL_RANK, else srun's "
        "$SLURM_LOCALID, else the rank: give it when the job spans nodes).",
    ),
    click.option("--master-addr", metavar="HOST", help="Where rank 0 listens for the others to meet (default: $MASTER_ADDR)."),
    click.option(
        "--master-port", type=click.IntRange(min=1, max=65535), metavar="PORT", help="Rank 0's rendezvous port, free on HOST (default: $MASTER_PORT)."
    ),
    click.option("--allow-topology-mismatch", is_flag=True, help="Run even if the live machine differs from the artifact's topology profile (with a warning)."),
    click.option(
        "--allow-torch-skew",
        is_flag=True,
        help="Run an artifact built with a torch outside this runner's window (the same major.minor release, any patch), "
        "with a warning: its programs may fail to load, or compute otherwise than the build traced them.",
    ),
    click.option(
        "--trusted-key",
        "trusted_keys",
        multiple=True,
        type=click.Path(path_type=Path),
        help="Run only artifacts signed by this public key (repeatable; see `aot keygen`).",
    ),
    click.option(
        "--timeout",
        "timeout_s",
        default=600,
        show_default=True,
        type=click.IntRange(min=1),
        help="Seconds a collective may wait for the other ranks before the run fails, naming it.",
    ),
    click.option("--no-bind", is_flag=True, help="Do not bind each rank to the CPU cores and NUMA memory node nearest its GPU."),
]


def joined_launch(options: dict) -> Launch:
    """Who this process is, however it was started (runner/execution/launch.py), from the launch
    options (taken out of `options`), exported as torchrun's variables: from here on the run is
    the one torchrun starts."""
    from runner.execution.launch import resolve_launch

    names = ("rank", "world_size", "local_rank", "master_addr", "master_port")
    launch = resolve_launch(**{name: options.pop(name) for name in names})
    launch.export()
    return launch


def start_trainer(
    artifact: Path, launch: Launch, tag: str, quiet: bool, *, allow_topology_mismatch, allow_torch_skew, trusted_keys, timeout_s, no_bind, **extra
):
    """The Trainer of this rank (runner/execution/trainer.py); `extra`: its other arguments."""
    from runner.format.signing import read_public_key
    from runner.hardware.topology_check import TopologyMismatch
    from runner.execution.trainer import Trainer

    keys = [read_public_key(k) for k in trusted_keys]
    try:
        # The tier is chosen before the process group starts: a compiled package passed over gets
        # one notice line (from rank 0), --tier compiled an error.
        return Trainer(
            artifact,
            launch.rank,
            world_size=launch.world_size,
            launch=launch,
            allow_topology_mismatch=allow_topology_mismatch,
            allow_torch_skew=allow_torch_skew,
            trusted_keys=keys,
            timeout_s=timeout_s,
            warn=lambda msg: click.echo(f"warning: {msg}", err=True),
            bind=not no_bind,
            log=(lambda msg: None) if quiet else (lambda msg: click.echo(f"{tag}{msg}", err=True)),
            notice=(lambda msg: None) if quiet else (lambda msg: click.echo(msg, err=True)),
            **extra,
        )
    except TopologyMismatch as e:  # one line per mismatch class (from local rank 0 of each node), then the error
        if e.report:
            for line in e.lines:
                click.echo(f"{tag}topology mismatch: {line}", err=True)
        raise e.refusal() from None
