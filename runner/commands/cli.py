"""`aot run` / `python -m runner run`: train from an artifact, under torchrun or any launcher (runner/execution/launch.py)."""

from __future__ import annotations

import json
import math
import os
import resource
import time
from pathlib import Path

import click

from runner.commands.console import console_main, debug_option
from runner.commands.launch_options import joined_launch, launch_options, start_trainer

_STARTED = time.perf_counter()  # as close to process start as this module gets


def _restarted() -> bool:
    """Whether torchrun restarted this worker group after a failure (--max-restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


@click.command("run")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--steps", default=10, show_default=True, type=click.IntRange(min=0), help="Training steps to run.")
@click.option(
    "--data",
    type=click.Path(path_type=Path),
    help="Training data: a file, a folder or a glob of shards, read in name order as one sequence. safetensors files "
    "with `inputs` (or inputs.0, inputs.1, ...) and `targets`, one sample per row; or token streams for a model "
    "whose input and targets are [batch, T] token ids: llm.c's .bin (256 x int32 header), a raw .bin "
    "(--token-dtype) or a 1-D .npy, cut into windows of T + 1 tokens. A rank reads the rows it uses, never the whole file. "
    "Default: the example batch recorded at build time.",
)
@click.option(
    "--shuffle",
    type=click.IntRange(min=0),
    metavar="SEED",
    help="Read the data's rows in a new seeded order every epoch (the same on every rank, computed, never stored: "
    "give the same SEED to --resume and the run continues at the sample it would have read). Default: in order.",
)
@click.option(
    "--token-dtype",
    type=click.Choice(["uint16", "uint32", "int32", "int64"]),
    help="The token type of raw .bin token shards (llm.c's .bin says its own in its header).",
)
@click.option(
    "--eval-data",
    type=click.Path(path_type=Path),
    help="Validation data (any form --data takes): every --eval-every steps, the artifact's eval program (forward and "
    "loss in eval mode, no backward) runs on its first --eval-batches global batches, in file order, and the mean "
    "loss over them and over the data-parallel ranks is printed and recorded as val_loss.",
)
@click.option("--eval-every", type=click.IntRange(min=1), metavar="N", help="Steps between validation losses (default: once, after the last step).")
@click.option("--eval-batches", default=8, show_default=True, type=click.IntRange(min=1), metavar="K", help="Global batches per validation loss.")
@click.option("--metrics", type=click.Path(path_type=Path), help="Append one JSON line per step (rank 0): loss, step time, data wait, val_loss.")
@click.option("--save", type=click.Path(path_type=Path), help="Write a checkpoint here at the end (and every --save-every steps).")
@click.option(
    "--save-every",
    type=click.IntRange(min=1),
    help="Also checkpoint every N steps. A run that torchrun restarts "
    "(--max-restarts) resumes from the last complete checkpoint in --save and still stops at the same step.",
)
@click.option("--resume", type=click.Path(path_type=Path), help="Continue from a checkpoint written by --save.")
@click.option(
    "--check-replicas",
    type=click.IntRange(min=1),
    metavar="N",
    help="Every N steps, compare every tensor that several ranks hold a copy of (a bitwise hash, all-gathered); a "
    "difference stops the run naming the tensor and the ranks. Every --save checks them too, before writing.",
)
@click.option(
    "--init-from",
    type=click.Path(path_type=Path),
    help="Start from these weights instead of the artifact's init program: a safetensors file keyed like "
    "model.state_dict() (what `aot checkpoint merge` writes) or a Hugging Face model folder "
    "(model.safetensors, or shards listed by model.safetensors.index.json). Each rank reads only its own "
    "slices; names, shapes and dtypes are checked before any process group starts.",
)
@launch_options
@click.option("--log-every", default=1, show_default=True, type=click.IntRange(min=1), help="Print a progress line every N steps.")
@click.option(
    "--tier",
    type=click.Choice(["auto", "compiled", "portable"]),
    default="auto",
    show_default=True,
    help="Which program runs. auto: the artifact's compiled package (`aot build --compile aoti`) when it was "
    "compiled for this device kind, CPU level and torch build, else the portable program with a one-line "
    "notice. compiled: the package or fail. portable: the portable program.",
)
@click.option(
    "--cuda-graphs",
    type=click.Choice(["auto", "on", "off"]),
    default="off",
    show_default=True,
    help="Run each training step as one CUDA graph: after 3 eager steps the step (forward, backward, "
    "collectives, optimizer) is captured once and replayed, the batch and learning rates copied into its "
    "buffers; a step then costs one launch. auto: on CUDA devices where the step can be captured (not over "
    "gloo, not a pipeline stage), else off; a capture that fails is named in one line and the run goes on "
    "uncaptured. on: as auto, but an error where no graph can be captured. off: never. The default becomes "
    "auto once captured training has been checked on a GPU (issue #46).",
)
@click.option(
    "--profile",
    "profile_dir",
    type=click.Path(path_type=Path),
    help="Profile up to 5 steps after the first with torch.profiler; rank 0 writes DIR/measured_timeline.json "
    "(Chrome trace) and DIR/profile.json. The first step (slower, untimed) also measures every rank's peak "
    "memory into profile.json (CPU: live tensor bytes, seen op by op, or by the allocator for the compiled "
    "tier; CUDA: torch.cuda.max_memory_allocated). `aot inspect ARTIFACT --profile DIR` compares them with "
    "the prediction.",
)
@click.option("--quiet", is_flag=True, help="Print only errors.")
@debug_option
def run(
    artifact,
    steps,
    data,
    token_dtype,
    shuffle,
    eval_data,
    eval_every,
    eval_batches,
    metrics,
    save,
    save_every,
    resume,
    check_replicas,
    init_from,
    tier,
    log_every,
    cuda_graphs,
    profile_dir,
    quiet,
    **job,
):
    """Train from ARTIFACT (a folder made by `aot build`) on this rank.

    Launch one process per rank with torchrun; rank and world size come from its environment:

    \b
        torchrun --nproc-per-node 2 -m aot run artifacts/ --steps 50

    Or start each process yourself (srun, your scheduler, a script), saying who it is:

    \b
        aot run artifacts/ --rank 0 --world-size 2 --master-addr node0 --master-port 29500 &
        aot run artifacts/ --rank 1 --world-size 2 --master-addr node0 --master-port 29500

    Under srun, rank, world size and local rank come from SLURM_PROCID, SLURM_NTASKS and
    SLURM_LOCALID (when no torchrun variables are set); give the rendezvous with --master-addr and
    --master-port, or MASTER_ADDR and MASTER_PORT. Either way the run is the one torchrun starts.

    Every file is checked against the manifest's sha256 before it is read, the live topology is
    checked against the artifact's profile, and no model code or compiler runs.
    """
    from runner.format.checkpoint import check_data_order, read_index
    from runner.execution.data import SHUFFLE_ORDER
    from runner.errors import AotError
    import sys

    import torch.distributed as dist

    from runner.execution.groups import leave_process_group, yield_gloo_poll_threads
    from runner.execution.preemption import PREEMPTED, Preemption
    from runner.format.integrity import check_writable_target
    from runner.execution.prefetch import Prefetcher
    from runner.execution.profiling import WARMUP_STEPS, StepProfiler

    # Everything that can be checked before the work is checked before it.
    # Who this process is, however it was started, exported as torchrun's variables: from here on
    # the run is the one torchrun starts (runner/execution/launch.py).
    launch = joined_launch(job)
    if save_every is not None and save is None:
        raise AotError("--save-every needs --save DIR")
    if eval_every is not None and eval_data is None:
        raise AotError("--eval-every needs --eval-data PATH")
    if init_from is not None and resume is not None:
        raise AotError("--init-from starts a run from given weights and --resume continues one from a checkpoint: give one")
    if save is not None:
        check_writable_target(save, "folder")
    if metrics is not None:
        check_writable_target(metrics, "file")
    if profile_dir is not None:
        check_writable_target(profile_dir, "folder")

    tag = f"[rank {launch.rank}] " if launch.world_size != 1 else ""
    opened = tuple((path, token_dtype) for path in (data, eval_data) if path is not None)  # checked before any process group
    trainer = start_trainer(
        artifact, launch, tag, quiet, tier=tier, cuda_graphs=cuda_graphs, init_from=init_from, evaluates=eval_data is not None, data_files=opened, **job
    )
    say = (lambda msg: click.echo(msg, err=True)) if (trainer.rank == 0 and not quiet) else (lambda msg: None)

    target = None
    if save is not None and _restarted() and (save / "checkpoint.json").is_file():
        target = read_index(save).get("target_step")
        trainer.resume(save)
        say(f"restarted by torchrun: resumed from {save} at step {trainer.step_index}")
    elif resume is not None:
        check_data_order(resume, read_index(resume), shuffle, SHUFFLE_ORDER)
        trainer.resume(resume)
        say(f"resumed from {resume} at step {trainer.step_index}")
    data_order = {"shuffle": shuffle, **({"order": SHUFFLE_ORDER} if shuffle is not None else {})}
    target = target if target is not None else trainer.step_index + steps
    trainer.check_steps(target - trainer.step_index)
    source = trainer.data_source(data, token_dtype, shuffle)
    evaluation = None
    if eval_data is not None:
        from runner.execution.evaluation import Evaluator

        evaluation = (Evaluator(trainer), trainer.data_source(eval_data, token_dtype))
    say(
        f"rank 0 of {trainer.world_size} ready in {time.perf_counter() - _STARTED:.2f} s "
        f"({trainer.device}, {trainer.tier} tier, {source.rows} samples from {data or 'the example batch'}, "
        f"weights from {trainer.weights_source if trainer.step_index == 0 else 'the checkpoint'})"
    )

    try:
        if metrics is not None and trainer.rank == 0:
            metrics.parent.mkdir(parents=True, exist_ok=True)
        log = open(metrics, "a") if (metrics is not None and trainer.rank == 0) else None
    except OSError as e:
        raise AotError(f"{metrics}: cannot write metrics ({e.strerror})") from None
    first = last = None
    profiler = StepProfiler(profile_dir, target - trainer.step_index, trainer.rank, trainer.device, trainer.tier, pipeline=trainer.pipeline is not None)

    def report(done) -> None:
        """Step `done`'s figures read back (the only wait for the device), printed and recorded,
        then what is due after it: a replica check, a save, the profiler's step."""
        nonlocal first, last
        loss, seconds = done.loss(), done.seconds()
        if not math.isfinite(loss):
            say(f"warning: loss is {loss} at step {done.number}")
        first = loss if first is None else first
        last = loss
        record = {
            "step": done.number,
            "loss": loss,
            "step_time_s": seconds,
            "tier": trainer.tier,
            "samples_per_s": source.global_batch / seconds,
            "data_wait_s": waits.pop(done.number, 0.0),  # how long the step waited for its batch (read ahead on a thread)
            # rank 0's peak resident host memory so far (memory-mapped data pages it touched included)
            "host_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "time_since_start_s": time.perf_counter() - _STARTED,
            "unix_time": time.time(),
        }
        dropped = done.moe_dropped()
        if dropped is not None:  # expert parallelism with a capacity: token choices past it, every data rank's
            record["moe_dropped"] = dropped
        scale = done.loss_scale()
        if scale is not None:  # fp16: the loss scale after this step, and whether its update was skipped
            skipped = done.skipped()
            record.update(loss_scale=scale, skipped=skipped)
            if skipped:
                say(f"step {done.number}: gradients overflowed in fp16; update skipped, loss scale now {scale:g}")
        if done.number % log_every == 0 or done.number == target:
            drops = f"  {dropped} expert choices dropped" if dropped else ""
            say(f"step {done.number:>5}  loss {loss:.4f}  {seconds * 1e3:7.1f} ms  {record['samples_per_s']:8.0f} samples/s{drops}")
        if evaluation is not None and (done.number % (eval_every or target) == 0 or done.number == target):
            began = time.perf_counter()
            record["val_loss"] = evaluation[0].loss(evaluation[1], eval_batches)
            batches = f"{eval_batches} batch{'es' if eval_batches != 1 else ''}"
            say(f"step {done.number:>5}  val_loss {record['val_loss']:.4f}  ({batches}, {time.perf_counter() - began:.2f} s)")
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()
        if check_replicas and done.number % check_replicas == 0:
            trainer.check_replicas(f"at step {done.number}")
        if save_every and done.number % save_every == 0 and done.number < target:
            trainer.save(save, target_step=target, data_order=data_order)
        profiler.step(seconds)

    def due_after(number: int) -> bool:
        """Whether step `number` is read back before the next is queued: the state is read after it
        (a replica check, a save) or a profile marks exact step boundaries."""
        return (
            bool(profile_dir)
            or bool(check_replicas and number % check_replicas == 0)
            or bool(save_every and number % save_every == 0)
            or bool(evaluation and (number % (eval_every or target) == 0 or number == target))
        )

    # with --save, SIGTERM and SIGUSR1 stop every rank after one agreed step, checkpointed (runner.execution.preemption)
    distributed = trainer.world_size > 1 and dist.is_initialized()
    preemption = Preemption(distributed, job["timeout_s"]) if save is not None else None
    finished = False
    if preemption is not None and distributed:
        yield_gloo_poll_threads()  # its group's poll thread too
    waits: dict[int, float] = {}  # step number -> seconds it waited for its batch
    prefetch = Prefetcher(source, trainer.step_index, target, trainer.device)
    try:
        with profiler, prefetch:
            pending = None  # the step queued last, read back once the next is queued
            while trainer.step_index < target:
                inputs, targets, waits[trainer.step_index + 1] = prefetch.batch(trainer.step_index)
                measure = profiler.measuring_memory  # the warm-up step: slower, and never a timed one
                launched = trainer.launch(inputs, targets, measure_memory=measure)
                if measure:
                    assert trainer.memory_method is not None  # set by the step just run with measure_memory
                    profiler.record_memory(trainer.measured_peak_bytes, trainer.memory_method, launched.number)
                if pending is not None:
                    report(pending)
                pending = None
                if due_after(launched.number):
                    report(launched)
                else:
                    pending = launched
                if preemption is not None and preemption.stop_now():
                    break
            if pending is not None:
                report(pending)
            finished = True
    finally:
        if log:
            log.close()
        if preemption is not None:
            preemption.close(wait=finished)
    if save is not None:
        trainer.save(save, target_step=target, data_order=data_order)
        say(f"saved checkpoint at step {trainer.step_index} to {save}")
    if preemption is not None and trainer.step_index < target:  # stopped by a signal, every rank after this step
        if preemption.received is not None:
            click.echo(f"{tag}{preemption.received} received: stopped with every rank after step {trainer.step_index}", err=True)
        say(f"preempted at step {trainer.step_index} of {target}: resume with --resume {save} (exit status {PREEMPTED})")
        leave_process_group()
        sys.exit(PREEMPTED)
    if first is not None:
        say(f"trained to step {trainer.step_index}: loss {first:.4f} -> {last:.4f}")
    if profile_dir is not None and profiler.seconds:
        say(f"profiled {len(profiler.seconds)} step(s) into {profile_dir} (aot inspect {artifact} --profile {profile_dir})")
    elif profile_dir is not None:
        say(f"warning: --profile needs at least {WARMUP_STEPS + 1} steps; nothing profiled")
    leave_process_group()


def main() -> None:
    console_main(run, "runner")
