"""The `aot` command line: build, run, inspect, verify and checkpoint tools.

Imports are deferred into each command so `aot run` on a production node loads only the runner.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from aot import cli_options as options
from aot.defaults import DEFAULT_BUCKET_MB
from aot.inference_cli import export as export_command, infer as infer_command
from aot.plan_cli import calibrate as calibrate_command, plan as plan_command
from aot.topology_cli import topology as topology_group
from runner.commands.cli import run as run_command
from runner.commands.evaluate import evaluate as eval_command
from runner.commands.console import console_main, debug_option


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@debug_option
@click.version_option(package_name="aot")
def cli():
    """Compile a whole distributed training step ahead of time; train from it with no model code.

    \b
    Typical use:
        aot build examples/gpt.py --world-size 2 -o artifacts/
        aot inspect artifacts/
        torchrun --nproc-per-node 2 -m aot run artifacts/ --steps 50
        aot verify artifacts/ examples/gpt.py

    Every command prints one line and exits non-zero on bad input; --debug shows tracebacks.
    """


def default_world_size(strategy: str | None, topology: str | None, nodes: int | None) -> int:
    """`aot build`'s ranks where --world-size is not given: the product of --strategy's degrees;
    with --strategy auto, every GPU of every node (cpu profiles: one rank per node), as `aot plan`."""
    from aot.plan.mesh import Mesh

    if strategy != "auto":
        return Mesh.parse(strategy, None).world_size
    from runner.hardware.nvml_probe import live_profile
    from runner.hardware.topology import every_rank, for_nodes, load_profile

    return every_rank(for_nodes(load_profile(topology) if topology else live_profile(), nodes))


@cli.command()
@click.argument("model_file", type=click.Path(path_type=Path))
@click.option("--topology", metavar="PROFILE", help="Built-in profile name (e.g. cpu) or a profile JSON file. Default: this machine.")
@options.nodes("Nodes the job spans (one rank per GPU, ranks split evenly). Default: the profile's node count.")
@options.world_size(
    "Number of ranks to build for. Default: the product of --strategy's degrees; with --strategy auto, every GPU of every node "
    "(cpu profiles: one rank per node), as `aot plan`."
)
@click.option(
    "--strategy",
    metavar="AXIS=N[,...]",
    help="Mesh as axis=degree pairs: dp=4 (data parallel), fsdp=4 (sharded, ZeRO-3), tp=2 (tensor parallel), "
    "pp=2 (pipeline stages, first), ep=2 (a mixture-of-experts model's experts split, tokens sent by all_to_all), "
    "combined as dp=2,tp=2, fsdp=2,tp=2, pp=2,dp=2 or ep=2,fsdp=2; or auto: the best plan of "
    "`aot plan`. Default: data parallel over all ranks.",
)
@click.option("--microbatches", type=int, default=None, help="With pp: microbatches each rank's --batch-size is split into (equal sizes). Default: pp.")
@click.option(
    "--pp-schedule",
    type=click.Choice(["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]),
    default="1f1b",
    show_default=True,
    help="With pp: the order of microbatch forwards and backwards, as torch.distributed.pipelining's schedules "
    "of the same names (1f1b holds at most pp microbatches' activations; interleaved-1f1b runs "
    "--stages-per-rank model chunks per rank for a smaller bubble; zero-bubble splits each backward into "
    "input and weight gradients and runs the weight gradients where 1f1b waits, holding at most pp microbatches "
    "on every rank).",
)
@click.option("--stages-per-rank", type=int, default=None, help="With --pp-schedule interleaved-1f1b: model chunks per pipeline rank (default 2).")
@options.sequence_parallel(
    "With tp: split the residual stream between blocks along the sequence, so norms and dropouts run "
    "on 1/tp of the tokens and row-wise outputs are reduce-scattered instead of all-reduced.",
)
@click.option(
    "--sync-batchnorm",
    is_flag=True,
    help="Convert every BatchNorm to SyncBatchNorm (torch's convert_sync_batchnorm): batch statistics over the "
    "data-parallel ranks (dp and fsdp), all-reduced inside the graph, instead of each rank's own batch as "
    "eager DDP computes them. A model without BatchNorm is refused.",
)
@options.moe_capacity_factor(
    "With ep: each rank sends each expert at most F x (its tokens x top-k / experts) token choices; "
    "the rest are dropped (first choices are kept before second choices; the count is in aot run --metrics). "
    "Default: dropless, every token an expert is routed (the send buffer then holds experts x tokens rows)."
)
@options.batch_size
@click.option("--max-steps", type=int, default=1000, show_default=True, help="Steps of learning-rate schedule to store.")
@click.option("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB, show_default=True, help="Gradient bucket size for all_reduce, in MiB.")
@click.option(
    "--prefetch-mb",
    type=float,
    default=None,
    help="FSDP: MiB of full parameters that may be gathered ahead of their use (larger hides more of a slow "
    "link, for more memory). Default: one parameter ahead, as FSDP does.",
)
@options.hierarchical(
    "All_reduces over a group that spans nodes: reduce inside each node, cross the network with 1/g of the "
    "bytes, gather inside the node (three collectives over sub-groups). auto: each all_reduce where the "
    "topology's cost model says it is cheaper.",
)
@options.precision(
    "Compute dtype: forward and loss run under torch.autocast with the target's device rules (a CUDA "
    "profile traces CUDA's policy even on a CPU-only machine), master weights and optimizer state stay "
    "fp32; fsdp all-gathers parameters in it. fp16 adds GradScaler's dynamic loss scaling inside the "
    "graph (overflowing steps are skipped). Default: the model file's `precision`, else fp32.",
)
@options.reduce_dtype(
    "Dtype gradients are reduced in (dp all_reduce, fsdp reduce-scatter): fp32, or the --precision dtype "
    "for half the bytes. Default: the model file's `reduce_dtype`, else fp32.",
)
@click.option(
    "--memory-budget",
    metavar="SIZE",
    help="Peak memory per rank the step must fit (70, 70GiB, 512MiB; a bare number is GiB): forward values "
    "backward reads are recomputed in backward, as few and as cheap as the cost model finds, until the "
    "predicted peak is under it. A budget no recomputation reaches is refused with the smallest there is. "
    "Default: the profile's device memory (less 10% headroom), so a step that fits recomputes nothing.",
)
@click.option(
    "--activation-budget",
    type=float,
    metavar="FRACTION",
    help="Instead: the fraction of saved activation bytes kept (1.0: nothing recomputed, 0.5: half; cheapest "
    "per byte first, then whole layers). The model file's `recompute` (module patterns, e.g. "
    '["blocks.*"]) is used when neither flag is given.',
)
@options.seed("Initial weights are those of torch.manual_seed(seed); model().")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=Path("artifacts"), show_default=True, help="Artifact folder to write.")
@click.option("--sign", "sign_key", type=click.Path(path_type=Path), help="Sign the artifact with this Ed25519 private key (see `aot keygen`).")
@click.option(
    "--onnx/--no-onnx",
    default=None,
    help="Also export the forward to ONNX for `aot infer` (default: yes if the model can be, else a warning; --onnx: or fail).",
)
@click.option(
    "--eval/--no-eval",
    "eval",
    default=True,
    show_default=True,
    help="Also emit each rank's eval program (forward and loss in eval mode, no backward) for `aot run --eval-data` and `aot eval`.",
)
@click.option(
    "--compile",
    "compile_tier",
    type=click.Choice(["portable", "aoti"]),
    default="portable",
    show_default=True,
    help="portable: ship the program as export-schema JSON only, which runs on any device with this torch "
    "release. aoti: also compile it with AOTInductor into native code for this machine's device kind "
    "(needs a C++ compiler; 20-90 s per program on 2 cores); `aot run` uses it where device kind, "
    "CPU level and torch build match, else the portable program with a notice.",
)
@click.option("--quiet", is_flag=True, help="No progress display.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary of the build on stdout.")
@debug_option
def build(model_file, compile_tier, quiet, as_json, **flags):
    """Trace MODEL_FILE's whole training step into per-rank artifacts.

    MODEL_FILE defines model() and batch(batch_size), and optionally loss(outputs, targets),
    optimizer(params), scheduler(optimizer), max_grad_norm and precision (see README). Forward, loss,
    backward, gradient collectives and optimizer update become one static graph, traced on fake
    tensors: any world size builds on this machine, and no collective runs.
    """
    from aot.build import BuildOptions, build as run_build
    from aot.progress import Progress
    from runner.commands.formatting import human

    if flags["world_size"] is None:
        flags["world_size"] = default_world_size(flags["strategy"], flags["topology"], flags["nodes"])
    options = BuildOptions(model_path=model_file, compile=compile_tier, **flags)  # every other option is a field of the same name
    progress = Progress(total=6 + (options.onnx is not False) + (compile_tier == "aoti"), quiet=quiet or as_json)
    manifest = run_build(options, progress)
    # the busiest training program's collectives (pipeline ranks run different programs)
    training = sorted({r["program"] for r in manifest["ranks"]})
    program = max((manifest["programs"][name] for name in training), key=lambda p: sum(c["bytes"] for c in p["collectives"]))
    summary = {
        "output": str(options.output),
        "world_size": manifest["world_size"],
        "programs": len(training),  # training programs; each rank also has an eval program
        "eval_programs": len({r["eval_program"] for r in manifest["ranks"] if r.get("eval_program")}),
        "collectives_per_step": len(program["collectives"]),
        "collective_bytes_per_step": sum(c["bytes"] for c in program["collectives"]),
        "total_bytes": sum(f["size"] for f in manifest["files"].values()),
        "seconds": round(progress.elapsed(), 3),
        "inference": manifest.get("inference", {}).get("file"),
        "compiled": {name: p["file"] for name, p in manifest["compiled"]["programs"].items()} if manifest.get("compiled") else None,
        "memory": manifest["memory"],
    }
    if as_json:
        click.echo(json.dumps(summary, indent=1))
    elif not quiet:
        click.echo(
            f"built {summary['world_size']} rank(s), {summary['programs']} training program{'s' if summary['programs'] > 1 else ''} "
            f"({'and ' + str(summary['eval_programs']) + ' eval' if summary['eval_programs'] else 'no eval program'}), "
            f"{summary['collectives_per_step']} collective(s) per step ({human(summary['collective_bytes_per_step'])}), "
            f"{human(summary['total_bytes'])} in {options.output}/ in {summary['seconds']:.1f} s",
            err=True,
        )
        click.echo(f"next: torchrun --nproc-per-node {summary['world_size']} -m aot run {options.output} --steps 10", err=True)


cli.add_command(run_command)
cli.add_command(eval_command)
cli.add_command(topology_group)
cli.add_command(infer_command)
cli.add_command(export_command)
cli.add_command(plan_command)
topology_group.add_command(calibrate_command)


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--profile",
    "profile_dir",
    type=click.Path(path_type=Path),
    help="A folder written by `aot run --profile DIR`: show measured step, compute and exposed "
    "communication times next to the plan's prediction, and each rank's measured peak memory next to "
    "the build's predicted peak.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@debug_option
def inspect(artifact, profile_dir, as_json):
    """Show ARTIFACT's ranks, programs, parameters, collectives per step and files."""
    from runner.format.artifact import Artifact
    from runner.commands.artifact_summary import compare_profile, render, summarize
    from runner.execution.profiling import read_summary

    summary = summarize(Artifact(artifact, any_torch=True))  # the manifest only: any torch reads it
    if profile_dir is not None:
        summary["measured"] = compare_profile(summary, read_summary(profile_dir))
    click.echo(json.dumps(summary, indent=1) if as_json else render(summary))


