"""`aot infer` and `aot export`: exported inference through ONNX Runtime.

Imports are deferred into each command, as in aot/cli.py: `aot infer` loads runner.execution.infer (and
through it onnxruntime) only when it runs; training commands never load either.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from aot.cli_options import PRECISIONS

from runner.commands.console import debug_option


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--input",
    "input_file",
    type=click.Path(path_type=Path),
    required=True,
    help="safetensors file with `inputs` (or inputs.0, inputs.1, ...), first dimension = batch, as --data files; other tensors (targets) are ignored.",
)
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Write the outputs (`outputs` or outputs.0, ...) to this safetensors file.")
@click.option(
    "--provider",
    type=click.Choice(["tensorrt", "cuda", "cpu"]),
    help="Execution provider to insist on. Default: the best that works here (TensorRT, then CUDA, then CPU), with a notice when one is passed over.",
)
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(min=0), help="Untimed runs before timing.")
@click.option("--iters", default=10, show_default=True, type=click.IntRange(min=1), help="Timed runs.")
@click.option(
    "--trusted-key",
    "trusted_keys",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Run only artifacts signed by this public key (repeatable; see `aot keygen`), as `aot run` does.",
)
@click.option("--json", "as_json", is_flag=True, help="Print timing and provider as JSON on stdout.")
@debug_option
def infer(artifact, input_file, output, provider, warmup, iters, trusted_keys, as_json):
    """Run ARTIFACT's exported forward on a batch with ONNX Runtime and time it.

    ARTIFACT is a folder made by `aot build` (its ONNX file is checked against the manifest's
    sha256 first; it holds no weights: the initial weights are made by replaying the artifact's
    init program and handed to ONNX Runtime in memory) or an .onnx file made by `aot export`
    (with its OUTPUT.data beside it if it has one). Graph optimizations run at the extended
    level; --warmup runs come before the --iters timed ones; latency (p50, p90) and throughput
    are printed. A file exported with --precision bf16 needs a GPU provider: ONNX Runtime's CPU
    provider has no bf16 kernels, so it is refused there (fp16 runs on CPU).

    \b
        aot infer artifacts/gpt --input artifacts/gpt/data/example_batch.safetensors -o out.safetensors
    """
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors
    from safetensors.torch import save as save_safetensors

    from runner.errors import AotError
    from runner.execution.infer import load
    from runner.format.integrity import check_writable_target
    from runner.format.signing import read_public_key

    if output is not None:
        check_writable_target(output, "file")
    keys = [read_public_key(k) for k in trusted_keys]
    try:
        tensors = load_safetensors(Path(input_file).read_bytes())
    except FileNotFoundError:
        raise AotError(f"{input_file}: no such input file") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise AotError(f"{input_file}: not a readable safetensors file ({e})") from None
    session = load(artifact, provider, warn=lambda msg: click.echo(msg, err=True), trusted_keys=keys or None)
    outputs, timing = session.benchmark(tensors, warmup=warmup, iters=iters, where=str(input_file))
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = output.with_name(output.name + ".tmp")
        try:
            tmp.write_bytes(save_safetensors({k: v.contiguous() for k, v in outputs.items()}))
            tmp.replace(output)
        finally:
            tmp.unlink(missing_ok=True)
    timing["outputs"] = {name: [list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in outputs.items()}
    timing["output_file"] = str(output) if output is not None else None
    if as_json:
        click.echo(json.dumps(timing, indent=1))
    else:
        click.echo(
            f"{timing['iters']} runs on {timing['provider']}, batch {timing['batch_size']}: "
            f"p50 {timing['latency_ms_p50']:.3f} ms, p90 {timing['latency_ms_p90']:.3f} ms, "
            f"{timing['samples_per_s']:.0f} samples/s" + (f"; outputs written to {output}" if output is not None else ""),
            err=True,
        )


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("model_file", type=click.Path(path_type=Path))
@click.option("--checkpoint", type=click.Path(path_type=Path), required=True, help="Checkpoint folder written by `aot run --save`.")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="ONNX file to write. Default: the checkpoint folder's name with .onnx, beside it.")
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    default="fp32",
    show_default=True,
    help="The dtype the exported model computes in: the weights are stored in it and the forward runs in "
    "it (as eager model.to(dtype)). Inputs and outputs stay float32 (cast on entry and exit), so the "
    "same --input files and clients work. fp16 runs on the CPU provider too (fp32 kernels between "
    "fp16 values); bf16 needs a GPU provider (CUDA, TensorRT): ONNX Runtime's CPU provider has no "
    "bf16 kernels, and `aot infer` refuses it there.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
@debug_option
def export(artifact, model_file, checkpoint, output, precision, as_json):
    """Export a checkpoint's trained weights to ONNX, as `aot build` exports the initial ones.

    MODEL_FILE must be the model file ARTIFACT was built from (its sha256 is checked against the
    manifest): the export traces the model's forward (on fake tensors: the model is not built for
    real), which lives in the model file, not the artifact. Weights over ONNX's 2 GiB limit are
    written as ONNX external data beside the file (OUTPUT.data). When the weights are at most
    1 GiB, the written file is checked with ONNX Runtime against eager PyTorch on the example batch.
    With --precision bf16 or fp16 the reference is eager PyTorch in that dtype on the same rounded
    weights, within 4 times its own distance from eager fp32 on that batch; bf16 is checked with
    onnx's reference evaluator instead (ONNX Runtime cannot run bf16 on CPU), up to 128 MiB of weights.

    \b
        aot export artifacts/gpt examples/gpt.py --checkpoint ckpt/ -o gpt.onnx
        aot export artifacts/gpt examples/gpt.py --checkpoint ckpt/ -o gpt16.onnx --precision fp16
        aot infer gpt.onnx --input batch.safetensors
    """
    from aot.emit.onnx_checkpoint import export_checkpoint
    from runner.commands.formatting import human

    output = output if output is not None else Path(str(Path(checkpoint)).rstrip("/\\") + ".onnx")
    result = export_checkpoint(artifact, model_file, checkpoint, output, precision=precision, warn=lambda msg: click.echo(msg, err=True))
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        where = f"in {result['weights_file']} ({human(result['weights_bytes'])})" if result["weights_file"] else "inside"
        check = (
            "not checked"
            if result["max_abs_diff"] is None
            else f"max |{result['checked_with']} - eager| = {result['max_abs_diff']:.3g}"
            + (f" (tolerance {result['tolerance']:.3g})" if precision != "fp32" else "")
        )
        click.echo(
            f"wrote {output} ({human(result['bytes'])}, the weights of step {result['step']} {where}"
            + (f", computing in {precision}" if precision != "fp32" else "")
            + f", opset {result['opset']}; {check})",
            err=True,
        )
