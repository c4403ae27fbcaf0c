"""`aot eval`: the validation loss of an artifact's weights, once (runner/execution/evaluation.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from runner.commands.launch_options import joined_launch, launch_options, start_trainer


@click.command("eval")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--data", type=click.Path(path_type=Path), required=True, help="Validation data: any form `aot run --data` takes.")
@click.option(
    "--batches", default=8, show_default=True, type=click.IntRange(min=1), metavar="K", help="Global batches to average over, from the first, in file order."
)
@click.option("--token-dtype", type=click.Choice(["uint16", "uint32", "int32", "int64"]), help="The token type of raw .bin token shards.")
@click.option("--resume", type=click.Path(path_type=Path), help="The weights of this checkpoint (written by `aot run --save`).")
@click.option(
    "--init-from", type=click.Path(path_type=Path), help="These weights: a safetensors state_dict or a Hugging Face model folder (as `aot run --init-from`)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (rank 0) instead of the line.")
@launch_options
def evaluate(artifact, data, batches, token_dtype, resume, init_from, as_json, **job):
    """The validation loss of ARTIFACT's weights on --data: the artifact's eval program (forward and
    loss in eval mode, no backward, no optimizer, the training step's sharding and precision) over
    the first K global batches, averaged over them and over the data-parallel ranks. The weights
    are a checkpoint's (--resume), yours (--init-from) or the init program's.

    Launch it as `aot run` is launched, one process per rank of the artifact:

    \b
        torchrun --nproc-per-node 2 -m aot eval artifacts/gpt --data val.bin --resume ckpt/
    """
    from runner.errors import AotError
    from runner.execution.evaluation import Evaluator
    from runner.execution.groups import leave_process_group

    launch = joined_launch(job)
    if init_from is not None and resume is not None:
        raise AotError("--init-from and --resume both give the weights: give one")
    tag = f"[rank {launch.rank}] " if launch.world_size != 1 else ""
    trainer = start_trainer(artifact, launch, tag, True, init_from=init_from, evaluates=True, data_files=((data, token_dtype),), **job)
    if resume is not None:
        trainer.resume(resume)
    evaluator = Evaluator(trainer)
    loss = evaluator.loss(trainer.data_source(data, token_dtype), batches)
    if trainer.rank == 0:
        weights = str(resume) if resume is not None else trainer.weights_source
        per_batch = trainer.data_size * trainer.data_spec["batch_size"]
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "val_loss": loss,
                        "batches": batches,
                        "samples": batches * per_batch,
                        "weights": weights,
                        "step": trainer.step_index,
                    }
                )
            )
        else:
            click.echo(f"val_loss {loss:.6f} over {batches} batches of {per_batch} samples ({weights}, step {trainer.step_index})")
    leave_process_group()