@cli.command()
@click.argument("a", metavar="A", type=click.Path(path_type=Path))
@click.argument("b", metavar="B", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="The same comparison as JSON on stdout.")
@debug_option
def diff(a, b, as_json):
    """What changed from artifact A to artifact B, for a reviewer.

    \b
    build     build arguments, torch and aot releases, topology profile, model
    plan      mesh, placement, strategy, buckets, sharding, tensor and pipeline
              parallelism, precision, recomputation, NCCL algorithms; predicted
              step time and memory per rank, A and B side by side with B/A
    programs  per set of ranks: collectives per step (kind, group, bytes) added,
              removed or resized, and the graph operators whose count changed

    \b
    Every file both manifests list is checked against its sha256 first; equal
    artifacts print one line, "identical: ...".
    Exit status, as diff(1): 0 identical, 1 different, 2 trouble (an artifact
    missing, altered or not an artifact: one line `aot: error: ...`; not 1 as
    for other commands, where 1 here means "different").
    """
    from runner.commands.diff import compare, render
    from runner.errors import AotError

    try:
        result = compare(a, b)
    except AotError as e:
        e.exit_status = 2  # 1 means "different"
        raise
    click.echo(json.dumps(result, indent=1) if as_json else render(result))
    if not result["identical"]:
        raise SystemExit(1)


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("model_file", type=click.Path(path_type=Path))
@click.option("--steps", default=5, show_default=True, type=click.IntRange(min=1))
@click.option("--data", type=click.Path(path_type=Path), help="Data file as for `aot run` (default: the example batch).")
@click.option("--tolerance", default=1e-5, show_default=True, type=float, help="Largest allowed difference of losses and weights.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@debug_option
def verify(artifact, model_file, steps, data, tolerance, as_json):
    """Prove ARTIFACT trains like eager PyTorch before shipping it.

    Runs the artifact's ranks as local CPU processes (gloo, under torchrun) next to eager PyTorch
    DistributedDataParallel built from MODEL_FILE, on the same data, and compares the losses of
    every step and the final weights. Exits non-zero past --tolerance.
    """
    from aot.verify import verify as run_verify

    result = run_verify(artifact, model_file, steps=steps, data=data, tolerance=tolerance)
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        click.echo(
            f"{result['steps']} steps on {result['world_size']} rank(s): "
            f"max |loss - eager| = {result['max_loss_diff']:.3g}, "
            f"max |weight - eager| = {result['max_weight_diff']:.3g} ({result['worst_weight']}) "
            f"(tolerance {tolerance:g}): {'OK' if result['ok'] else 'FAILED'}"
        )
        # where to look: the parameters furthest from eager, largest first
        for name, diff in sorted(result["weight_diffs"].items(), key=lambda kv: -kv[1])[:5]:
            click.echo(f"  {diff:10.3g}  {name}")
    if not result["ok"]:
        raise SystemExit(1)


@cli.command()
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Private key file to write; the public key goes to OUTPUT.pub.")
@debug_option
def keygen(output):
    """Make an Ed25519 key pair for signing artifacts.

    Build with `aot build --sign KEY`; clusters run with `aot run --trusted-key KEY.pub` and refuse
    artifacts that are unsigned, altered after signing, or signed by another key.
    """
    from runner.format.signing import generate_keypair

    public = generate_keypair(output)
    click.echo(f"wrote private key {output} (keep it secret) and public key {public}", err=True)


@cli.group()
def checkpoint():
    """Work with checkpoints written by `aot run --save`."""


@checkpoint.command()
@click.argument("folder", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="safetensors file to write.")
@debug_option
def merge(folder, output):
    """Write FOLDER's full model weights to one safetensors file that model().load_state_dict() accepts."""
    from runner.format.checkpoint import merge_checkpoint

    count = merge_checkpoint(folder, output)
    click.echo(f"wrote {count} tensors to {output}", err=True)


def main() -> None:
    from aot.garbage_collection import command_ends_process

    command_ends_process()  # the process ends with the command: its objects are not collected first
    console_main(cli, "aot")


if __name__ == "__main__":
    main()
